"""Multi-label image tagger: batched inference engine, evaluation harness, temperature
calibration and an on-line adaptation hook fed by user-corrected tags.

Serving runs the model in fp16 (or bf16/fp32, per config); evaluation uses fp16
autocast under no_grad; adaptation fine-tunes an fp32 copy and hot-swaps it in.
"""
import argparse
import copy
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tagger_data import build_feedback_loader, build_val_loader


@dataclass
class ServeConfig:
    ckpt: str
    num_classes: int = 4000
    device: str = "cuda"
    dtype: str = "fp16"
    max_batch: int = 64
    max_wait_ms: float = 5.0
    threshold: float = 0.5


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ConvBNAct(nn.Sequential):
    def __init__(self, cin, cout, stride):
        super().__init__(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.SiLU(inplace=True))


class Tagger(nn.Module):
    def __init__(self, num_classes, width=64):
        super().__init__()
        self.stem = ConvBNAct(3, width, 2)
        self.stages = nn.Sequential(
            ConvBNAct(width, width * 2, 2),
            ConvBNAct(width * 2, width * 4, 2),
            ConvBNAct(width * 4, width * 8, 2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width * 8, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(self.pool(x), 1))


def build_tagger(num_classes):
    return Tagger(num_classes)


def top_tags(probs, allowed, k=10):
    scores = probs.float().masked_fill(~allowed, -1e9)
    return scores.topk(k, dim=-1)


class InferenceEngine:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        model = build_tagger(cfg.num_classes)
        model.load_state_dict(torch.load(cfg.ckpt, map_location="cpu")["model"])
        model = model.to(self.device).eval()
        if cfg.dtype == "fp16":
            model = model.half()
        elif cfg.dtype == "bf16":
            model = model.bfloat16()
        self.model = model
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1).to(self.dtype)
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1).to(self.dtype)
        self.requests = queue.Queue()
        self._stop = threading.Event()

    def warmup(self, iters=3):
        dummy = torch.zeros(self.cfg.max_batch, 3, 224, 224, dtype=self.dtype, device=self.device)
        for _ in range(iters):
            self.predict_tensor(dummy)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def predict_tensor(self, x):
        return torch.sigmoid(self.model(x).float())

    @torch.inference_mode()
    def predict(self, images_uint8):
        x = images_uint8.to(self.device, non_blocking=True).to(self.dtype).div_(255)
        x = (x - self.mean) / self.std
        return self.predict_tensor(x)

    def serve_forever(self):
        while not self._stop.is_set():
            batch, futures = [], []
            deadline = time.monotonic() + self.cfg.max_wait_ms / 1000
            while len(batch) < self.cfg.max_batch and time.monotonic() < deadline:
                try:
                    image, fut = self.requests.get(timeout=self.cfg.max_wait_ms / 1000)
                except queue.Empty:
                    continue
                batch.append(image)
                futures.append(fut)
            if not batch:
                continue
            probs = self.predict(torch.stack(batch))
            for fut, row in zip(futures, probs.cpu()):
                fut.set_result((row > self.cfg.threshold).nonzero().flatten().tolist())


def evaluate(model, loader, device="cuda", threshold=0.5):
    model.eval()
    tp = fp = fn = 0
    bce_total, n_batches = 0.0, 0
    mean_logit = None
    with torch.no_grad():
        for images, targets in loader:
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True).float()
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(images)
                probs = torch.sigmoid(logits)
                bce = F.binary_cross_entropy(probs, targets)  # expect: AMP003
            batch_mean = logits.mean(dim=0)
            mean_logit = batch_mean if mean_logit is None else mean_logit + batch_mean
            pred = probs > threshold
            truth = targets > 0.5
            tp += (pred & truth).sum().item()
            fp += (pred & ~truth).sum().item()
            fn += (~pred & truth).sum().item()
            bce_total += bce.item()
            n_batches += 1
    precision = tp / max(tp + fp, 1)
    recall = tp / max(tp + fn, 1)
    f1 = 2 * precision * recall / max(precision + recall, 1e-8)
    return {"f1": f1, "bce": bce_total / max(n_batches, 1), "mean_logit": mean_logit}


@torch.inference_mode()
def collect_logits(engine, loader):
    all_logits, all_targets = [], []
    for images, targets in loader:
        x = images.to(engine.device, non_blocking=True).half()
        all_logits.append(engine.model(x).float().cpu())
        all_targets.append(targets.float())
    return torch.cat(all_logits), torch.cat(all_targets)


def fit_temperature(logits, targets, max_iter=50):
    """Post-hoc temperature scaling, fitted in fp32 with LBFGS."""
    logits = logits.float().cuda()
    targets = targets.float().cuda()
    log_t = torch.zeros(1, device=logits.device, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.05, max_iter=max_iter)

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(logits / log_t.exp(), targets)
        loss.backward()
        return loss

    opt.step(closure)
    return log_t.exp().item()


def finetune_on_feedback(model, feedback_loader, steps=100, lr=1e-4, device="cuda"):
    """Adapt a copy of the served model on user-corrected tags (runs off the serving path)."""
    student = copy.deepcopy(model).float().to(device).train()
    optimizer = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9)
    criterion = nn.BCEWithLogitsLoss()
    for step, (images, targets) in enumerate(feedback_loader):
        if step >= steps:
            break
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True).float()
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            logits = student(images)
            loss = criterion(logits, targets)
            loss.backward()  # expect: AMP008
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return student.eval()


def deploy_adapted(engine, student):
    """Swap the adapted weights into the running engine, in the engine's precision."""
    new_model = copy.deepcopy(student).eval().to(engine.device, dtype=engine.dtype)
    engine.model = new_model.half() if engine.cfg.dtype == "fp16" else new_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    p.add_argument("--adapt", action="store_true")
    args = p.parse_args()

    cfg = ServeConfig(ckpt=args.ckpt, dtype=args.dtype)
    engine = InferenceEngine(cfg)
    engine.warmup()
    val_loader = build_val_loader(batch_size=128)
    print(evaluate(engine.model, val_loader))
    logits, targets = collect_logits(engine, val_loader)
    print(f"temperature: {fit_temperature(logits, targets):.3f}")
    if args.adapt:
        student = finetune_on_feedback(engine.model, build_feedback_loader(batch_size=32))
        deploy_adapted(engine, student)
    worker = threading.Thread(target=engine.serve_forever, daemon=True)
    worker.start()


if __name__ == "__main__":
    main()
