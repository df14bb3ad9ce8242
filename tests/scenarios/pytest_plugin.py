"""EXPECT: AMP101,AMP112
MAY: AMP102 (added after AMP102 was fixed for large-norm weights: the allowed test prints its
table too, which EVENTS reads, and the FAULT text below expects AMP102 there)
FAULT: a small test suite is written to a temporary folder and run with `pytest` in a
subprocess; the plugin is the installed `pytest11` entry point (nothing is configured).
Three tests share one fp16 autocast + GradScaler(init_scale=1024: the default 65536 skips the
healthy steps of this tiny batch while it settles) train step (Linear(16,64) -> LayerNorm ->
ReLU -> Linear(64,1), SGD, 3 steps, losses computed on `.float()` outputs):
- `test_healthy_step(amp_guard)`: normalised batches; must PASS.
- `test_overflowing_step(amp_guard)`: at step 1 the batch holds raw values 4e4..6e4 (fit
  fp16), so the first Linear's fp16 output overflows (8 inf, checked in plain torch), the
  LayerNorm turns that into NaN and the loss is NaN at backward. AMP112: "Checks the tensor
  that backward() starts from and reports when it is NaN or Inf"; AMP101 through the replay:
  "With trace="auto" (the default) ... replays that step's forward with per-op checks, so
  AMP101 names the op of the step where it happened" (op linear, module `0`, the line
  `pred = model(x)` in steps_lib.py, step 1). Both are P0, and the fixture "fails on any P0
  or unexpected event", so the test must FAIL and its report must show the events table
  ("A failing test shows the events as a table (code, op, module, line, steps, message)").
  EVENTS below are the codes of that table. Must not fire: AMP103 (the GradScaler skips the
  step: "Steps that a GradScaler skips ... are not AMP103"), AMP108 (one skip: 1024 -> 512
  is neither 5 decreases, nor < init/100, nor < 128), AMP010 (a scaler is active).
- `@pytest.mark.amp_guard(allow=["AMP102"], trace="always")` `test_near_overflow_allowed`:
  the first layer's weights are scaled so its fp16 output peaks at 49504, 52544 and 62016
  on steps 0-2 (checked in plain torch: finite, no step skipped, loss finite). AMP102 "an op whose
  fp16 output holds a value with |x| above 60000" is P1 and allowed, so the test must PASS.
The pytest exit status must be 1 (one failure). Each test dumps its losses and weights; they
must equal the same steps run plainly in this process, bit for bit.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import torch

torch.set_num_threads(1)
torch.manual_seed(0)

STEPS_LIB = r'''
import torch
from torch import nn
import torch.nn.functional as F

torch.set_num_threads(1)


def build(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 1))
    if kind == "near":
        with torch.no_grad():
            peak = max(model[0](x).abs().max() for x, _ in batches(kind))
            model[0].weight.mul_(62000.0 / float(peak))
            model[0].bias.mul_(62000.0 / float(peak))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return model, opt, scaler


def batches(kind):
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(3):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 1, generator=g)
        if kind == "overflow" and step == 1:
            x = 4e4 + 2e4 * torch.rand(8, 16, generator=g)  # raw values, fit fp16
        out.append((x, y))
    return out


def run_steps(kind, probe=None):
    model, opt, scaler = build(kind)
    losses, scales = [], []
    for step, (x, y) in enumerate(batches(kind)):
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
            loss = F.mse_loss(pred.float(), y)
        if probe is not None:
            probe(step, model, x, loss)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().clone())
        scales.append(float(scaler.get_scale()))
    return model, losses, scales
'''

TEST_FILE = r'''
import os

import pytest
import torch

from steps_lib import run_steps

OUT = os.environ["S11_OUT"]


def dump(name, result, guard):
    model, losses, scales = result
    info = {"fixture_type": type(guard).__name__}
    report = getattr(guard, "report", None)
    if report is not None:
        info["codes_seen_in_body"] = sorted({e.code for e in report.events})
    torch.save({"losses": losses, "scales": scales, "state": model.state_dict(), "info": info},
               os.path.join(OUT, name + ".pt"))


def test_healthy_step(amp_guard):
    dump("healthy", run_steps("healthy"), amp_guard)


def test_overflowing_step(amp_guard):
    dump("overflow", run_steps("overflow"), amp_guard)


@pytest.mark.amp_guard(allow=["AMP102"], trace="always")
def test_near_overflow_allowed(amp_guard):
    dump("near", run_steps("near"), amp_guard)
'''

# informational only: after teardown, write the codes the fixture's guard recorded
# (passing tests print no table). Not used for EVENTS.
CONFTEST = r'''
import json
import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    guard = item.funcargs.get("amp_guard") if hasattr(item, "funcargs") else None
    report = getattr(guard, "report", None)
    if report is not None:
        rows = [[e.code, e.step, e.module, e.op, e.source, e.message] for e in report.events]
        with open(os.path.join(os.environ["S11_OUT"], item.name + ".after_teardown.json"), "w") as f:
            json.dump(rows, f)
'''


def same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)
    return bool((bits | (torch.isnan(a) & torch.isnan(b))).all())


def main():
    tmp = tempfile.mkdtemp(prefix="scenario_pytest_")
    with open(os.path.join(tmp, "steps_lib.py"), "w") as f:
        f.write(STEPS_LIB)
    with open(os.path.join(tmp, "test_amp_steps.py"), "w") as f:
        f.write(TEST_FILE)
    with open(os.path.join(tmp, "conftest.py"), "w") as f:
        f.write(CONFTEST)
    sys.path.insert(0, tmp)
    import steps_lib

    # ---- plain reference runs, and checks that the faults do what is meant ----
    ref = {}
    for kind in ("healthy", "overflow", "near"):
        obs = {}

        def probe(step, model, x, loss, obs=obs):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                h = model[0](x)
            obs.setdefault("peak", []).append(float(h.float().abs().max()))
            obs.setdefault("n_inf", []).append(int(torch.isinf(h).sum()))
            obs.setdefault("loss_finite", []).append(bool(torch.isfinite(loss)))

        ref[kind] = steps_lib.run_steps(kind, probe=probe)
        print(f"plain {kind}: layer-0 fp16 peaks {obs['peak']} infs {obs['n_inf']} "
              f"loss finite {obs['loss_finite']} scales {ref[kind][2]}")
        if kind == "healthy":
            assert all(obs["loss_finite"]) and ref[kind][2] == [1024.0] * 3
        if kind == "overflow":
            assert obs["n_inf"][1] > 0 and not obs["loss_finite"][1] and obs["loss_finite"][0]
            assert ref[kind][2] == [1024.0, 512.0, 512.0]
        if kind == "near":
            assert max(obs["peak"]) > 60000 and all(p <= 65504 for p in obs["peak"])
            assert all(obs["loss_finite"])
            assert ref[kind][2] == [1024.0] * 3
    if "--plain-only" in sys.argv:
        return

    # ---- the test suite under pytest ----
    out_dir = os.path.join(tmp, "out")
    os.makedirs(out_dir)
    env = dict(os.environ, S11_OUT=out_dir, PYTHONDONTWRITEBYTECODE="1")
    junit = os.path.join(tmp, "junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--tb=short",
           f"--junitxml={junit}", "test_amp_steps.py"]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    print("=" * 30, "pytest output (rc=%d)" % proc.returncode)
    print(proc.stdout)
    if proc.stderr.strip():
        print("--- stderr\n" + proc.stderr)
    print("=" * 30)

    outcomes = {}
    root = ET.parse(junit).getroot()
    for tc in root.iter("testcase"):
        name = tc.get("name")
        kinds = [c.tag for c in tc]
        outcome = "failed" if "failure" in kinds else "error" if "error" in kinds else \
            "skipped" if "skipped" in kinds else "passed"
        # a teardown error is reported as an extra <testcase> entry with the same name
        if outcomes.get(name) in ("failed", "error"):
            continue
        outcomes[name] = outcome
    print("OUTCOMES", outcomes)
    print("PYTEST_RC", proc.returncode, "(expected 1)")
    ok = (outcomes.get("test_healthy_step") == "passed"
          and outcomes.get("test_overflowing_step") in ("failed", "error")
          and outcomes.get("test_near_overflow_allowed") == "passed")
    print("OUTCOMES_AS_EXPECTED", ok)

    # codes of the events table(s): lines whose first cell is a code
    codes = set()
    table_rows = []
    for line in proc.stdout.splitlines():
        m = re.match(r"^\s*[|│]?\s*(AMP\d{3})\b", line)
        if m:
            codes.add(m.group(1))
            table_rows.append(line.strip())
    print("event table rows:")
    for r in table_rows:
        print("EVENT", r)

    lm_all, wm_all = True, True
    for kind in ("healthy", "overflow", "near"):
        path = os.path.join(out_dir, kind + ".pt")
        if not os.path.exists(path):
            print(f"{kind}: no dump (test body did not finish)")
            lm_all = wm_all = False
            continue
        d = torch.load(path)
        model, losses, scales = ref[kind]
        lm = len(losses) == len(d["losses"]) and all(same(a, b) for a, b in zip(losses, d["losses"]))
        sd = model.state_dict()
        wm = all(same(sd[k], d["state"][k]) for k in sd)
        print(f"{kind}: LOSSES_MATCH {lm} WEIGHTS_MATCH {wm} scales {d['scales']} info {d['info']}")
        lm_all &= lm
        wm_all &= wm
    for name in ("test_healthy_step", "test_overflowing_step", "test_near_overflow_allowed"):
        path = os.path.join(out_dir, name + ".after_teardown.json")
        rows = json.load(open(path)) if os.path.exists(path) else "n/a"
        print(f"informational, events of {name} after teardown: {rows}")
    print(f"LOSSES_MATCH {lm_all}")
    print(f"WEIGHTS_MATCH {wm_all}")
    print("EVENTS " + json.dumps(sorted(codes)))


if __name__ == "__main__":
    main()
