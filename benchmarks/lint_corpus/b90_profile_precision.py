"""Step time and peak memory of a pre-norm transformer stack under several precision setups.

    python profile_precision.py --layers 12 --dim 1024 --seq 2048 --steps 30
"""
import argparse
import copy
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

BENCH_DTYPE = torch.float16


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


def build(args):
    model = nn.Sequential(*[Block(args.dim, args.heads) for _ in range(args.layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(args.batch, args.seq, args.dim, device="cuda")
    y = torch.randn(args.batch, args.seq, args.dim, device="cuda")
    return model, opt, x, y


def _report(name, times, warmup):
    steady = times[warmup:]
    ms = 1000.0 * sum(steady) / len(steady)
    mem = torch.cuda.max_memory_allocated() / 2 ** 30
    torch.cuda.reset_peak_memory_stats()
    return {"setup": name, "ms_per_step": round(ms, 2), "peak_gib": round(mem, 2)}


def bench_fp32(model, opt, x, y, steps, warmup):
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return _report("fp32", times, warmup)


def bench_bf16(model, opt, x, y, steps, warmup):
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return _report("bf16 autocast", times, warmup)


def bench_fp16(model, opt, x, y, steps, warmup):
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            out = model(x)
            loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return _report("fp16 autocast", times, warmup)


def bench_fp16_fused_loss(model, opt, x, y, steps, warmup):
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device_type="cuda"):  # expect: AMP010
            loss = F.mse_loss(model(x), y)
            loss.backward()  # expect: AMP008
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return _report("fp16 autocast (fused loss)", times, warmup)


def bench_checkpointed(model, opt, x, y, steps, warmup):
    from torch.utils.checkpoint import checkpoint_sequential
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=BENCH_DTYPE):  # expect: AMP010
            out = checkpoint_sequential(model, 4, x, use_reentrant=False)
        loss = F.mse_loss(out, y)  # expect: AMP002
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return _report("checkpointed", times, warmup)


@torch.inference_mode()
def bench_inference_half(model, x, steps, warmup):
    served = copy.deepcopy(model).eval().half()
    xh = x.half()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        served(xh)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return _report("fp16 weights, inference", times, warmup)


BENCHES = {
    "fp32": bench_fp32,
    "bf16": bench_bf16,
    "fp16": bench_fp16,
    "fp16_fused_loss": bench_fp16_fused_loss,
    "checkpointed": bench_checkpointed,
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--setups", default=",".join(BENCHES) + ",inference")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default="")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True

    results = []
    for name in args.setups.split(","):
        torch.manual_seed(0)
        model, opt, x, y = build(args)
        if name == "inference":
            results.append(bench_inference_half(model, x, args.steps, args.warmup))
        else:
            results.append(BENCHES[name](model, opt, x, y, args.steps, args.warmup))
        del model, opt
        torch.cuda.empty_cache()

    for r in results:
        print(f"{r['setup']:<28} {r['ms_per_step']:>9.2f} ms  {r['peak_gib']:>6.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
