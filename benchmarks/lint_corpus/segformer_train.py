"""Semantic segmentation training with a transformer encoder, poly LR and mixed precision."""
import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def poly_lr(base_lr, it, max_it, power=0.9):
    return base_lr * (1 - it / max_it) ** power


def intersect_and_union(pred, label, num_classes, ignore_index=255):
    mask = label != ignore_index
    pred, label = pred[mask], label[mask]
    intersect = pred[pred == label]
    area_intersect = torch.histc(intersect.float(), bins=num_classes, min=0, max=num_classes - 1)
    area_pred = torch.histc(pred.float(), bins=num_classes, min=0, max=num_classes - 1)
    area_label = torch.histc(label.float(), bins=num_classes, min=0, max=num_classes - 1)
    return area_intersect, area_pred + area_label - area_intersect


class OhemCrossEntropy(nn.Module):
    def __init__(self, ignore_index=255, thresh=0.7, min_kept=100000):
        super().__init__()
        self.thresh = -torch.log(torch.tensor(thresh, dtype=torch.float))
        self.min_kept = min_kept
        self.ignore_index = ignore_index

    def forward(self, logits, labels):
        loss = F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="none").view(-1)
        loss, _ = torch.sort(loss, descending=True)
        if loss[self.min_kept] > self.thresh:
            loss = loss[loss > self.thresh]
        else:
            loss = loss[: self.min_kept]
        return loss.mean()


def dice_score(logits, labels, num_classes):
    probs = logits.softmax(dim=1)
    one_hot = F.one_hot(labels.clamp(max=num_classes - 1), num_classes).permute(0, 3, 1, 2)
    inter = (probs * one_hot).sum()
    return 2 * inter / (probs.sum() + one_hot.sum())


def train(args, model, loader, val_loader):
    device = torch.device("cuda")
    model = model.to(device).to(memory_format=torch.channels_last)
    criterion = OhemCrossEntropy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    max_it = args.epochs * len(loader)
    it = 0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        for images, labels in loader:
            images = images.to(device, non_blocking=True).to(memory_format=torch.channels_last)
            labels = labels.to(device, non_blocking=True).long()
            for g in optimizer.param_groups:
                g["lr"] = poly_lr(args.lr, it, max_it)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits = model(images)
                logits = F.interpolate(logits, size=labels.shape[-2:], mode="bilinear", align_corners=False)
            loss = criterion(logits, labels)
            train_dice = dice_score(logits.detach().float(), labels, args.num_classes)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            it += 1
            if it % 50 == 0:
                print(f"it {it} loss {loss.item():.3f} dice {train_dice.item():.3f} {time.time() - tic:.1f}s")
        miou = validate(model, val_loader, args.num_classes, device, args.amp)
        print(f"epoch {epoch} mIoU {miou:.4f}")


@torch.no_grad()
def validate(model, loader, num_classes, device, amp):
    model.eval()
    total_inter = torch.zeros(num_classes, device=device)
    total_union = torch.zeros(num_classes, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            logits = model(images)
        pred = F.interpolate(logits.float(), size=labels.shape[-2:], mode="bilinear").argmax(1)
        inter, union = intersect_and_union(pred, labels, num_classes)
        total_inter += inter
        total_union += union
    return (total_inter / total_union.clamp(min=1)).mean().item()


def aux_head_step(model, images, labels, optimizer, scaler, aux_weight=0.4):
    with torch.autocast("cuda", dtype=torch.float16):
        main_out, aux_out = model(images)
    main_out = F.interpolate(main_out, size=labels.shape[-2:], mode="bilinear")
    aux_out = F.interpolate(aux_out, size=labels.shape[-2:], mode="bilinear")
    loss = F.cross_entropy(main_out, labels, ignore_index=255)  # expect: AMP002
    loss = loss + aux_weight * F.cross_entropy(aux_out, labels, ignore_index=255)  # expect: AMP002
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return np.float32(loss.item())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=6e-5)
    parser.add_argument("--epochs", type=int, default=160)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--num-classes", type=int, default=150)
    parser.parse_args()
