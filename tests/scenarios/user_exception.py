"""EXPECT: none
MAY: none
FAULT: the user's own code raises mid-run inside the guard, twice, in two places the
guard wraps: (a) at step 7 (a watched step: "the first `Thresholds.watch_steps` (default
8)") the model's head raises `LabelRangeError` from inside `model(x)` after the backbone
ran under fp16 autocast; (b) at step 5 a tensor hook the user registered on the hidden
activation raises `GradHookError` from inside `scaler.scale(loss).backward()`. The
numerics are otherwise a healthy fp16 + GradScaler MLP (the plain run checks: no skipped
step, finite losses, grad norms far below 100). index.md, "Left on for a month":
"Your own calls run exactly once, and their exceptions reach you unchanged." and
"Leaving the guard (normally or by exception) removes every hook and mode it installed"
(DESIGN.md section 4), "It never changes numerics". So the exception object that
reaches the caller must be the very object raised (same type, args, no __cause__ /
__context__ added, traceback ending in the user's raise line); the losses and weights
up to the exception must equal an unguarded run with the same exception bit for bit;
the torch-level state (function-mode stack, global module/optimizer hooks, patched
methods, grad/autocast/anomaly modes, per-object hooks and attributes) must be as
before; and a plain full run after both guarded runs must be bit-identical to the
plain full run made before any guard. No event is expected: nothing numeric is wrong
and a user exception is not a finding (no AMP100 either: "Nothing the guard's own code
raises reaches your loop"; here nothing of the guard's fails). Must not fire: anything,
in particular AMP100, AMP112/AMP103 (the loss and gradients of completed steps are
finite), AMP010 (a GradScaler is active).
"""
import json
import sys
import threading
import warnings

import torch
from torch import nn
import torch.nn.functional as F

torch.set_num_threads(1)
torch.manual_seed(0)

import amp_runtime  # noqa: E402

STEPS = 20


class LabelRangeError(ValueError):
    def __init__(self, msg, label):
        super().__init__(msg)
        self.label = label


class GradHookError(RuntimeError):
    pass


RAISED = []  # the exception objects our code raised, to check identity


class Head(nn.Module):
    def __init__(self, d, n_classes):
        super().__init__()
        self.fc = nn.Linear(d, n_classes)
        self.n_classes = n_classes

    def forward(self, h, y):
        logits = self.fc(h)
        if int(y.max()) >= self.n_classes:  # user's own validation, mid-forward
            exc = LabelRangeError(f"label {int(y.max())} >= {self.n_classes}", label=int(y.max()))
            RAISED.append(exc)
            raise exc
        return logits


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = Head(64, 4)
        self.hook_step = None  # set by the training loop: raise from a grad hook at this step
        self.step = 0

    def forward(self, x, y):
        h = self.backbone(x)
        if self.hook_step is not None and self.step == self.hook_step:
            def bad_hook(grad):
                exc = GradHookError("gradient hook refused step %d" % self.step)
                RAISED.append(exc)
                raise exc
            h.register_hook(bad_hook)
        return self.head(h, y)


def batches():
    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(16, 4, generator=g)
    out = []
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=g)
        y = (x @ w_true).argmax(dim=1)
        out.append((x, y))
    return out


DATA = batches()


def train(raise_label_at=None, raise_hook_at=None, record=None):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    model.hook_step = raise_hook_at
    losses, scales = [], []
    if record is not None:
        record.update(model=model, opt=opt, scaler=scaler, losses=losses, scales=scales)
    for step, (x, y) in enumerate(DATA):
        model.step = step
        if raise_label_at is not None and step == raise_label_at:
            y = y.clone()
            y[3] = 9  # a corrupt label the model's own check rejects
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x, y)
            loss = F.cross_entropy(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(float(scaler.get_scale()))
        if record is not None:
            record.setdefault("gnorms", []).append(float(gn))
    return model, losses, scales


def same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)
    return bool((bits | (torch.isnan(a) & torch.isnan(b))).all())


def compare(la, lb, ma, mb):
    lm = len(la) == len(lb) and all(same(a, b) for a, b in zip(la, lb))
    sa, sb = ma.state_dict(), mb.state_dict()
    wm = sa.keys() == sb.keys() and all(same(sa[k], sb[k]) for k in sa)
    return lm, wm


def torch_state():
    mm = torch.nn.modules.module
    st = {
        "fn_mode_stack": torch._C._len_torch_function_stack(),
        "grad": torch.is_grad_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "autocast_dtype": str(torch.get_autocast_dtype("cpu")),
        "anomaly": torch.is_anomaly_enabled(),
        "trace": repr(sys.gettrace()),
        "profile": repr(sys.getprofile()),
        "warn_filters": len(warnings.filters),
        "threads": threading.active_count(),
        "num_threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()),
        "saved_tensor_hooks": repr(torch._C._autograd._top_saved_tensors_default_hooks(False)),
    }
    try:
        from torch.utils._python_dispatch import _len_torch_dispatch_stack
        st["dispatch_mode_stack"] = _len_torch_dispatch_stack()
    except Exception as e:  # pragma: no cover
        st["dispatch_mode_stack"] = repr(e)
    for name in dir(mm):
        if name.startswith("_global_") and isinstance(getattr(mm, name), dict):
            st["nn." + name] = len(getattr(mm, name))
    import torch.optim.optimizer as oo
    for name in dir(oo):
        if name.startswith("_global_optimizer"):
            st["optim." + name] = len(getattr(oo, name))
    funcs = {
        "Tensor.backward": torch.Tensor.backward,
        "autograd.backward": torch.autograd.backward,
        "autograd.grad": torch.autograd.grad,
        "_foreach_norm": torch._foreach_norm,
        "clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "clip_grad.clip_grad_norm_": torch.nn.utils.clip_grad.clip_grad_norm_,
        "GradScaler.scale": torch.amp.GradScaler.scale,
        "GradScaler.unscale_": torch.amp.GradScaler.unscale_,
        "GradScaler.step": torch.amp.GradScaler.step,
        "GradScaler.update": torch.amp.GradScaler.update,
        "Optimizer.zero_grad": torch.optim.Optimizer.zero_grad,
        "SGD.step": torch.optim.SGD.step,
        "Module.__call__": nn.Module.__call__,
        "Module._call_impl": nn.Module._call_impl,
        "Function.apply": torch.autograd.Function.apply,
        "F.cross_entropy": F.cross_entropy,
        "F.linear": F.linear,
    }
    import inspect
    for k, f in funcs.items():
        owner, _, attr = k.rpartition(".")
        if owner in ("Function", "GradScaler", "Optimizer", "SGD", "Module"):
            cls = {"Function": torch.autograd.Function, "GradScaler": torch.amp.GradScaler,
                   "Optimizer": torch.optim.Optimizer, "SGD": torch.optim.SGD, "Module": nn.Module}[owner]
            f = inspect.getattr_static(cls, attr)
        st["id:" + k] = id(f)
    return st


def object_state(rec):
    st = {}
    for name, m in rec["model"].named_modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            st[f"{name or '<root>'}.{attr}"] = len(getattr(m, attr))
        st[f"{name or '<root>'}.__dict__"] = sorted(m.__dict__)
    for name, p in rec["model"].named_parameters():
        st[f"param {name} hooks"] = (len(p._backward_hooks or {}),
                                     len(getattr(p, "_post_accumulate_grad_hooks", None) or {}))
    opt = rec["opt"]
    st["opt.__dict__"] = sorted(opt.__dict__)
    st["opt.pre_hooks"] = len(opt._optimizer_step_pre_hooks)
    st["opt.post_hooks"] = len(opt._optimizer_step_post_hooks)
    st["opt.step is class step"] = type(opt).__dict__["step"] is getattr(opt.step, "__func__", None)
    st["scaler.__dict__"] = sorted(rec["scaler"].__dict__)
    return st


def run_expecting(exc_type, **kw):
    rec = {}
    try:
        train(record=rec, **kw)
    except exc_type as e:
        return e, rec
    raise AssertionError("expected %s" % exc_type.__name__)


def diff(a, b):
    return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def main():
    all_codes = set()
    # ---- plain reference runs ----
    m0, l0, s0 = train()
    base_state = torch_state()  # after a first run: torch patches Optimizer.step once
    rec_tmp = {}
    train(record=rec_tmp)
    print("plain full run: losses %.4f -> %.4f, scales %s, max grad norm %.3f"
          % (l0[0], l0[-1], sorted(set(s0)), max(rec_tmp["gnorms"])))
    assert all(torch.isfinite(v) for v in l0) and set(s0) == {65536.0}, "fault check: plain run must be healthy"
    assert max(rec_tmp["gnorms"]) < 100

    plain_results = {}
    for variant, exc_type, kw in (("forward", LabelRangeError, {"raise_label_at": 7}),
                                  ("backward-hook", GradHookError, {"raise_hook_at": 5})):
        RAISED.clear()
        e, rec = run_expecting(exc_type, **kw)
        assert RAISED and e is RAISED[-1]
        plain_results[variant] = (e, rec)
        print(f"plain {variant}: {type(e).__name__}({e}) after {len(rec['losses'])} completed steps")
    assert not diff(torch_state(), base_state), diff(torch_state(), base_state)

    if "--plain-only" in sys.argv:
        return

    # ---- guarded runs with the same exceptions ----
    for variant, exc_type, kw in (("forward", LabelRangeError, {"raise_label_at": 7}),
                                  ("backward-hook", GradHookError, {"raise_hook_at": 5})):
        RAISED.clear()
        before = torch_state()
        rec = {}
        caught = None
        g = None
        try:
            with amp_runtime.guard(policy="record") as g:
                train(record=rec, **kw)
        except BaseException as e:  # whatever reaches us
            caught = e
        after = torch_state()
        pe, prec = plain_results[variant]
        print(f"--- guarded {variant}")
        print("caught:", type(caught).__name__, repr(caught))
        ok_type = type(caught) is exc_type
        ok_identity = bool(RAISED) and caught is RAISED[-1]
        ok_args = caught is not None and caught.args == pe.args
        ok_chain = caught is not None and caught.__cause__ is None and caught.__context__ is None
        tb = caught.__traceback__ if caught is not None else None
        last = None
        while tb is not None:
            last = tb
            tb = tb.tb_next
        last_fn = last.tb_frame.f_code.co_name if last else None
        expected_fn = "forward" if variant == "forward" else "bad_hook"
        print(f"EXC_TYPE_SAME {ok_type} EXC_IDENTITY {ok_identity} EXC_ARGS_SAME {ok_args} "
              f"EXC_NO_CHAIN {ok_chain} TB_LAST_FRAME {last_fn} (expected {expected_fn}) "
              f"{last.tb_frame.f_code.co_filename.split('/')[-1] + ':' + str(last.tb_lineno) if last else ''}")
        tb_files = []
        tb = caught.__traceback__ if caught is not None else None
        while tb is not None:
            tb_files.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        print("traceback frames in amp_runtime:", sum("amp_runtime" in f for f in tb_files), "of", len(tb_files))
        d = diff(before, after)
        print("TORCH_STATE_RESTORED", not d, d if d else "")
        # objects used inside the guard vs a fresh plain run's objects at the same point
        od = diff(object_state(prec), object_state(rec))
        print("OBJECT_STATE_CLEAN", not od, od if od else "")
        lm, wm = compare(prec["losses"], rec["losses"], prec["model"], rec["model"])
        print("completed steps plain/guarded:", len(prec["losses"]), len(rec["losses"]))
        sm = prec["scales"] == rec["scales"]
        print(f"LOSSES_MATCH {lm}")
        print(f"WEIGHTS_MATCH {wm}")
        print(f"SCALES_MATCH {sm}")
        if g is not None:
            for ev in g.report.events:
                all_codes.add(ev.code)
                print("EVENT", ev.code, "step", ev.step, "module", ev.module, "op", ev.op,
                      "source", ev.source, "|", ev.message)
            print("report summary:\n" + g.report.summary())
        else:
            print("guard object not bound")

    # ---- a plain run after the guarded ones must behave as the first one ----
    final_state = torch_state()
    print("TORCH_STATE_AT_END_SAME_AS_START", final_state == base_state, diff(base_state, final_state) or "")
    m2, l2, s2 = train()
    lm, wm = compare(l0, l2, m0, m2)
    print(f"PLAIN_AFTER_GUARD LOSSES_MATCH {lm}")
    print(f"PLAIN_AFTER_GUARD WEIGHTS_MATCH {wm}")
    print("EVENTS " + json.dumps(sorted(all_codes)))


if __name__ == "__main__":
    main()
