"""Detection reference training (torchvision references style): warmup, AMP, metric logger."""
import math
import sys
import time

import torch
import torch.utils.data


class SmoothedValue:
    def __init__(self, window_size=20):
        self.values = []
        self.window_size = window_size

    def update(self, value):
        self.values = (self.values + [value])[-self.window_size:]

    @property
    def median(self):
        return sorted(self.values)[len(self.values) // 2] if self.values else 0.0


def reduce_dict(input_dict, average=True):
    with torch.no_grad():
        names = sorted(input_dict.keys())
        values = torch.stack([input_dict[k] for k in names])
        if average:
            values /= 1
        return {k: v for k, v in zip(names, values)}


def train_one_epoch(model, optimizer, data_loader, device, epoch, print_freq, scaler=None):
    model.train()
    lr_scheduler = None
    if epoch == 0:
        warmup_factor = 1.0 / 1000
        warmup_iters = min(1000, len(data_loader) - 1)
        lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=warmup_factor, total_iters=warmup_iters)
    loss_meter = SmoothedValue()
    for images, targets in data_loader:
        images = list(image.to(device) for image in images)
        targets = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", enabled=scaler is not None):
            loss_dict = model(images, targets)
            losses = sum(loss for loss in loss_dict.values())
        loss_dict_reduced = reduce_dict(loss_dict)
        losses_reduced = sum(loss for loss in loss_dict_reduced.values())
        loss_value = losses_reduced.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(losses).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
            optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        loss_meter.update(loss_value)
    return loss_meter


def train_one_epoch_clipped(model, optimizer, data_loader, device, scaler, clip_grad_norm=10.0):
    model.train()
    for images, targets in data_loader:
        images = [image.to(device) for image in images]
        with torch.autocast("cuda"):
            loss_dict = model(images, targets)
            losses = sum(loss_dict.values())
        optimizer.zero_grad()
        scaler.scale(losses).backward()
        if clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()


@torch.inference_mode()
def evaluate(model, data_loader, device):
    model.eval()
    start = time.time()
    results = []
    for images, _ in data_loader:
        images = [img.to(device) for img in images]
        with torch.autocast("cuda"):
            outputs = model(images)
        results.extend({k: v.float().cpu() for k, v in o.items()} for o in outputs)
    return results, time.time() - start


def main(args, model, dataset):
    device = torch.device("cuda")
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None  # expect: AMP009
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=lambda b: tuple(zip(*b)))
    for epoch in range(args.epochs):
        train_one_epoch(model, optimizer, loader, device, epoch, 20, scaler)
