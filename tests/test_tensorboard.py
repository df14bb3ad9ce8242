"""guard(tensorboard=...): per-step scalars read back with TensorBoard's own reader."""
import subprocess
import sys

import pytest
import torch
from torch import nn

import amp_runtime

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402


def _train(g, steps=4, overflow_at=2):
    """fp16 autocast steps with a GradScaler; one AMP102 finding reported at ``overflow_at``."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for i in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if i == overflow_at:
            g.emit("AMP102", op="mul", value=61000.0)
        scaler.step(opt)
        scaler.update()  # ends the guard's step


def _scalars(log_dir):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_event_counts_are_written_every_step(tmp_path):
    # the loss is recorded by the metrics log, which log_dir turns on
    with amp_runtime.guard(tensorboard=tmp_path / "tb", log_dir=tmp_path, policy="record") as g:
        _train(g)
    scalars = _scalars(tmp_path / "tb")
    assert scalars["amp/events/total"] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert scalars["amp/events/AMP102"] == [(2, 1), (3, 1)]
    assert scalars["amp/events/P1"] == [(2, 1), (3, 1)]
    # the step record's numbers: the scaler's scale before each update, no step skipped
    assert scalars["amp/loss_scale"] == [(i, 65536.0) for i in range(4)]
    assert scalars["amp/skipped"] == [(i, 0.0) for i in range(4)]
    assert [step for step, _ in scalars["amp/loss"]] == [0, 1, 2, 3]
    assert all(norm > 0 for _, norm in scalars["amp/grad_norm"])


def test_a_users_writer_is_used_and_left_open(tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path / "own"))
    with amp_runtime.guard(tensorboard=writer, policy="record") as g:
        _train(g, steps=2, overflow_at=0)
    writer.add_scalar("user/after_guard", 1.0, 0)  # still open
    writer.close()
    scalars = _scalars(tmp_path / "own")
    assert scalars["amp/events/total"] == [(0, 1), (1, 1)]
    assert scalars["user/after_guard"] == [(0, 1.0)]


def test_a_wrong_argument_is_a_clear_type_error():
    with pytest.raises(TypeError, match="SummaryWriter or a log folder path"):
        with amp_runtime.guard(tensorboard=42):
            pass


def test_missing_tensorboard_is_a_clear_error(tmp_path):
    code = (
        "import sys; sys.modules['torch.utils.tensorboard'] = None\n"
        "import amp_runtime\n"
        "try:\n"
        f"    with amp_runtime.guard(tensorboard={str(tmp_path)!r}):\n"
        "        pass\n"
        "except ImportError as err:\n"
        "    print('ERROR', err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "ERROR guard(tensorboard=...) needs the tensorboard package" in out
    assert 'pip install "flake8-amp[tensorboard]"' in out
