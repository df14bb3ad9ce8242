"""EXPECT: AMP005
MAY: AMP106
FAULT: an unchanged training script is run as `python -m amp_runtime run --out DIR
train_tied.py ...` and the page rebuilt with `python -m amp_runtime report DIR`. The script
is a tiny language model with weight tying (the output head's weight IS the token
embedding's) whose forward returns a dict of losses (`{"loss", "ce", "z"}`, the loss made
inside the forward under fp16 autocast on `.float()` logits), trained with a GradScaler and
SGD. Injected bug: `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` right after
`scaler.scale(loss).backward()` with no `scaler.unscale_(opt)` before it (line marked
`# FAULT` in the script), on every one of the 30 steps. The plain run checks the effect:
the norm the clip returns is ~65536x the true one, so the applied update is shrunk by that
factor and the loss stalls (compared with the same script with `--fixed`, which unscales
first). AMP005: "clipping runs on grads the scaler has scaled but not unscaled"; it
must name the clip line and step 0 first (events repeat every step, "aggregated per code
and place"). The script also takes an option spelled like run's own (`--out`), which must
reach it unchanged, and it exits with status 3 because its final loss misses the target;
`run` "keeps the script's arguments, sys.argv and exit code". EVENTS are the codes in
events.jsonl (event lines and "repeats" totals). Must not fire: AMP104 (the guard's
norm is "unscaled (divided by the GradScaler's scale where one is used, or taken after
unscale_)": the true norm is below 100, see plain check), AMP105 (the applied gradients
are tiny but above 1e-6 total and 1e-10 per layer, see plain check), AMP002 (the loss is
made inside the forward, under autocast, on fp32 logits), AMP010 (a scaler is active),
AMP006 (scaler.step and update are called). MAY AMP106: with the log folder every step is
logged, so AMP106 runs every step ("and on every step logged to log_dir"), and its page
estimates the flush "at the current loss scale" from the gradients it reads; after a clip
of scaled gradients those gradients are no longer what the scaled backward produced, a
case the pages leave open. The page must be rebuilt by `report` and show AMP005.
"""
import json
import os
import subprocess
import sys
import tempfile

import torch

torch.set_num_threads(1)
torch.manual_seed(0)

SCRIPT = r'''
import argparse
import sys

import torch
from torch import nn
import torch.nn.functional as F

torch.set_num_threads(1)

V, D, T = 64, 32, 16


class TinyTiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.ln1 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        x = x + self.mlp(self.ln1(x))
        logits = self.head(self.ln_f(x)).float()
        ce = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        z = 1e-4 * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return {"loss": ce + z, "ce": ce, "z": z}


def batches(steps):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        start = torch.randint(0, V, (16, 1), generator=g)
        seq = (start + 5 * torch.arange(T + 1)) % V  # a learnable arithmetic pattern
        yield seq[:, :-1], seq[:, 1:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True)  # spelled like `amp_runtime run --out`
    p.add_argument("--fixed", action="store_true")
    p.add_argument("--target", type=float, default=2.5)
    args = p.parse_args()
    torch.manual_seed(0)
    model = TinyTiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    losses, clip_norms, scales, applied = [], [], [], []
    for step, (idx, tgt) in enumerate(batches(args.steps)):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(idx, tgt)
        loss = out["loss"]
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.fixed:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # FAULT: no unscale_ first
        scaler.step(opt)
        applied.append({n: float(p.grad.abs().max()) for n, p in model.named_parameters()})
        scaler.update()
        losses.append(out["ce"].detach().clone())
        clip_norms.append(float(norm))
        scales.append(float(scaler.get_scale()))
    torch.save({"losses": losses, "state": model.state_dict(), "clip_norms": clip_norms,
                "scales": scales, "applied_grad_max": applied, "argv": sys.argv[1:]}, args.out)
    final = float(losses[-1])
    print(f"final ce {final:.4f} (target {args.target})")
    sys.exit(0 if final < args.target else 3)


if __name__ == "__main__":
    main()
'''


def same(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.int64:
        return bool((a == b).all())
    bits = a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)
    return bool((bits | (torch.isnan(a) & torch.isnan(b))).all())


def main():
    tmp = tempfile.mkdtemp(prefix="scenario_cli_")
    script = os.path.join(tmp, "train_tied.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    py = sys.executable
    fault_line = next(i + 1 for i, l in enumerate(SCRIPT.splitlines()) if "# FAULT" in l)
    print("fault line: train_tied.py:%d" % fault_line)

    # ---- plain runs: the fault, and the fixed script for comparison ----
    ref_out = os.path.join(tmp, "plain.pt")
    p = subprocess.run([py, script, "--steps", "30", "--out", ref_out], cwd=tmp,
                       capture_output=True, text=True, timeout=300)
    fixed_out = os.path.join(tmp, "fixed.pt")
    pf = subprocess.run([py, script, "--steps", "30", "--out", fixed_out, "--fixed"], cwd=tmp,
                        capture_output=True, text=True, timeout=300)
    ref, fixed = torch.load(ref_out), torch.load(fixed_out)
    print("plain (fault): rc", p.returncode, p.stdout.strip(), "| scales", sorted(set(ref["scales"])))
    print("plain (fixed): rc", pf.returncode, pf.stdout.strip())
    true_norms = fixed["clip_norms"]
    print("clip norm returned, fault run, steps 0-2:", [round(v, 1) for v in ref["clip_norms"][:3]],
          "; true (unscaled) norm, fixed run:", [round(v, 3) for v in true_norms[:3]],
          "max", round(max(true_norms), 3))
    print("ce fault run %.3f -> %.3f; fixed run %.3f -> %.3f" % (
        ref["losses"][0], ref["losses"][-1], fixed["losses"][0], fixed["losses"][-1]))
    layer_min = min(min(d.values()) for d in ref["applied_grad_max"])
    print("fault run: smallest per-layer max |grad| applied by the optimizer: %.3g" % layer_min)
    assert p.returncode == 3 and pf.returncode == 0
    assert ref["clip_norms"][0] > 1000 * true_norms[0] and max(true_norms) < 100
    assert set(ref["scales"]) == {65536.0} and layer_min > 1e-10
    if "--plain-only" in sys.argv:
        return

    # ---- the same script under `python -m amp_runtime run` ----
    rep = os.path.join(tmp, "amp-report")
    g_out = os.path.join(tmp, "guarded.pt")
    cmd = [py, "-m", "amp_runtime", "run", "--out", rep, script, "--steps", "30", "--out", g_out]
    g = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300)
    print("=" * 30, "amp_runtime run: rc", g.returncode, "(script alone: %d)" % p.returncode)
    print(g.stdout)
    print("--- stderr\n" + g.stderr)
    print("=" * 30)
    print("EXIT_CODE_KEPT", g.returncode == p.returncode)
    got = torch.load(g_out) if os.path.exists(g_out) else None
    if got is None:
        print("LOSSES_MATCH False\nWEIGHTS_MATCH False (no output)")
    else:
        print("SCRIPT_ARGV_KEPT", got["argv"] == ["--steps", "30", "--out", g_out], got["argv"])
        lm = all(same(a, b) for a, b in zip(ref["losses"], got["losses"])) and len(ref["losses"]) == len(got["losses"])
        wm = all(same(ref["state"][k], got["state"][k]) for k in ref["state"])
        print(f"LOSSES_MATCH {lm}")
        print(f"WEIGHTS_MATCH {wm}")

    print("log folder:", sorted(os.listdir(rep)) if os.path.isdir(rep) else "missing")
    codes = set()
    ev_path = os.path.join(rep, "events.jsonl")
    if os.path.exists(ev_path):
        for line in open(ev_path):
            rec = json.loads(line)
            if rec.get("record") == "repeats":
                codes.add(rec["code"])
                lt = rec.get("latest") or {}
                print("REPEATS", rec["code"], "count", rec.get("count"), "steps", rec.get("first_step"),
                      "-", rec.get("last_step"), "source", rec.get("source"), "module", rec.get("module"),
                      "| latest step", lt.get("step"))
            elif "code" in rec:
                codes.add(rec["code"])
                print("EVENT", rec["code"], "step", rec.get("step"), "module", rec.get("module"), "op",
                      rec.get("op"), "source", rec.get("source"), "|", rec.get("message"))
            else:
                print("OTHER", line.strip()[:200])
    n_metrics = sum(1 for _ in open(os.path.join(rep, "metrics.jsonl"))) if os.path.exists(
        os.path.join(rep, "metrics.jsonl")) else 0
    print("metrics.jsonl lines:", n_metrics)

    # ---- rebuild the page ----
    html = os.path.join(rep, "report.html")
    existed = os.path.exists(html)
    if existed:
        os.remove(html)
    r = subprocess.run([py, "-m", "amp_runtime", "report", rep], cwd=tmp, capture_output=True,
                       text=True, timeout=300)
    print("amp_runtime report: rc", r.returncode, "| stdout:", r.stdout.strip(), "| stderr:", r.stderr.strip()[-500:])
    ok = os.path.exists(html)
    text = open(html, encoding="utf-8").read() if ok else ""
    print("REPORT_HTML written by run:", existed, "rebuilt by report:", ok, "size", len(text),
          "mentions AMP005:", "AMP005" in text, "external URLs:", text.count("http://") + text.count("https://"),
          "<script:", "<script" in text.lower())
    print("EVENTS " + json.dumps(sorted(codes)))


if __name__ == "__main__":
    main()
