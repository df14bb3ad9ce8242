#!/usr/bin/env python
"""Export a trained classifier to TorchScript / ONNX (fp32 and fp16).

    python tools/export.py --config configs/convnext_t.yaml --ckpt runs/exp3/best.pt \
        --formats torchscript onnx --half --check --benchmark

The fp16 artefacts are produced from a deep copy of the fp32 model, so one run
writes both precisions.
"""
import argparse
import copy
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import build_model
from utils.checkpoint import load_checkpoint
from utils.config import load_config

LOGGER = logging.getLogger("export")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def autocast_fp16(enabled: bool = True):
    if TORCH_VERSION >= (1, 10):
        return torch.autocast("cuda", dtype=torch.float16, enabled=enabled)
    else:
        return torch.cuda.amp.autocast(enabled=enabled)


class ExportWrapper(nn.Module):
    """Folds uint8 -> float conversion, normalisation, class restriction and softmax into the graph."""

    def __init__(self, model: nn.Module, num_classes: int, allowed_classes=None,
                 mean=IMAGENET_MEAN, std=IMAGENET_STD):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1) * 255.0)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1) * 255.0)
        allowed = torch.ones(num_classes, dtype=torch.bool)
        if allowed_classes is not None:
            allowed = torch.zeros(num_classes, dtype=torch.bool)
            allowed[list(allowed_classes)] = True
        self.register_buffer("allowed", allowed)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.mean.dtype)
        x = (x - self.mean) / self.std
        logits = self.model(x)
        logits = logits.masked_fill(~self.allowed, -1e9)  # expect: AMP007
        return logits.float().softmax(dim=-1)


def load_model(cfg, ckpt_path: str, device: torch.device) -> nn.Module:
    model = build_model(cfg.model)
    state = load_checkpoint(ckpt_path, map_location="cpu")
    state = state.get("model_ema", state.get("model", state))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        LOGGER.warning("missing=%s unexpected=%s", missing, unexpected)
    if hasattr(model, "fuse"):
        model.fuse()
    model.eval()
    model.requires_grad_(False)
    return model.to(device)


def save_fp16_checkpoint(model: nn.Module, path: Path):
    torch.save({"model": copy.deepcopy(model).half().state_dict(), "dtype": "float16"}, path)
    LOGGER.info("wrote %s (%.1f MB)", path, path.stat().st_size / 2**20)


@torch.inference_mode()
def export_torchscript(model: nn.Module, dummy: torch.Tensor, path: Path, half: bool = False) -> Path:
    m = copy.deepcopy(model)
    if half:
        m = m.half()
    traced = torch.jit.trace(m, dummy, check_trace=False)
    traced = torch.jit.freeze(traced)
    traced.save(str(path))
    LOGGER.info("TorchScript -> %s", path)
    return path


def export_onnx(model: nn.Module, dummy: torch.Tensor, path: Path, opset: int = 17,
                half: bool = False, dynamic: bool = True) -> Path:
    export_model = copy.deepcopy(model).half() if half else model
    dynamic_axes = {"images": {0: "batch"}, "probs": {0: "batch"}} if dynamic else None
    with torch.no_grad():
        torch.onnx.export(
            export_model, (dummy,), str(path),
            input_names=["images"], output_names=["probs"],
            opset_version=opset, dynamic_axes=dynamic_axes, do_constant_folding=True,
        )
    LOGGER.info("ONNX -> %s", path)
    return path


def convert_onnx_fp16(src: Path, dst: Path) -> Path:
    """Post-hoc fp16 conversion of an fp32 graph (keeps uint8 input / fp32 output)."""
    import onnx
    from onnxconverter_common import float16

    model = onnx.load(str(src))
    model16 = float16.convert_float_to_float16(model, keep_io_types=True)
    onnx.save(model16, str(dst))
    return dst


@torch.inference_mode()
def check_parity(model: nn.Module, onnx_path: Path, dummy: torch.Tensor, atol: float = 1e-3) -> dict:
    import onnxruntime as ort

    model.eval()
    ref_t = model(dummy).float()
    ref = ref_t.cpu().numpy()
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    sess = ort.InferenceSession(str(onnx_path), providers=providers)
    out = sess.run(None, {"images": dummy.cpu().numpy()})[0].astype(np.float32)
    err = np.abs(ref - out)
    report = {
        "onnx_max_abs_err": float(err.max()),
        "onnx_mean_abs_err": float(err.mean()),
        "onnx_top1_agree": float((ref.argmax(-1) == out.argmax(-1)).mean()),
    }

    # the same graph run by torch under autocast, for reference
    with autocast_fp16(enabled=dummy.is_cuda):
        out16 = model(dummy)
    diff = (out16.float() - ref_t).abs()
    report["autocast_max_abs_err"] = diff.max().item()
    report["autocast_mean_abs_err"] = diff.mean().item()
    report["autocast_top1_agree"] = (out16.argmax(-1) == ref_t.argmax(-1)).float().mean().item()
    if report["onnx_max_abs_err"] > atol:
        LOGGER.warning("ONNX output differs from torch by %.2e (atol %.0e)", report["onnx_max_abs_err"], atol)
    return report


def benchmark(model: nn.Module, dummy: torch.Tensor, iters: int = 100, warmup: int = 10,
              use_autocast: bool = False) -> dict:
    model.eval()
    timings = []
    with torch.inference_mode(), torch.cuda.amp.autocast(enabled=use_autocast):  # expect: AMP009
        for i in range(warmup + iters):
            if dummy.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(dummy)
            if dummy.is_cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                timings.append(time.perf_counter() - t0)
    timings = np.asarray(timings) * 1000.0
    return {"mean_ms": float(timings.mean()), "p50_ms": float(np.percentile(timings, 50)),
            "p99_ms": float(np.percentile(timings, 99)), "fastest_ms": float(timings.min()) if len(timings) else 1e9}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", default="export")
    p.add_argument("--formats", nargs="+", default=["torchscript", "onnx"])
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--half", action="store_true", help="also write fp16 artefacts")
    p.add_argument("--allowed-classes", default=None, help="json list of class ids kept at inference")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--benchmark", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    device = torch.device(args.device)
    cfg = load_config(args.config)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    model = load_model(cfg, args.ckpt, device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    allowed = json.loads(args.allowed_classes) if args.allowed_classes else None
    wrapper = ExportWrapper(model, cfg.model.num_classes, allowed).to(device).eval()
    dummy = torch.randint(0, 256, (args.batch, 3, args.img_size, args.img_size), dtype=torch.uint8, device=device)

    report = {}
    if "torchscript" in args.formats:
        export_torchscript(wrapper, dummy, out_dir / "model.torchscript")
        if args.half and device.type == "cuda":
            export_torchscript(wrapper, dummy, out_dir / "model_fp16.torchscript", half=True)
    if "onnx" in args.formats:
        onnx_path = export_onnx(wrapper, dummy, out_dir / "model.onnx", opset=args.opset)
        if args.half:
            convert_onnx_fp16(onnx_path, out_dir / "model_fp16.onnx")
        if args.check:
            report.update(check_parity(wrapper, onnx_path, dummy))
    if args.half:
        save_fp16_checkpoint(model, out_dir / "weights_fp16.pt")

    if args.benchmark:
        report["fp32"] = benchmark(wrapper, dummy)
        report["autocast"] = benchmark(wrapper, dummy, use_autocast=True)
        if device.type == "cuda":
            wrapper_half = copy.deepcopy(wrapper).half()
            report["fp16"] = benchmark(wrapper_half, dummy)
    (out_dir / "export_report.json").write_text(json.dumps(report, indent=2))
    LOGGER.info("%s", json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
