"""Automatic step detection: scaler updates, optimizer steps, several optimizers, manual steps."""
import torch

import amp_runtime


def batch(width=4):
    return torch.randn(8, width)


def test_plain_loop_counts_optimizer_steps():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    with amp_runtime.guard(policy="record") as g:
        g.step_listeners.append(lambda step, record: seen.append(step))
        for _ in range(5):
            model(batch()).sum().backward()
            opt.step()
            opt.zero_grad()
    assert g.step_index == 5 and seen == [0, 1, 2, 3, 4]


def test_scaler_loop_ends_steps_at_update_including_skipped_ones():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    skipped = []
    with amp_runtime.guard(policy="record") as g:
        g.step_listeners.append(lambda step, record: skipped.append(record["skipped"]))
        for step in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(batch()).float().mean() * (1e9 if step % 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert g.step_index == 6
    assert skipped == [False, True, False, True, False, True]


def test_disabled_scaler_falls_back_to_optimizer_steps():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with amp_runtime.guard(policy="record") as g:
        for _ in range(3):
            scaler.scale(model(batch()).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert g.step_index == 3


def test_two_optimizers_stepping_together_count_one_step_per_iteration():
    encoder, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opts = [torch.optim.SGD(encoder.parameters(), lr=0.01),
            torch.optim.Adam(head.parameters(), lr=0.01)]
    indices = []
    with amp_runtime.guard(policy="record") as g:
        for _ in range(4):
            head(encoder(batch())).sum().backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
            indices.append(g.step_index)
    assert indices == [1, 2, 3, 4]


def test_alternating_optimizers_with_their_own_backward_settle_after_the_first_iteration():
    critic, generator = torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
    indices = []
    with amp_runtime.guard(policy="record") as g:
        for _ in range(4):
            critic(generator(batch()).detach()).mean().backward()
            opt_c.step()
            opt_c.zero_grad()
            (-critic(generator(batch())).mean()).backward()
            opt_g.step()
            opt_g.zero_grad()
            indices.append(g.step_index)
    # the first iteration counts each optimizer once, then one step per iteration
    assert indices == [2, 3, 4, 5]


def test_a_gan_with_a_scaler_per_network_counts_one_step_per_iteration():
    critic, generator = torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
    scaler_c = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler_g = torch.amp.GradScaler("cpu", init_scale=256.0)
    indices = []
    with amp_runtime.guard(policy="record") as g:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss_c = critic(generator(batch()).detach()).float().mean()
            scaler_c.scale(loss_c).backward()
            scaler_c.step(opt_c)
            scaler_c.update()
            opt_c.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss_g = -critic(generator(batch())).float().mean()
            scaler_g.scale(loss_g).backward()
            scaler_g.step(opt_g)
            scaler_g.update()
            opt_g.zero_grad()
            indices.append(g.step_index)
    # as with optimizers: the first iteration counts each scaler once, then one step per iteration
    assert indices == [2, 3, 4, 5]


def test_scalers_updated_back_to_back_count_one_step():
    models = [torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) for _ in models]
    indices = []
    with amp_runtime.guard(policy="record") as g:
        for _ in range(3):
            for model, scaler in zip(models, scalers):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(batch()).float().mean()
                scaler.scale(loss).backward()
            for opt, scaler in zip(opts, scalers):
                scaler.step(opt)
            for scaler in scalers:
                scaler.update()
            for opt in opts:
                opt.zero_grad()
            indices.append(g.step_index)
    assert indices == [1, 2, 3]


def test_manual_steps_switch_automatic_detection_off():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp_runtime.guard(policy="record") as g:
        g.step()  # the loop marks its own steps (e.g. one step per two optimizer updates)
        for _ in range(3):
            for _ in range(2):
                model(batch()).sum().backward()
                opt.step()
                opt.zero_grad()
            g.step()
    assert g.step_index == 4


def test_manual_steps_judge_the_model_gradients():
    model = torch.nn.Linear(4, 1)
    torch.nn.init.zeros_(model.weight)
    with amp_runtime.guard(policy="record", model=model) as g:
        for _ in range(2):
            model.zero_grad()
            (model(batch()) * 0).sum().backward()  # the model gets all-zero gradients
            g.step()
    (event,) = g.report.by_code("AMP105")
    assert event.step == 0


def test_events_in_the_next_forward_carry_the_next_step():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with amp_runtime.guard(policy="record", select=["AMP104"]) as g:
        for _ in range(2):
            model(batch()).sum().backward()
            opt.step()
            opt.zero_grad()
        event = g.emit("AMP104", norm=1.0, limit=1.0)
    assert event.step == 2
