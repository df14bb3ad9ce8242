"""Deployment helpers: short recovery fine-tune, fp16 / int8 weight export,
ONNX and TorchScript export, and an fp32-vs-export parity check.

    python export_deploy.py --ckpt runs/det_r50/best.pth --format onnx --fp16
"""
import argparse
import copy
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("export")

FP16_MAX = 65504.0


def build_model(ckpt_path):
    from models import build_classifier  # project model zoo

    ckpt = torch.load(ckpt_path, map_location="cpu")
    model = build_classifier(ckpt["arch"], num_classes=ckpt["num_classes"])
    model.load_state_dict(ckpt["model"])
    return model, ckpt


def check_half_range(model):
    max_abs = max(p.detach().abs().max().item() for p in model.parameters())
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and buf.numel():
            max_abs = max(max_abs, buf.abs().max().item())
    if max_abs > FP16_MAX:
        log.warning("largest weight %.3g does not fit in half precision (max %.0f)", max_abs,
                    torch.finfo(torch.float16).max)
        return False
    return True


def recovery_finetune(model, loader, steps, lr, device):
    """A few hundred steps on the target-domain calibration set before export."""
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, eps=1e-8)
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0**14)  # expect: AMP009
    it = iter(loader)
    for step in range(steps):
        try:
            images, targets = next(it)
        except StopIteration:
            it = iter(loader)
            images, targets = next(it)
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(images), targets)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
        scaler.step(opt)
        scaler.update()
        if step % 50 == 0:
            log.info("recovery step %d loss %.4f scale %.0f", step, loss.item(), scaler.get_scale())
    return model.eval()


@torch.no_grad()
def quantize_weight_int8(weight):
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8)
    scale = absmax / 127.0
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale.squeeze(1).to(torch.float16)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_weight_int8(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        w = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return F.linear(x, w, self.bias if self.bias is None else self.bias.to(x.dtype))


def replace_linears_int8(model, skip=("head",)):
    for name, child in model.named_children():
        if isinstance(child, nn.Linear) and name not in skip:
            setattr(model, name, Int8Linear(child))
        else:
            replace_linears_int8(child, skip)
    return model


@torch.inference_mode()
def calibrate_ranges(model, loader, device, n_batches=32):
    ranges, hooks = {}, []

    def make_hook(name):
        def hook(_mod, _inp, out):
            cur = out.detach().abs().amax().float()
            ranges[name] = torch.maximum(ranges.get(name, cur), cur)
        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Conv2d)):
            hooks.append(mod.register_forward_hook(make_hook(name)))
    for i, (images, _) in enumerate(loader):
        if i >= n_batches:
            break
        model(images.to(device).half())
    for h in hooks:
        h.remove()
    return {k: v.item() for k, v in ranges.items()}


def export_onnx(model, path, image_size, fp16, opset=17):
    model = copy.deepcopy(model).eval()
    dummy = torch.randn(1, 3, image_size, image_size, device=next(model.parameters()).device)
    if fp16:
        model = model.half()
        dummy = dummy.to(torch.float16)
    torch.onnx.export(model, dummy, path, opset_version=opset, input_names=["images"],
                      output_names=["logits"], dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
    return path


def export_torchscript(model, path, image_size):
    model = copy.deepcopy(model).half().eval()
    example = torch.randn(1, 3, image_size, image_size, device=next(model.parameters()).device).half()
    with torch.inference_mode():
        traced = torch.jit.trace(model, example)
    traced.save(path)
    return path


def save_fp16_weights(model, path):
    compact = copy.deepcopy(model).half()
    torch.save({"model": compact.state_dict(), "dtype": "float16"}, path)


def dynamic_quantize_cpu(model):
    cpu_model = copy.deepcopy(model).float().cpu().eval()
    return torch.ao.quantization.quantize_dynamic(cpu_model, {nn.Linear}, dtype=torch.qint8)


@torch.no_grad()
def parity(model, exported, image_size, device, fp16):
    x = torch.randn(8, 3, image_size, image_size, device=device)
    ref = model.float().eval()(x).float()
    out = exported(x.half() if fp16 else x).float()
    err = (ref - out).abs().max().item()
    rel = err / (ref.abs().max().item() + 1e-8)
    return err, rel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--format", choices=["onnx", "torchscript", "fp16", "int8", "dynamic"], default="onnx")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--recovery-data", default=None)
    parser.add_argument("--recovery-steps", type=int, default=300)
    parser.add_argument("--out", default="export")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    model, ckpt = build_model(args.ckpt)
    if args.recovery_data:
        from data import calibration_loader

        model = recovery_finetune(model, calibration_loader(args.recovery_data), args.recovery_steps, 1e-5, device)
    model = model.to(device).eval()
    if (args.fp16 or args.format == "fp16") and not check_half_range(model):
        raise SystemExit("refusing half-precision export")

    stem = os.path.join(args.out, ckpt["arch"])
    if args.format == "onnx":
        export_onnx(model, stem + ".onnx", args.image_size, args.fp16)
    elif args.format == "torchscript":
        export_torchscript(model, stem + ".ts", args.image_size)
        err, rel = parity(model, torch.jit.load(stem + ".ts"), args.image_size, device, fp16=True)
        log.info("torchscript parity: max abs %.3g, rel %.3g", err, rel)
    elif args.format == "fp16":
        save_fp16_weights(model, stem + "_fp16.pth")
    elif args.format == "int8":
        qmodel = replace_linears_int8(copy.deepcopy(model).half())
        torch.save(qmodel.state_dict(), stem + "_int8.pth")
    else:
        torch.save(dynamic_quantize_cpu(model), stem + "_dynamic.pt")


if __name__ == "__main__":
    main()
