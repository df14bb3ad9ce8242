"""Throughput and numerics benchmark across precisions.

Measures inference latency (fp32, tf32, autocast bf16/fp16, pure half),
forward+backward cost and a full optimizer step, and reports the max relative
error of each low-precision forward against fp32.

    python bench_precision.py --model resnet50 --batch-size 128 --json results.json
"""
import argparse
import copy
import json
import platform
import time

import torch
import torch.nn.functional as F
import torchvision

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cuda_time(fn, warmup=10, iters=50):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters  # ms


def cpu_time(fn, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        fn()
    return (time.perf_counter_ns() - t0) / iters / 1e6  # ms


@torch.inference_mode()
def bench_inference(model, x, precision):
    model.eval()
    if precision == "half":
        m = copy.deepcopy(model).half()
        xh = x.half()
        return cuda_time(lambda: m(xh))
    if precision == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        try:
            return cuda_time(lambda: model(x))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
    dtype = PRECISIONS[precision]

    def run():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            return model(x)

    return cuda_time(run)


def bench_inference_cpu(model, x):
    model = copy.deepcopy(model).cpu().eval()
    x = x.cpu()
    with torch.inference_mode(), torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
        return cpu_time(lambda: model(x))


def bench_fwd_bwd(model, x, y, dtype):
    """Forward + backward only: no optimizer, grads are dropped every iteration."""
    model.train()
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)

    def fwd_bwd():
        with torch.autocast("cuda", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()  # expect: AMP008
        model.zero_grad(set_to_none=True)

    return cuda_time(fwd_bwd, warmup=5, iters=20)


def bench_train_step(model, x, y, dtype, lr=0.1):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)

    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scaler.step(opt)
        scaler.update()

    ms = cuda_time(step, warmup=5, iters=20)
    return ms, scaler.get_scale() if scaler.is_enabled() else None


@torch.no_grad()
def max_rel_error(model, x, dtype):
    model.eval()
    ref = model(x.float()).float()
    with torch.autocast("cuda", dtype=dtype):
        low = model(x)
    diff = (low.float() - ref).abs().max()
    return (diff / ref.abs().max().clamp_min(1e-8)).item()


@torch.no_grad()
def pure_half_error(model, x):
    ref = model.eval()(x).float()
    out = copy.deepcopy(model).half()(x.half()).float()
    cos = F.cosine_similarity(out.flatten(1), ref.flatten(1), dim=1, eps=1e-8)
    return (ref - out).norm().item() / (ref.norm().item() + 1e-12), cos.min().item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    device = torch.device("cuda")
    model = getattr(torchvision.models, args.model)(num_classes=1000).to(device)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "host": platform.node(), "batch_size": args.batch_size, "inference_ms": {}}
    for prec in ("fp32", "tf32", "bf16", "fp16", "half"):
        ms = bench_inference(model, x, prec)
        results["inference_ms"][prec] = ms
        print(f"infer {prec:>5}: {ms:7.2f} ms  {args.batch_size / (ms / 1e3):9.1f} img/s")
    results["inference_ms"]["cpu_bf16"] = bench_inference_cpu(model, x[:8])
    results["rel_error"] = {name: max_rel_error(model, x, dt) for name, dt in PRECISIONS.items() if name != "fp32"}
    results["half_error"] = pure_half_error(model, x)

    if not args.skip_train:
        results["fwd_bwd_ms"], results["step_ms"] = {}, {}
        for name, dt in PRECISIONS.items():
            train_model = copy.deepcopy(model)
            results["fwd_bwd_ms"][name] = bench_fwd_bwd(train_model, x, y, dt)
            ms, scale = bench_train_step(train_model, x, y, dt)
            results["step_ms"][name] = ms
            print(f"train {name}: fwd+bwd {results['fwd_bwd_ms'][name]:.1f} ms, step {ms:.1f} ms, scale {scale}")
            torch.cuda.reset_peak_memory_stats()
            del train_model
    results["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
