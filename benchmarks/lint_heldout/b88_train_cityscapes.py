"""DeepLabV3 on Cityscapes at full 2048x1024 resolution, with per-batch ENet class weighting."""
import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision.models.segmentation import deeplabv3_resnet50

from seg_data import CityscapesFine, TrainTransform, ValTransform  # local module

IGNORE_INDEX = 255


def batch_class_weights(masks, num_classes, c=1.02, stride=4):
    # ENet weighting, 1 / ln(c + p_class), estimated on a subsampled label map
    m = masks[:, ::stride, ::stride]
    valid = (m != IGNORE_INDEX).unsqueeze(1)
    onehot = torch.zeros(m.shape[0], num_classes, *m.shape[1:], device=m.device, dtype=torch.float16)
    onehot.scatter_(1, m.clamp(max=num_classes - 1).unsqueeze(1), 1.0)
    onehot.mul_(valid)
    freq = onehot.mean(dim=(0, 2, 3))  # expect: AMP004
    return 1.0 / torch.log(c + freq)


def poly_lr(optimizer, base_lr, it, max_it, power=0.9):
    lr = base_lr * (1 - it / max_it) ** power
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
    return lr


class ConfusionMatrix:
    def __init__(self, n):
        self.n = n
        self.mat = None

    def update(self, target, pred):
        k = (target >= 0) & (target < self.n)
        inds = self.n * target[k].to(torch.int64) + pred[k]
        counts = torch.bincount(inds, minlength=self.n ** 2).reshape(self.n, self.n)
        self.mat = counts if self.mat is None else self.mat + counts

    def miou(self):
        h = self.mat.double()
        iou = torch.diag(h) / (h.sum(1) + h.sum(0) - torch.diag(h))
        return iou.nanmean().item()


@torch.no_grad()
def evaluate(model, loader, device, num_classes):
    model.eval()
    cm = ConfusionMatrix(num_classes)
    for images, masks in loader:
        images, masks = images.to(device), masks.to(device)
        out = model(images)["out"]
        cm.update(masks.flatten(), out.argmax(1).flatten())
    model.train()
    return cm.miou()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/datasets/cityscapes")
    p.add_argument("--num-classes", type=int, default=19)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accum-steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--aux-weight", type=float, default=0.4)
    p.add_argument("--iters", type=int, default=90000)
    p.add_argument("--eval-every", type=int, default=4000)
    p.add_argument("--output", default="work_dirs/deeplabv3_cs")
    args = p.parse_args()

    device = torch.device("cuda")
    train_ds = CityscapesFine(args.data_root, "train", TrainTransform(crop=(1024, 2048)))
    val_ds = CityscapesFine(args.data_root, "val", ValTransform())
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=4)

    model = deeplabv3_resnet50(weights=None, weights_backbone="IMAGENET1K_V2",
                               num_classes=args.num_classes, aux_loss=True).to(device)
    params = [
        {"params": model.backbone.parameters(), "lr_mult": 1.0},
        {"params": list(model.classifier.parameters()) + list(model.aux_classifier.parameters()), "lr_mult": 10.0},
    ]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    os.makedirs(args.output, exist_ok=True)

    it, best = 0, 0.0
    running, t0 = [], time.time()
    model.train()
    while it < args.iters:
        for step, (images, masks) in enumerate(train_loader):
            images = images.to(device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
            masks = masks.to(device, non_blocking=True)
            class_w = batch_class_weights(masks, args.num_classes)

            with torch.autocast(device_type="cuda", dtype=torch.float16):
                out = model(images)
                logits = F.interpolate(out["out"], size=masks.shape[-2:], mode="bilinear", align_corners=False)
                aux = F.interpolate(out["aux"], size=masks.shape[-2:], mode="bilinear", align_corners=False)
            loss = F.cross_entropy(logits, masks, weight=class_w, ignore_index=IGNORE_INDEX) + args.aux_weight * F.cross_entropy(aux, masks, ignore_index=IGNORE_INDEX)  # expect: AMP002
            running.append(loss.item())

            loss = scaler.scale(loss / args.accum_steps)
            loss.backward()
            if (step + 1) % args.accum_steps != 0:
                continue

            lr = poly_lr(optimizer, args.lr, it, args.iters)
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
            it += 1

            if it % 50 == 0:
                print(f"it {it}/{args.iters} lr {lr:.5f} loss {np.mean(running):.4f} "
                      f"{(time.time() - t0) / 50:.2f}s/it")
                running, t0 = [], time.time()
            if it % args.eval_every == 0 or it == args.iters:
                miou = evaluate(model, val_loader, device, args.num_classes)
                print(f"it {it}: mIoU {miou:.4f}")
                if miou > best:
                    best = miou
                    torch.save(model.state_dict(), os.path.join(args.output, "best.pth"))
            if it >= args.iters:
                break


if __name__ == "__main__":
    main()
