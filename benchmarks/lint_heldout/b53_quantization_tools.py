"""Compression utilities for a fine-tuned text classifier: pruning, a short recovery
fine-tune, distillation, int8 weight quantization, fp16 conversion and ONNX export.

Typical use::

    python b53_quantization_tools.py --model out/bert-sst2 --prune 0.3 --export out/model.onnx
"""
import argparse
import copy
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer

FP16_MAX = 65504.0


class MinMaxObserver(nn.Module):
    """Running min/max of a tensor, used to pick activation scales for int8 export."""

    def __init__(self, averaging_constant=0.01):
        super().__init__()
        self.averaging_constant = averaging_constant
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    @torch.no_grad()
    def forward(self, x):
        x = x.detach().float()
        cur_min, cur_max = x.min(), x.max()
        if torch.isinf(self.min_val):
            self.min_val.copy_(cur_min)
            self.max_val.copy_(cur_max)
        else:
            self.min_val.lerp_(cur_min, self.averaging_constant)
            self.max_val.lerp_(cur_max, self.averaging_constant)
        return x

    def calculate_qparams(self, qmin=-128, qmax=127):
        scale = (self.max_val - self.min_val).clamp(min=1e-8) / float(qmax - qmin)
        zero_point = qmin - torch.round(self.min_val / scale)
        return scale, zero_point.clamp(qmin, qmax).to(torch.int32)


class ExportWrapper(nn.Module):
    """Returns probabilities, computed in fp32 whatever the dtype of the wrapped model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits.float().softmax(dim=-1)


def quantize_weight_per_channel(weight, bits=8):
    w = weight.detach().float()
    qmax = 2 ** (bits - 1) - 1
    scale = w.abs().amax(dim=1, keepdim=True) / qmax
    q = torch.clamp(torch.round(w / (scale + 1e-8)), -qmax - 1, qmax).to(torch.int8)
    return q, scale


def dequantize(q, scale):
    return q.float() * scale


def apply_magnitude_pruning(model, amount=0.3):
    params = [(m, "weight") for m in model.modules() if isinstance(m, nn.Linear)]
    prune.global_unstructured(params, pruning_method=prune.L1Unstructured, amount=amount)
    for module, name in params:
        prune.remove(module, name)
    zeros = sum(int((m.weight == 0).sum()) for m, _ in params)
    total = sum(m.weight.numel() for m, _ in params)
    return zeros / max(total, 1)


def finetune_after_pruning(model, loader, epochs=1, lr=2e-5):
    """Short recovery fine-tune after magnitude pruning, before the fp16 export."""
    model = model.cuda().half()  # expect: AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)  # expect: AMP011
    model.train()
    for _ in range(epochs):
        for batch in loader:
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model


def distill_finetune(student, teacher, loader, epochs=1, lr=5e-5, temperature=2.0, use_fp16=True):
    """Knowledge distillation from the unpruned model into the pruned one (mixed precision)."""
    teacher = teacher.cuda().half().eval().requires_grad_(False)
    student = student.cuda().train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda", enabled=use_fp16)
    for _ in range(epochs):
        for batch in loader:
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with torch.no_grad():
                t_logits = teacher(**batch).logits.float()
            with torch.autocast("cuda", dtype=torch.float16, enabled=use_fp16):
                out = student(**batch)
                kd = F.kl_div(F.log_softmax(out.logits / temperature, dim=-1), F.log_softmax(t_logits / temperature, dim=-1),
                              reduction="batchmean", log_target=True) * temperature ** 2
                loss = 0.5 * out.loss + 0.5 * kd
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return student


@torch.inference_mode()
def fp16_overflow_report(model, loader, max_batches=20):
    """Largest activation per Linear/LayerNorm output in fp32: layers near 65504 overflow in fp16."""
    peaks, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            def hook(mod, inp, out, name=name):
                peaks[name] = max(peaks.get(name, 0.0), out.detach().float().abs().max().item())
            handles.append(module.register_forward_hook(hook))
    model.eval()
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        model(**{k: v.cuda() for k, v in batch.items() if k != "labels"})
    for h in handles:
        h.remove()
    return {name: peak for name, peak in peaks.items() if peak > 0.5 * FP16_MAX}


@torch.inference_mode()
def compare_fp16_to_fp32(model, batch):
    model_fp16 = copy.deepcopy(model).half().eval()
    inputs = {k: v.cuda() for k, v in batch.items() if k != "labels"}
    ref = model.eval()(**inputs).logits.float()
    out = model_fp16(**inputs).logits.float()
    rel_err = (out - ref).norm() / (ref.norm() + 1e-8)
    agreement = (out.argmax(-1) == ref.argmax(-1)).float().mean()
    return rel_err.item(), agreement.item()


@torch.inference_mode()
def benchmark_latency(model, batch, iters=100, half=True):
    m = copy.deepcopy(model).eval()
    if half:
        m = m.half()
    inputs = {k: v.cuda() for k, v in batch.items() if k != "labels"}
    for _ in range(10):
        m(**inputs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        m(**inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def convert_checkpoint_to_fp16(src, dst, keep_fp32=("LayerNorm", "classifier.bias")):
    state = torch.load(src, map_location="cpu")
    converted = {k: v if any(s in k for s in keep_fp32) or not v.is_floating_point() else v.half() for k, v in state.items()}
    torch.save(converted, dst)
    return sum(v.numel() * v.element_size() for v in converted.values()) / 2 ** 20


def quantize_dynamic_int8(model):
    model = copy.deepcopy(model).cpu().float().eval()
    return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


def export_onnx(model, path, seq_len=128, fp16=True):
    wrapper = ExportWrapper(copy.deepcopy(model).eval())
    if fp16:
        wrapper = wrapper.half().cuda()
    dummy_ids = torch.ones(1, seq_len, dtype=torch.long, device="cuda" if fp16 else "cpu")
    dummy_mask = torch.ones_like(dummy_ids)
    torch.onnx.export(wrapper, (dummy_ids, dummy_mask), path, input_names=["input_ids", "attention_mask"],
                      output_names=["probs"], dynamic_axes={"input_ids": {0: "b", 1: "t"}, "attention_mask": {0: "b", 1: "t"}},
                      opset_version=17)


def int8_weight_error(model):
    errors = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            q, scale = quantize_weight_per_channel(module.weight)
            w = module.weight.detach().float()
            errors[name] = ((dequantize(q, scale) - w).norm() / (w.norm() + 1e-8)).item()
    return dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prune", type=float, default=0.0)
    parser.add_argument("--distill", action="store_true")
    parser.add_argument("--export", default="")
    parser.add_argument("--fp16-checkpoint", default="")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model)
    texts = ["a gripping, beautifully shot film", "tedious and overlong"] * 16
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    loader = [{"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
               "labels": torch.tensor([1, 0] * 16)}]

    if args.prune > 0:
        teacher = copy.deepcopy(model)
        sparsity = apply_magnitude_pruning(model, args.prune)
        print(f"sparsity after pruning: {sparsity:.2%}")
        if args.distill:
            model = distill_finetune(model, teacher, loader)
        else:
            model = finetune_after_pruning(model, loader)
        model = model.float()

    rel_err, agreement = compare_fp16_to_fp32(model.cuda(), loader[0])
    print(f"fp16 vs fp32: rel err {rel_err:.2e}, argmax agreement {agreement:.3f}")
    print("layers near the fp16 limit:", fp16_overflow_report(model, loader) or "none")
    print("worst int8 weight errors:", int8_weight_error(model))
    print(f"latency fp16: {benchmark_latency(model, loader[0]):.2f} ms, fp32: {benchmark_latency(model, loader[0], half=False):.2f} ms")
    int8_model = quantize_dynamic_int8(model)
    print(f"int8 model size: {sum(p.numel() for p in int8_model.state_dict().values() if torch.is_tensor(p))} params")
    if args.fp16_checkpoint:
        path = os.path.join(args.fp16_checkpoint, "pytorch_model.bin")
        torch.save(model.state_dict(), path + ".fp32")
        print(f"fp16 checkpoint: {convert_checkpoint_to_fp16(path + '.fp32', path):.1f} MiB")
    if args.export:
        export_onnx(model, args.export)
        np.save(args.export + ".labels.npy", np.array(list(model.config.id2label.values())))


if __name__ == "__main__":
    main()
