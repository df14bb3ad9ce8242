"""Fine-tune a COCO-pretrained Faster R-CNN (ResNet-50 FPN v2) on a COCO-format dataset.

    python finetune_detector.py --data-root /data/pcb/images --train-ann /data/pcb/train.json \
        --val-ann /data/pcb/val.json --num-classes 7 --amp --clip-grad 10
"""
import argparse
import math
import os
import sys
import time

import torch
import torchvision.transforms.v2 as T
from torch.utils.data import DataLoader
from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
from torchvision.models.detection import FasterRCNN_ResNet50_FPN_V2_Weights, fasterrcnn_resnet50_fpn_v2
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.ops import box_iou


def build_dataset(root, ann_file, train):
    tfs = [T.ToImage()]
    if train:
        tfs += [T.RandomHorizontalFlip(0.5), T.RandomPhotometricDistort(p=0.5)]
    tfs += [T.ToDtype(torch.float32, scale=True), T.SanitizeBoundingBoxes()]
    ds = CocoDetection(root, ann_file, transforms=T.Compose(tfs))
    return wrap_dataset_for_transforms_v2(ds, target_keys=("boxes", "labels"))


def collate_fn(batch):
    return tuple(zip(*batch))


def get_model(num_classes, trainable_layers):
    weights = FasterRCNN_ResNet50_FPN_V2_Weights.COCO_V1
    model = fasterrcnn_resnet50_fpn_v2(weights=weights, trainable_backbone_layers=trainable_layers)
    in_features = model.roi_heads.box_predictor.cls_score.in_features
    model.roi_heads.box_predictor = FastRCNNPredictor(in_features, num_classes)
    return model


def warmup_heads(model, loader, device, iters, lr):
    """Train RPN and ROI heads with the backbone held fixed so the new predictor does not disturb the FPN."""
    params = [p for n, p in model.named_parameters() if not n.startswith("backbone.") and p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    model.train()
    done = 0
    while done < iters:
        for images, targets in loader:
            images = [img.to(device, non_blocking=True).half() for img in images]  # expect: AMP001
            targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                loss_dict = model(images, targets)
                loss = sum(loss_dict.values())
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
            if done % 50 == 0:
                print(f"head warm-up {done}/{iters}: " + ", ".join(f"{k} {v.item():.3f}" for k, v in loss_dict.items()))
            if done >= iters:
                break


def train_one_epoch(model, optimizer, loader, device, epoch, scaler=None, clip_grad=0.0, print_freq=50):
    model.train()
    warmup = None
    if epoch == 0:
        warmup_iters = min(1000, len(loader) - 1)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / 1000, total_iters=warmup_iters)
    t0 = time.time()
    for i, (images, targets) in enumerate(loader):
        images = [img.to(device, non_blocking=True) for img in images]
        targets = [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets]
        with torch.cuda.amp.autocast(enabled=scaler is not None):  # expect: AMP009
            loss_dict = model(images, targets)
            losses = sum(loss for loss in loss_dict.values())

        loss_value = losses.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training: {loss_dict}")
            sys.exit(1)

        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(losses).backward()
            if clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
            if clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
            optimizer.step()
        if warmup is not None:
            warmup.step()
        if i % print_freq == 0:
            print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss_value:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.5f} ({time.time() - t0:.1f}s)")


@torch.inference_mode()
def evaluate_recall(model, loader, device, iou_thresh=0.5, score_thresh=0.05):
    model.eval()
    hits, total = 0, 0
    for images, targets in loader:
        images = [img.to(device, non_blocking=True) for img in images]
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            outputs = model(images)
        for out, tgt in zip(outputs, targets):
            gt = tgt["boxes"].to(device)
            total += gt.size(0)
            keep = out["scores"] > score_thresh
            if gt.numel() == 0 or not keep.any():
                continue
            iou = box_iou(gt.float(), out["boxes"][keep].float())
            hits += int(torch.count_nonzero(iou.max(dim=1).values >= iou_thresh))
    model.train()
    return hits / max(total, 1)


def main():
    parser = argparse.ArgumentParser(description="Faster R-CNN fine-tuning")
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--train-ann", required=True)
    parser.add_argument("--val-ann", required=True)
    parser.add_argument("--num-classes", type=int, required=True, help="including background")
    parser.add_argument("--epochs", type=int, default=26)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--lr-steps", nargs="+", type=int, default=[16, 22])
    parser.add_argument("--trainable-layers", type=int, default=3)
    parser.add_argument("--head-warmup-iters", type=int, default=500)
    parser.add_argument("--clip-grad", type=float, default=0.0)
    parser.add_argument("--amp", action="store_true", help="mixed precision training")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--output-dir", default="runs/detector")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    device = torch.device("cuda")

    train_ds = build_dataset(args.data_root, args.train_ann, train=True)
    val_ds = build_dataset(args.data_root, args.val_ann, train=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, collate_fn=collate_fn)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=args.workers, collate_fn=collate_fn)

    model = get_model(args.num_classes, args.trainable_layers).to(device)
    if args.head_warmup_iters > 0 and not args.resume:
        warmup_heads(model, train_loader, device, args.head_warmup_iters, lr=args.lr * 0.1)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.wd)
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=0.1)
    scaler = torch.amp.GradScaler("cuda") if args.amp else None

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        train_one_epoch(model, optimizer, train_loader, device, epoch, scaler, args.clip_grad)
        lr_scheduler.step()
        recall = evaluate_recall(model, val_loader, device)
        print(f"epoch {epoch}: recall@0.5 {recall:.4f}")
        torch.save({
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epoch": epoch,
            "args": vars(args),
        }, os.path.join(args.output_dir, f"model_{epoch}.pt"))


if __name__ == "__main__":
    main()
