"""Throughput of one training step of a torchvision model in several precisions.

    python bench_precision.py --arch resnet50 --batch-size 128 --modes fp32 bf16 fp16_scaled
    python bench_precision.py --attention --seq-len 4096
"""

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision.models as models


def parse_args():
    parser = argparse.ArgumentParser(description="precision benchmark")
    parser.add_argument("--arch", default="resnet50", choices=sorted(n for n in models.__dict__ if n.islower()))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--modes", nargs="+", default=["fp32", "bf16", "fp16", "fp16_scaled"])
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--attention", action="store_true", help="benchmark the attention kernel only")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    return parser.parse_args()


def step_fp32(model, optimizer, x, y, _scaler=None):
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_bf16(model, optimizer, x, y, _scaler=None):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()  # expect: AMP008
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_fp16(model, optimizer, x, y, _scaler=None):
    with torch.cuda.amp.autocast(dtype=torch.float16):  # expect: AMP009 AMP010
        out = model(x)
    loss = F.cross_entropy(out, y)  # expect: AMP002
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_fp16_scaled(model, optimizer, x, y, scaler=None):
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        out = model(x)
        loss = F.cross_entropy(out, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def step_cpu_bf16(model, optimizer, x, y, _scaler=None):
    with torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()  # expect: AMP008
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


STEPS = {
    "fp32": step_fp32,
    "bf16": step_bf16,
    "fp16": step_fp16,
    "fp16_scaled": step_fp16_scaled,
    "cpu_bf16": step_cpu_bf16,
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_training(args, mode, device):
    model = models.__dict__[args.arch]().to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda") if mode == "fp16_scaled" else None

    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)

    step = STEPS[mode]
    for _ in range(args.warmup):
        step(model, optimizer, x, y, scaler)
    sync(device)

    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step(model, optimizer, x, y, scaler)
        sync(device)
        times.append(time.perf_counter() - t0)
    return args.batch_size / statistics.median(times)


@torch.inference_mode()
def time_inference_fp16(args, device):
    model = models.__dict__[args.arch]().to(device).eval()
    model_half = copy.deepcopy(model).half()
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device).half()
    for _ in range(args.warmup):
        model_half(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        model_half(x)
    sync(device)
    return args.batch_size * args.iters / (time.perf_counter() - t0)


def time_attention(args, device):
    b, h, t, d = args.batch_size // 16 or 1, args.heads, args.seq_len, args.head_dim
    qk = torch.randn(2, b, h, t, d, device=device, dtype=torch.float16, requires_grad=True)
    v = torch.randn(b, h, t, d, device=device, dtype=torch.float16, requires_grad=True)
    grad_out = torch.randn(b, h, t, d, device=device, dtype=torch.float16)

    times = []
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        qk_n = qk / (qk.norm(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004 AMP011
        q, k = qk_n.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad_out)
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        qk.grad = None
        v.grad = None
    return 1000.0 * statistics.median(times)


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True

    if args.attention:
        ms = time_attention(args, device)
        print(f"attention b={args.batch_size} t={args.seq_len}: {ms:.2f} ms/iter")
        return

    results = {}
    for mode in args.modes:
        run_device = torch.device("cpu") if mode == "cpu_bf16" else device
        results[mode] = time_training(args, mode, run_device)
        print(f"{args.arch:>12s} {mode:>12s}: {results[mode]:8.1f} img/s")
    if device.type == "cuda":
        ips = time_inference_fp16(args, device)
        print(f"{args.arch:>12s} {'infer_fp16':>12s}: {ips:8.1f} img/s")

    base = results.get("fp32")
    if base:
        for mode, ips in results.items():
            print(f"speedup {mode}: {ips / base:.2f}x")


if __name__ == "__main__":
    main()
