"""Runtime halves of AMP005, AMP006, AMP010: real CPU fp16/bf16 autocast loops with a GradScaler."""
import pytest
import torch

import amp_runtime


def setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def forward_loss(model, dtype=torch.float16):
    with torch.autocast("cpu", dtype=dtype):
        out = model(torch.randn(16, 8))
    return out.float().pow(2).mean()


def run(loop, steps=3, **guard_kwargs):
    with amp_runtime.guard(policy="record", **guard_kwargs) as g:
        for step in range(steps):
            loop(step)
    return g


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_clipping_scaled_gradients_is_amp005(clip):
    model, opt = setup()
    scaler = torch.amp.GradScaler("cpu")

    def loop(step):
        scaler.scale(forward_loss(model)).backward()
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: AMP005
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)  # noqa: AMP005
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    events = run(loop).report.by_code("AMP005")
    assert [e.step for e in events] == [0, 1, 2]
    assert events[0].severity == "P0" and events[0].message.startswith(f"clip_grad_{clip}_ clips")


def test_clipping_after_unscale_is_fine():
    model, opt = setup()
    scaler = torch.amp.GradScaler("cpu")

    def loop(step):
        scaler.scale(forward_loss(model)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    g = run(loop)
    assert not [e for e in g.report if e.code in ("AMP005", "AMP006", "AMP010")]


def test_clipping_without_a_scaler_is_not_amp005():
    model, opt = setup()

    def loop(step):
        forward_loss(model, torch.bfloat16).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    assert not run(loop).report.by_code("AMP005")


def test_optimizer_step_on_scaled_gradients_is_amp006():
    model, opt = setup()
    scaler = torch.amp.GradScaler("cpu")

    def loop(step):
        scaler.scale(forward_loss(model)).backward()
        opt.step()  # noqa: AMP006 - bypasses the scaler
        opt.zero_grad()

    g = run(loop)
    events = g.report.by_code("AMP006")
    assert [e.step for e in events] == [0, 1, 2]
    assert "SGD.step() runs on gradients GradScaler scaled" in events[0].message
    assert g.step_index == 3  # without update() the optimizer steps end the steps


def test_scaler_step_without_update_is_amp006():
    model, opt = setup()
    scaler = torch.amp.GradScaler("cpu")
    with amp_runtime.guard(policy="record") as g:
        scaler.scale(forward_loss(model)).backward()
        scaler.step(opt)  # noqa: AMP006
        opt.zero_grad()
        scaler.scale(forward_loss(model)).backward()  # no update() in between
    (event,) = g.report.by_code("AMP006")
    assert "not followed by scaler.update()" in event.message


def test_fp16_backward_without_a_scaler_is_amp010_once():
    model, opt = setup()

    def loop(step):
        forward_loss(model).backward()
        opt.step()
        opt.zero_grad()

    (event,) = run(loop).report.by_code("AMP010")
    assert event.step == 0 and "no GradScaler" in event.message


def test_scaler_with_bf16_is_amp010():
    model, opt = setup()
    scaler = torch.amp.GradScaler("cpu")

    def loop(step):
        scaler.scale(forward_loss(model, torch.bfloat16)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    (event,) = run(loop).report.by_code("AMP010")
    assert "bfloat16" in event.message


@pytest.mark.parametrize("dtype, scaled", [
    (torch.float16, True), (torch.bfloat16, False), (torch.float32, False),
])
def test_matching_scaler_and_dtype_is_not_amp010(dtype, scaled):
    model, opt = setup()
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)

    def loop(step):
        if dtype == torch.float32:
            loss = model(torch.randn(16, 8)).pow(2).mean()
        else:
            loss = forward_loss(model, dtype)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    assert not run(loop).report.by_code("AMP010")


def test_one_scaler_stepping_two_optimizers_in_turn_is_not_amp006():
    """A GAN's discriminator step, then the generator's backward and step, then one update():
    the generator's backward meets a STEPPED optimizer whose gradients were not reset."""
    generator, g_opt = setup(0)
    discriminator, d_opt = setup(1)
    scaler = torch.amp.GradScaler("cpu")

    def loop(step):
        d_opt.zero_grad()
        scaler.scale(forward_loss(discriminator)).backward()
        scaler.step(d_opt)
        g_opt.zero_grad()
        scaler.scale(forward_loss(generator)).backward()
        scaler.step(g_opt)
        scaler.update()

    g = run(loop)
    assert g.report.by_code("AMP006") == []
    assert g.step_index == 3


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_generator_stepped_directly_after_the_scaled_discriminator_step_is_amp006(set_to_none):
    """One scaler; the discriminator goes through ``scaler.step``, the generator's optimizer,
    which the scaler never sees, steps on the gradients of a scaled backward."""
    generator, g_opt = setup(0)
    discriminator, d_opt = setup(1)
    scaler = torch.amp.GradScaler("cpu")

    def loop(step):
        d_opt.zero_grad(set_to_none=set_to_none)
        scaler.scale(forward_loss(discriminator)).backward()
        scaler.step(d_opt)
        g_opt.zero_grad(set_to_none=set_to_none)
        scaler.scale(forward_loss(generator)).backward()
        g_opt.step()  # noqa: AMP006 - steps on gradients multiplied by the scale
        scaler.update()

    events = run(loop, steps=4).report.by_code("AMP006")
    assert [e.step for e in events] == [0, 1, 2, 3]
    assert "runs on gradients GradScaler scaled" in events[0].message


@pytest.mark.parametrize("set_to_none", [True, False])
def test_task_weights_stepped_after_the_update_on_scaled_gradients_are_amp006(set_to_none):
    """Learned loss weights, in a loss module outside the model, with their own optimizer
    stepped every second iteration after ``scaler.update()``: the scaler never unscales their
    gradients, which the scaled backwards wrote. The model's own steps are fine."""
    model, opt = setup(0)
    log_vars = torch.nn.Parameter(torch.zeros(1))
    weight_opt = torch.optim.SGD([log_vars], lr=0.01)
    scaler = torch.amp.GradScaler("cpu")

    def loop(step):
        loss = torch.exp(-log_vars) * forward_loss(model) + log_vars
        opt.zero_grad(set_to_none=set_to_none)
        scaler.scale(loss.sum()).backward()
        scaler.step(opt)
        scaler.update()
        if step % 2 == 1:
            weight_opt.step()  # noqa: AMP006 - steps on gradients multiplied by the scale
            weight_opt.zero_grad(set_to_none=set_to_none)

    events = run(loop, steps=6).report.by_code("AMP006")
    assert len(events) == 3  # one per weight_opt.step(), each at the step the guard counts
    assert all("after scaler.update()" in e.message and e.op == "SGD.step" for e in events)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_second_model_trained_in_fp32_after_the_update_is_not_amp006(set_to_none):
    """The probe's plain backward and step come after the scaled model's update."""
    model, opt = setup(0)
    probe, probe_opt = setup(1)
    scaler = torch.amp.GradScaler("cpu")

    def loop(step):
        opt.zero_grad(set_to_none=set_to_none)
        scaler.scale(forward_loss(model)).backward()
        scaler.step(opt)
        scaler.update()
        probe_opt.zero_grad(set_to_none=set_to_none)
        probe(torch.randn(16, 8)).pow(2).mean().backward()
        probe_opt.step()

    assert run(loop, steps=4).report.by_code("AMP006") == []


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_second_model_trained_in_fp32_beside_the_scaled_one_is_not_amp006(set_to_none):
    """A linear probe trained in fp32 with a plain backward and step while the main model's
    scaled backward waits for ``scaler.step``: its gradients were never scaled."""
    model, opt = setup(0)
    probe, probe_opt = setup(1)
    scaler = torch.amp.GradScaler("cpu")

    def loop(step):
        opt.zero_grad(set_to_none=set_to_none)
        scaler.scale(forward_loss(model)).backward()
        probe_opt.zero_grad(set_to_none=set_to_none)
        probe(torch.randn(16, 8)).pow(2).mean().backward()
        probe_opt.step()
        scaler.step(opt)
        scaler.update()

    g = run(loop, steps=4)
    assert g.report.by_code("AMP006") == []


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_new_iteration_after_scaler_step_without_update_is_amp006(set_to_none):
    model, opt = setup()
    scaler = torch.amp.GradScaler("cpu")
    with amp_runtime.guard(policy="record") as g:
        scaler.scale(forward_loss(model)).backward()
        scaler.step(opt)  # noqa: AMP006
        opt.zero_grad(set_to_none=set_to_none)
        scaler.scale(forward_loss(model)).backward()
    (event,) = g.report.by_code("AMP006")
    assert "not followed by scaler.update()" in event.message


def test_optimizer_step_after_unscale_bypasses_the_inf_check_is_amp006():
    model, opt = setup()
    scaler = torch.amp.GradScaler("cpu")

    def loop(step):
        scaler.scale(forward_loss(model)).backward()
        scaler.unscale_(opt)
        opt.step()  # noqa: AMP006 - an inf/NaN step would not be skipped
        scaler.update()
        opt.zero_grad()

    g = run(loop)
    events = g.report.by_code("AMP006")
    assert [e.step for e in events] == [0, 1, 2]
    assert "called directly after scaler.unscale_()" in events[0].message
