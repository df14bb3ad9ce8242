"""Quantization-aware training of a tiny transformer encoder, then ONNX / TensorRT export.

Fake quantisation runs in fp32 inside custom autograd functions; the rest of the
model trains under fp16 autocast with a GradScaler (or in fp32 with --no-amp).
Export code builds an fp16 copy of the trained model.
"""
import argparse
import copy
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from glue_data import build_loader

if hasattr(torch.amp, "custom_fwd"):
    amp_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="cuda")
    amp_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="cuda")
else:  # torch < 2.4
    amp_custom_fwd = torch.cuda.amp.custom_fwd
    amp_custom_bwd = torch.cuda.amp.custom_bwd


class FakeQuantSTE(torch.autograd.Function):
    """Fake quantisation with a straight-through estimator, always computed in fp32."""

    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x, scale, zero_point, qmin, qmax):
        q = torch.clamp(torch.round(x / scale) + zero_point, qmin, qmax)
        ctx.save_for_backward(x, (qmin - zero_point) * scale, (qmax - zero_point) * scale)
        return (q - zero_point) * scale

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        x, lo, hi = ctx.saved_tensors
        pass_through = (x >= lo) & (x <= hi)
        return grad_out * pass_through, None, None, None, None


class LSQRound(torch.autograd.Function):
    """Learned step size rounding (Esser et al.); the gated decorators pick torch.amp when present."""

    @staticmethod
    @amp_custom_fwd(cast_inputs=torch.float32)
    def forward(ctx, x, step, qmin, qmax):
        ctx.save_for_backward(x, step)
        ctx.bounds = (qmin, qmax)
        return torch.clamp(torch.round(x / step), qmin, qmax) * step

    @staticmethod
    @amp_custom_bwd
    def backward(ctx, grad_out):
        x, step = ctx.saved_tensors
        qmin, qmax = ctx.bounds
        v = x / step
        inside = (v >= qmin) & (v <= qmax)
        grad_step = torch.where(inside, torch.round(v) - v, torch.clamp(v, qmin, qmax)).mul(grad_out).sum().view(1)
        return grad_out * inside, grad_step, None, None


class EMAMinMaxObserver(nn.Module):
    def __init__(self, momentum=0.01, bits=8, symmetric=False):
        super().__init__()
        self.momentum = momentum
        self.symmetric = symmetric
        self.qmin, self.qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        self.enabled = True

    @torch.no_grad()
    def forward(self, x):
        if not self.enabled:
            return
        x = x.detach().float()
        mn, mx = x.min(), x.max()
        if torch.isinf(self.min_val):
            self.min_val.copy_(mn)
            self.max_val.copy_(mx)
        else:
            self.min_val.lerp_(mn, self.momentum)
            self.max_val.lerp_(mx, self.momentum)

    def qparams(self):
        if self.symmetric:
            amax = torch.maximum(-self.min_val, self.max_val)
            scale = (amax / ((self.qmax - self.qmin) / 2)).clamp(min=1e-8)
            zero_point = torch.zeros_like(scale)
        else:
            scale = ((self.max_val - self.min_val) / (self.qmax - self.qmin)).clamp(min=1e-8)
            zero_point = (self.qmin - torch.round(self.min_val / scale)).clamp(self.qmin, self.qmax)
        return scale, zero_point


class FakeQuantize(nn.Module):
    def __init__(self, bits=8, symmetric=False):
        super().__init__()
        self.observer = EMAMinMaxObserver(bits=bits, symmetric=symmetric)
        self.fake_quant_enabled = True

    def forward(self, x):
        self.observer(x)
        if not self.fake_quant_enabled:
            return x
        scale, zero_point = self.observer.qparams()
        return FakeQuantSTE.apply(x, scale, zero_point, self.observer.qmin, self.observer.qmax)


class QuantLinear(nn.Linear):
    def __init__(self, in_features, out_features, bias=True):
        super().__init__(in_features, out_features, bias)
        self.w_fq = FakeQuantize(bits=8, symmetric=True)
        self.a_fq = FakeQuantize(bits=8)

    def forward(self, x):
        return F.linear(self.a_fq(x), self.w_fq(self.weight), self.bias)


class QuantSelfAttention(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = QuantLinear(dim, 3 * dim)
        self.proj = QuantLinear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, attn_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask[:, None, None, :] == 0, -1e9)  # expect: AMP007
        attn = self.drop(scores.softmax(dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(B, T, C))


class EncoderBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = QuantSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(QuantLinear(dim, dim * mlp_ratio), nn.GELU(), QuantLinear(dim * mlp_ratio, dim))

    def forward(self, x, attn_mask):
        x = x + self.attn(self.ln1(x), attn_mask)
        return x + self.mlp(self.ln2(x))


class QuantTinyEncoder(nn.Module):
    def __init__(self, vocab, dim=256, depth=4, heads=4, num_classes=2, max_len=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([EncoderBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = QuantLinear(dim, num_classes)

    def forward(self, ids, attn_mask):
        pos = torch.arange(ids.size(1), device=ids.device)
        x = self.tok(ids) + self.pos(pos)[None]
        for blk in self.blocks:
            x = blk(x, attn_mask)
        x = self.norm(x)
        pooled = x.masked_fill(attn_mask[..., None] == 0, -1e4).max(dim=1).values
        return self.head(pooled)


def set_observers(model, enabled):
    for m in model.modules():
        if isinstance(m, EMAMinMaxObserver):
            m.enabled = enabled


@torch.no_grad()
def calibrate(model, loader, num_batches=32):
    model.eval()
    for i, (ids, mask, _) in enumerate(loader):
        if i >= num_batches:
            break
        with torch.autocast("cuda", dtype=torch.float16):
            model(ids.cuda(non_blocking=True), mask.cuda(non_blocking=True))
    model.train()


def train_qat(model, loader, optimizer, scheduler, scaler, args):
    model.train()
    for epoch in range(args.epochs):
        if epoch == args.freeze_observer_epoch:
            set_observers(model, False)
        for ids, mask, labels in loader:
            ids, mask, labels = ids.cuda(non_blocking=True), mask.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=scaler is not None):
                logits = model(ids, mask)
                loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
            scheduler.step()


def export_onnx(model, path, seq_len=128, opset=17):
    export_model = copy.deepcopy(model).eval().half().cuda()
    set_observers(export_model, False)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="cuda")
    mask = torch.ones(1, seq_len, dtype=torch.long, device="cuda")
    axes = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch"}, "logits": {0: "batch"}}
    torch.onnx.export(export_model, (ids, mask), path, input_names=["input_ids", "attention_mask"],
                      output_names=["logits"], dynamic_axes=axes, opset_version=opset)
    return path


def export_fp16_state_dict(model, path):
    sd = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    torch.save(sd, path)


def build_trt_engine(onnx_path, engine_path, fp16=True, workspace_gb=4):
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH))
    parser = trt.OnnxParser(network, logger)
    with open(onnx_path, "rb") as f:
        if not parser.parse(f.read()):
            raise RuntimeError(parser.get_error(0))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_gb << 30)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    with open(engine_path, "wb") as f:
        f.write(builder.build_serialized_network(network, config))


@torch.inference_mode()
def verify_export(model, run_engine, ids, mask):
    ref = model.eval()(ids, mask)
    out = run_engine(ids, mask)
    torch.testing.assert_close(ref.half(), out, rtol=2e-2, atol=2e-2)


def benchmark_latency(model, seq_len=128, batch=32, iters=50):
    m = copy.deepcopy(model).eval().half().cuda()
    ids = torch.randint(0, 1000, (batch, seq_len), device="cuda")
    mask = torch.ones_like(ids)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        for _ in range(5):
            m(ids, mask)
        start.record()
        for _ in range(iters):
            m(ids, mask)
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--num_classes", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--freeze_observer_epoch", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--no-amp", dest="amp", action="store_false")
    args = p.parse_args()

    model = QuantTinyEncoder(args.vocab, num_classes=args.num_classes).cuda()
    model.load_state_dict(torch.load(args.pretrained, map_location="cpu"), strict=False)
    loader = build_loader("train", batch_size=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(loader))
    scaler = torch.amp.GradScaler("cuda") if args.amp else None
    calibrate(model, loader)
    train_qat(model, loader, optimizer, scheduler, scaler, args)
    export_onnx(model, "encoder_fp16.onnx")
    export_fp16_state_dict(model, "encoder_fp16.pt")
    print(f"latency: {benchmark_latency(model):.2f} ms")


if __name__ == "__main__":
    main()
