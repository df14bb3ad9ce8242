"""The GradScaler flow analysis (flake8_amp.analysis.scaler) over real source parsed by astroid."""

from __future__ import annotations

import ast
import textwrap

import pytest
from astroid import nodes

from flake8_amp.analysis.scaler import (
    HELPED,
    SCALED,
    UNSCALED,
    ScalerFlow,
    calls_in_order,
    condition_key,
    scaler_analysis,
)
from flake8_amp.engine import Context, build_module


def module_of(source: str) -> nodes.Module:
    source = textwrap.dedent(source)
    return build_module(ast.parse(source), source)


def flow_of(source: str, function: str = "step") -> ScalerFlow:
    module = module_of(source)
    target = next(f for f in module.nodes_of_class(nodes.FunctionDef) if f.name == function)
    return scaler_analysis(Context(module)).flow(target)


def call(flow: ScalerFlow, text: str, occurrence: int = 0) -> nodes.Call:
    """The ``occurrence``-th call in the flow's function whose source is ``text``."""
    matches = [c for c in calls_in_order(flow.scope) if c.as_string() == text]
    return matches[occurrence]


def test_scalers_are_built_or_used_as_scalers():
    flow = flow_of("""
        import torch
        def step(model, batch, opt, param_scaler, transform):
            local = torch.amp.GradScaler("cuda")
            param_scaler.scale(model(batch)).backward()
            local.update()
            transform.step()
        """)
    assert set(flow.scalers) == {"local", "param_scaler"}
    assert flow.scalers["local"].enabled_constructions
    assert not flow.scalers["param_scaler"].enabled_constructions  # no call site: unknown


def test_a_parameter_scaler_is_built_where_its_call_sites_pass_it():
    module = module_of("""
        import torch
        def epoch(model, batch, scaler, helper_scaler):
            scaler.scale(model(batch)).backward()
            helper_scaler.update()
        def main(model, batch, use_amp):
            grad_scaler = torch.amp.GradScaler("cuda")
            flagged = torch.amp.GradScaler("cuda", enabled=use_amp)
            epoch(model, batch, grad_scaler, grad_scaler)
            epoch(model, batch, scaler=flagged, helper_scaler=None)
        """)
    epoch = next(f for f in module.nodes_of_class(nodes.FunctionDef) if f.name == "epoch")
    flow = scaler_analysis(Context(module)).flow(epoch)
    scaler = flow.scalers["scaler"]
    assert [c.lineno for c in scaler.constructions] == [7, 8]
    assert [c.lineno for c in scaler.enabled_constructions] == [7]
    # passed a GradScaler (or None) by the call sites: a scaler here, whatever it is used for
    assert [c.lineno for c in flow.scalers["helper_scaler"].constructions] == [7]


def test_scalers_of_other_libraries_are_not_grad_scalers():
    flow = flow_of("""
        from drjit.opt import GradScaler
        def step(opt, loss):
            scaler = GradScaler(debug=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
        """)
    assert flow.scalers == {}


def test_self_attribute_scaler_from_init():
    flow = flow_of("""
        from torch.cuda.amp import GradScaler
        class Trainer:
            def __init__(self):
                self.scaler = GradScaler(enabled=True)
            def step(self, loss, opt):
                self.scaler.step(opt)
        """)
    assert list(flow.scalers) == ["self.scaler"]
    assert flow.scalers["self.scaler"].enabled_constructions


@pytest.mark.parametrize(
    "enabled, counted, surely",
    [("False", False, False), ("use_amp", True, False), ("True", True, True)],
)
def test_enabled_argument(enabled, counted, surely):
    flow = flow_of(f"""
        import torch
        def step(model, batch, use_amp):
            scaler = torch.amp.GradScaler("cuda", enabled={enabled})
            scaler.scale(model(batch)).backward()
        """)
    assert ("scaler" in flow.scalers) is counted
    if counted:
        assert bool(flow.scalers["scaler"].enabled_constructions) is surely


def test_phases_follow_backward_unscale_and_step():
    flow = flow_of("""
        def step(model, batch, opt, scaler, clip):
            loss = model(batch)
            scaler.scale(loss).backward()
            clip(model)
            scaler.unscale_(opt)
            clip(model)
            scaler.step(opt)
            scaler.update()
            clip(model)
        """)
    assert flow.phases_before(call(flow, "clip(model)", 0)) == {SCALED}
    assert flow.phases_before(call(flow, "clip(model)", 1)) == {UNSCALED}
    assert flow.phases_before(call(flow, "clip(model)", 2)) == {None}
    assert [c.as_string() for c in flow.scaled_backwards] == ["scaler.scale(loss).backward()"]


def test_scaled_loss_alias_and_rebinding():
    flow = flow_of("""
        def step(model, batch, opt, scaler):
            loss = scaler.scale(model(batch))
            loss.backward()
            opt.step()
            loss = model.regularizer()
            loss.backward()
            opt.zero_grad()
        """)
    assert len(flow.scaled_backwards) == 1
    assert flow.phases_before(call(flow, "opt.step()")) == {SCALED}


def test_correlated_amp_conditions_take_the_same_arm():
    flow = flow_of("""
        def step(model, batch, opt, scaler, args):
            loss = model(batch)
            if args.amp:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
        """)
    assert flow.phases_before(call(flow, "opt.step()")) == {None}
    assert flow.phases_before(call(flow, "scaler.step(opt)")) == {SCALED}


def test_uncorrelated_merge_keeps_both_paths():
    flow = flow_of("""
        def step(model, batch, opt, scaler, use_amp, clip):
            loss = model(batch)
            if use_amp:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            clip(model)
        """)
    assert flow.phases_before(call(flow, "clip(model)")) == {SCALED, None}


def test_early_return_ends_the_path():
    flow = flow_of("""
        def step(model, batch, opt, scaler):
            loss = model(batch)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                return loss
            loss.backward()
            opt.step()
        """)
    assert flow.phases_before(call(flow, "opt.step()")) == {None}


def test_loop_exits_carry_states_after_the_loop():
    flow = flow_of("""
        def step(model, loader, opt, scaler, done):
            for batch in loader:
                scaler.scale(model(batch)).backward()
                if done(batch):
                    break
                scaler.unscale_(opt)
            done(opt)
        """)
    assert flow.phases_before(call(flow, "done(opt)")) == {None, SCALED, UNSCALED}


def test_helper_receiving_the_scaler():
    flow = flow_of("""
        def step(model, batch, opt, scaler, backward_and_step, log):
            loss = model(batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            backward_and_step(loss, opt, scaler)
            log(opt)
        """)
    assert flow.phases_before(call(flow, "log(opt)")) == {HELPED}
    assert flow.steps_without_update() == []


def test_steps_without_update():
    flow = flow_of("""
        def step(model, batch, opt_a, opt_b, scaler, last):
            scaler.scale(model(batch)).backward()
            scaler.step(opt_a)
            if last:
                scaler.update()
            scaler.step(opt_b)
        """)
    assert [c.as_string() for c in flow.steps_without_update()] == ["scaler.step(opt_b)"]
    # An update does not give the gradients back: opt_a stepped them on both paths.
    assert flow.stepped_before(call(flow, "scaler.step(opt_b)"), "opt_a") is True
    assert flow.stepped_before(call(flow, "scaler.step(opt_b)"), "opt_b") is False


def test_no_scaler_arm():
    flow = flow_of("""
        def step(model, batch, opt, scaler, fp16):
            loss = model(batch)
            if fp16:
                scaler.scale(loss).backward()
                scaler.step(opt)
            else:
                loss.backward()
                opt.step()
        """)
    assert flow.in_no_scaler_arm(call(flow, "opt.step()"))
    assert not flow.in_no_scaler_arm(call(flow, "scaler.step(opt)"))


def test_many_independent_conditions_stay_bounded():
    branches = "\n".join(f"    if flag_{i}:\n        scaler.unscale_(opt)" for i in range(40))
    source = (
        "def step(model, batch, opt, scaler, **flags):\n"
        f"    scaler.scale(model(batch)).backward()\n{branches}\n    opt.step()\n"
    )
    flow = flow_of(source)
    assert flow.phases_before(call(flow, "opt.step()")) == {SCALED, UNSCALED}


def test_function_without_scalers_is_not_walked():
    flow = flow_of("""
        def step(model, batch, opt):
            model(batch).backward()
            opt.step()
        """)
    assert flow.scalers == {} and flow.states_before == {}


@pytest.mark.parametrize(
    "test, expected",
    [
        ("use_amp", ("<amp enabled>", True)),
        ("not args.fp16", ("<amp enabled>", False)),
        ("scaler is None", ("<amp enabled>", False)),
        ("self.scaler is not None", ("<amp enabled>", True)),
        ("scaler.is_enabled()", ("<amp enabled>", True)),
        ("self.do_grad_scaling", ("<amp enabled>", True)),
        ("clip_grad is not None", ("clip_grad", True)),
        ("args.mode == 'train'", ("args.mode == 'train'", True)),
        ("(step + 1) % accum == 0", None),
        ("a and b", None),
        ("example", ("example", True)),  # "example" is not the word "amp"
    ],
)
def test_condition_key(test, expected):
    module = module_of(f"if {test}:\n    pass\n")
    assert condition_key(module.body[0].test) == expected


def test_calls_in_order_is_evaluation_order_and_skips_nested_scopes():
    module = module_of("""
        scaler.scale(loss(x)).backward()
        f(lambda: g())
        """)
    order = [c.as_string() for statement in module.body for c in calls_in_order(statement)]
    assert order == [
        "loss(x)",
        "scaler.scale(loss(x))",
        "scaler.scale(loss(x)).backward()",
        "f(lambda: g())",
    ]


def test_method_that_unscales_is_a_helper():
    flow = flow_of("""
        import torch
        class Trainer:
            def __init__(self):
                self.scaler = torch.amp.GradScaler("cuda")
            def _unscale(self, opt):
                self.scaler.unscale_(opt)
            def _log(self, opt):
                print(opt)
            def step(self, loss, opt, clip):
                self.scaler.scale(loss).backward()
                self._log(opt)
                clip(opt)
                self._unscale(opt)
                clip(opt)
        """)
    assert flow.phases_before(call(flow, "clip(opt)", 0)) == {SCALED}
    assert flow.phases_before(call(flow, "clip(opt)", 1)) == {HELPED}


def test_scaler_updated_by_the_caller_or_another_method():
    module = module_of("""
        import torch
        def helper(scaler, opt):
            scaler.unscale_(opt)
            scaler.step(opt)
        def orphan(scaler, opt, loss):
            scaler.scale(loss).backward()
            scaler.step(opt)
        def helper_called_elsewhere(scaler, opt):
            scaler.unscale_(opt)
            scaler.step(opt)
        def train(loss, opt):
            scaler = torch.amp.GradScaler("cuda")
            scaler.scale(loss).backward()
            helper(scaler, opt)
            scaler.update()
        class Trainer:
            def step(self, opt):
                self.scaler.unscale_(opt)
                self.scaler.step(opt)
            def end(self):
                self.scaler.update()
        GLOBAL_SCALER = torch.amp.GradScaler("cuda")
        def global_step(opt):
            GLOBAL_SCALER.step(opt)
        def main(opt):
            global_step(opt)
            GLOBAL_SCALER.update()
        """)
    analysis = scaler_analysis(Context(module))
    receivers = {
        c.scope().name: c.func.expr
        for c in module.nodes_of_class(nodes.Call)
        if c.as_string() in ("scaler.step(opt)", "self.scaler.step(opt)", "GLOBAL_SCALER.step(opt)")
    }
    assert analysis.updated_elsewhere(receivers["helper"])
    assert not analysis.updated_elsewhere(receivers["orphan"])
    assert analysis.updated_elsewhere(receivers["helper_called_elsewhere"])
    assert analysis.updated_elsewhere(receivers["step"])
    assert analysis.updated_elsewhere(receivers["global_step"])


def test_scaled_on_entry_needs_a_later_step_and_no_unscale_in_reach():
    source = """
        import torch
        class Trainer:
            def __init__(self, optimizer):
                self.optimizer = optimizer
                self.scaler = torch.amp.GradScaler("cuda")
            def backward(self, loss):
                self.scaler.scale(loss).backward()
            def step(self, params):
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
        """
    flow = flow_of(source)
    clip = "torch.nn.utils.clip_grad_norm_(params, 1.0)"
    assert flow.scaled_on_entry(call(flow, clip, 0))
    assert not flow.scaled_on_entry(call(flow, clip, 1))  # no step after it
    unscaled = source.replace(
        "loss).backward()", "loss).backward()\n                self.scaler.unscale_(self.optimizer)"
    )
    flow = flow_of(unscaled)
    assert not flow.scaled_on_entry(call(flow, clip, 0))
