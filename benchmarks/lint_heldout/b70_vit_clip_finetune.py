"""Multi-label image tagging on top of a pretrained ViT / CLIP vision tower.

modes:
  finetune : full fine-tune of the backbone + attention-pooling head (layer-wise lr decay)
  probe    : frozen fp16 CLIP vision tower, linear probe on pooled features
"""
import argparse
import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from transformers import AutoModel, CLIPVisionModel

from tagging.data import build_tagging_datasets
from tagging.metrics import mean_average_precision

logger = logging.getLogger("tagging")


class AttentionPoolHead(nn.Module):
    """Single learned query attending over patch tokens; dropped patches are masked out."""

    def __init__(self, dim, num_classes, dropout=0.1):
        super().__init__()
        self.query = nn.Parameter(torch.randn(dim) * 0.02)
        self.key = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(dim, num_classes)
        self.scale = dim ** -0.5

    def forward(self, tokens, keep_mask=None):
        k = self.key(tokens)
        scores = torch.matmul(k, self.query) * self.scale
        if keep_mask is not None:
            scores = scores.masked_fill(~keep_mask, -1e9)  # expect: AMP007
        attn = scores.softmax(dim=-1)
        pooled = torch.bmm(attn.unsqueeze(1), tokens).squeeze(1)
        return self.fc(self.drop(self.norm(pooled)))


class MaskedMeanPool(nn.Module):
    """Fallback pooling used by the ablations; keeps fp32 statistics."""

    def forward(self, tokens, keep_mask=None):
        if keep_mask is None:
            return tokens.float().mean(dim=1)
        w = keep_mask.unsqueeze(-1).float()
        return (tokens.float() * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-6)


class ImageTagger(nn.Module):
    def __init__(self, backbone, num_classes, pool="attn"):
        super().__init__()
        self.backbone = backbone
        dim = backbone.config.hidden_size
        self.pool = pool
        self.head = AttentionPoolHead(dim, num_classes)
        self.mean_pool = MaskedMeanPool()
        self.mean_fc = nn.Linear(dim, num_classes)

    def forward(self, pixel_values, keep_mask=None):
        tokens = self.backbone(pixel_values=pixel_values).last_hidden_state[:, 1:]
        if self.pool == "attn":
            return self.head(tokens, keep_mask)
        return self.mean_fc(self.mean_pool(tokens, keep_mask))


def layerwise_param_groups(model, base_lr, weight_decay, decay_rate=0.75):
    layers = model.backbone.config.num_hidden_layers
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("backbone.encoder.layer."):
            layer_id = int(name.split(".")[3]) + 1
        elif name.startswith("backbone."):
            layer_id = 0
        else:
            layer_id = layers + 1
        wd = 0.0 if p.ndim == 1 else weight_decay
        key = (layer_id, wd)
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": wd, "lr": base_lr * decay_rate ** (layers + 1 - layer_id)}
        groups[key]["params"].append(p)
    return list(groups.values())


class MultiLabelTrainer:
    def __init__(self, model, optimizer, scaler, scheduler, args, device):
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.scheduler = scheduler
        self.args = args
        self.device = device
        self.criterion = nn.BCELoss()
        self.best_map = 0.0

    def train_one_epoch(self, loader, epoch):
        self.model.train()
        for it, (images, targets, keep_mask) in enumerate(loader):
            pixel_values = images.to(self.device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
            targets = targets.to(self.device, non_blocking=True).float()
            keep_mask = keep_mask.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(pixel_values, keep_mask)
                probs = torch.sigmoid(logits)
                loss = self.criterion(probs, targets)  # expect: AMP003
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_grad)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            if it % self.args.log_every == 0:
                logger.info("epoch %d it %d loss %.4f scale %.0f", epoch, it, loss.item(), self.scaler.get_scale())

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        all_probs, all_targets = [], []
        for images, targets, keep_mask in loader:
            pixel_values = images.to(self.device, dtype=torch.float16)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(pixel_values, keep_mask.to(self.device))
            all_probs.append(torch.sigmoid(logits.float()).cpu())
            all_targets.append(targets)
        self.model.train()
        return mean_average_precision(torch.cat(all_probs), torch.cat(all_targets))

    def fit(self, train_loader, val_loader, epochs):
        for epoch in range(epochs):
            self.train_one_epoch(train_loader, epoch)
            m = self.evaluate(val_loader)
            logger.info("epoch %d mAP %.4f", epoch, m)
            if m > self.best_map:
                self.best_map = m
                torch.save({"model": self.model.state_dict(), "epoch": epoch, "map": m},
                           os.path.join(self.args.output_dir, "best.pt"))


def export_half_torchscript(model, path, image_size=224):
    model = model.eval().half().cuda()
    example = torch.randn(1, 3, image_size, image_size, device="cuda", dtype=torch.float16)
    traced = torch.jit.trace(model, (example,))
    traced.save(path)


def train_linear_probe(args, train_loader, val_loader, num_classes, device):
    vision = CLIPVisionModel.from_pretrained(args.backbone, torch_dtype=torch.float16).to(device)
    vision.eval()
    vision.requires_grad_(False)
    probe = nn.Linear(vision.config.hidden_size, num_classes).to(device)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=args.probe_lr, weight_decay=0.0)
    for epoch in range(args.epochs):
        for images, targets, _ in train_loader:
            with torch.no_grad():
                feats = vision(pixel_values=images.to(device, dtype=torch.float16)).pooler_output.float()
            logits = probe(feats)
            loss = F.binary_cross_entropy_with_logits(logits, targets.to(device).float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        probs, tgts = [], []
        with torch.no_grad():
            for images, targets, _ in val_loader:
                feats = vision(pixel_values=images.to(device).half()).pooler_output.float()
                probs.append(torch.sigmoid(probe(feats)).cpu())
                tgts.append(targets)
        logger.info("probe epoch %d mAP %.4f", epoch, mean_average_precision(torch.cat(probs), torch.cat(tgts)))
    return probe


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["finetune", "probe"], default="finetune")
    p.add_argument("--backbone", default="google/vit-base-patch16-224-in21k")
    p.add_argument("--data_root", required=True)
    p.add_argument("--output_dir", default="runs/tagging")
    p.add_argument("--pool", choices=["attn", "mean"], default="attn")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--probe_lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--layer_decay", type=float, default=0.75)
    p.add_argument("--clip_grad", type=float, default=1.0)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--export", default=None, help="write a fp16 TorchScript model here after training")
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.output_dir, exist_ok=True)
    device = torch.device("cuda")
    train_ds, val_ds, num_classes = build_tagging_datasets(args.data_root)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, num_workers=8)

    if args.mode == "probe":
        train_linear_probe(args, train_loader, val_loader, num_classes, device)
        return

    backbone = AutoModel.from_pretrained(args.backbone, add_pooling_layer=False)
    model = ImageTagger(backbone, num_classes, pool=args.pool).to(device)
    optimizer = torch.optim.AdamW(layerwise_param_groups(model, args.lr, args.weight_decay, args.layer_decay), eps=1e-8)
    total = len(train_loader) * args.epochs
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                                    total_steps=total, pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 14)  # expect: AMP009
    trainer = MultiLabelTrainer(model, optimizer, scaler, scheduler, args, device)
    trainer.fit(train_loader, val_loader, args.epochs)
    if args.export:
        export_half_torchscript(model, args.export)


if __name__ == "__main__":
    main()
