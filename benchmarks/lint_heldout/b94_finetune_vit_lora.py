"""LoRA fine-tuning of a torchvision ViT-B/16 on an ImageFolder dataset.

The backbone is frozen; rank-r adapters are inserted into both MLP projections of
every encoder block and trained together with a fresh classification head.
A short head-only warm-up runs first so the adapters start from a sensible head.

    python finetune_vit_lora.py --data-dir /data/flowers102 --precision bf16
"""
import argparse
import copy
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision.models import ViT_B_16_Weights, vit_b_16


@dataclass
class TrainConfig:
    data_dir: str
    out_dir: str = "runs/vit_lora"
    epochs: int = 10
    warmup_steps: int = 300
    batch_size: int = 64
    lr: float = 1e-3
    head_lr: float = 0.05
    weight_decay: float = 0.05
    rank: int = 8
    alpha: float = 16.0
    precision: str = "fp16"  # fp16 | bf16 | fp32
    max_grad_norm: float = 1.0
    num_workers: int = 8
    log_every: int = 50


class LoRALinear(nn.Module):
    """y = W x + (B A x) * alpha / r, with W frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        merged = copy.deepcopy(self.base)
        merged.weight += (self.lora_B @ self.lora_A) * self.scaling
        return merged


def inject_lora(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.encoder.layers:
        block.mlp[0] = LoRALinear(block.mlp[0], rank, alpha)
        block.mlp[3] = LoRALinear(block.mlp[3], rank, alpha)
    return model


def build_loaders(cfg: TrainConfig):
    eval_tf = ViT_B_16_Weights.IMAGENET1K_V1.transforms()
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.35, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(eval_tf.mean, eval_tf.std),
    ])
    train_ds = datasets.ImageFolder(os.path.join(cfg.data_dir, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(cfg.data_dir, "val"), eval_tf)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.batch_size * 2, shuffle=False,
                            num_workers=cfg.num_workers, pin_memory=True)
    return train_loader, val_loader, len(train_ds.classes)


def warmup_head(model, loader, cfg, device):
    """Fit only the new head for a few hundred steps before the adapters start moving."""
    opt = torch.optim.SGD(model.heads.parameters(), lr=cfg.head_lr, momentum=0.9)
    model.train()
    step = 0
    while step < cfg.warmup_steps:
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                loss = F.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step >= cfg.warmup_steps:
                break
    print(f"head warm-up done, last loss {loss.item():.4f}")


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype, use_amp):
    model.eval()
    correct = total = 0
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=amp_dtype, enabled=use_amp):
            logits = model(images)
        correct += (logits.argmax(dim=-1) == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / max(total, 1)


def export_merged(model, path):
    merged = copy.deepcopy(model)
    for block in merged.encoder.layers:
        block.mlp[0] = block.mlp[0].merge()
        block.mlp[3] = block.mlp[3].merge()
    torch.save(merged.half().state_dict(), path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out-dir", default="runs/vit_lora")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="fp16")
    args = parser.parse_args()
    cfg = TrainConfig(data_dir=args.data_dir, out_dir=args.out_dir, epochs=args.epochs,
                      batch_size=args.batch_size, lr=args.lr, rank=args.rank, precision=args.precision)
    os.makedirs(cfg.out_dir, exist_ok=True)
    device = torch.device("cuda")
    train_loader, val_loader, num_classes = build_loaders(cfg)

    model = vit_b_16(weights=ViT_B_16_Weights.IMAGENET1K_V1)
    model = inject_lora(model, cfg.rank, cfg.alpha)
    model.heads = nn.Linear(model.hidden_dim, num_classes)
    model.to(device)

    warmup_head(model, train_loader, cfg, device)

    lora_params = [p for n, p in model.named_parameters() if "lora_" in n]
    lora_opt = torch.optim.AdamW(lora_params, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=1e-8)
    head_opt = torch.optim.SGD(model.heads.parameters(), lr=cfg.head_lr * 0.1, momentum=0.9)
    total_steps = cfg.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(lora_opt, max_lr=cfg.lr, total_steps=total_steps, pct_start=0.1)

    amp_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
    use_amp = cfg.precision != "fp32"
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")

    best_acc, global_step = 0.0, 0
    for epoch in range(cfg.epochs):
        t0 = time.time()
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=amp_dtype, enabled=use_amp):
                logits = model(images)
                loss = F.cross_entropy(logits, labels, label_smoothing=0.1)

            lora_opt.zero_grad(set_to_none=True)
            head_opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(lora_params, cfg.max_grad_norm)  # expect: AMP005
            scaler.step(lora_opt)
            head_opt.step()  # expect: AMP006
            scaler.update()
            sched.step()
            global_step += 1
            if global_step % cfg.log_every == 0:
                print(f"epoch {epoch} step {global_step} loss {loss.item():.4f} "
                      f"scale {scaler.get_scale():.0f} lr {sched.get_last_lr()[0]:.2e}")

        acc = evaluate(model, val_loader, device, amp_dtype, use_amp)
        print(f"epoch {epoch}: val acc {acc:.4f} ({time.time() - t0:.0f}s)")
        if acc > best_acc:
            best_acc = acc
            trainable = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
            torch.save({"adapter": trainable, "config": asdict(cfg), "acc": acc},
                       os.path.join(cfg.out_dir, "best_adapter.pt"))

    export_merged(model, os.path.join(cfg.out_dir, "merged_fp16.pt"))
    print(f"best val acc {best_acc:.4f}")


if __name__ == "__main__":
    main()
