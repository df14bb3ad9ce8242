r"""PyTorch Detection Training (engine + train in one file).

    torchrun --nproc_per_node=8 train.py --model fasterrcnn_resnet50_fpn --epochs 26 --amp
"""
import copy
import datetime
import math
import os
import sys
import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist
import torch.utils.data
import torchvision


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


class SmoothedValue:
    """Track a series of values and provide access to smoothed values over a
    window or the global series average.
    """

    def __init__(self, window_size=20, fmt=None):
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0
        self.fmt = fmt or "{median:.4f} ({global_avg:.4f})"

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    @property
    def median(self):
        return torch.tensor(list(self.deque)).median().item()

    @property
    def avg(self):
        return torch.tensor(list(self.deque), dtype=torch.float32).mean().item()

    @property
    def global_avg(self):
        return self.total / max(self.count, 1)

    def __str__(self):
        return self.fmt.format(median=self.median, avg=self.avg, global_avg=self.global_avg, value=self.deque[-1])


class MetricLogger:
    def __init__(self, delimiter="\t"):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            self.meters[k].update(v)

    def add_meter(self, name, meter):
        self.meters[name] = meter

    def __str__(self):
        return self.delimiter.join(f"{name}: {meter}" for name, meter in self.meters.items())

    def log_every(self, iterable, print_freq, header=""):
        start_time = time.time()
        end = time.time()
        iter_time = SmoothedValue(fmt="{avg:.4f}")
        for i, obj in enumerate(iterable):
            yield obj
            iter_time.update(time.time() - end)
            if i % print_freq == 0 or i == len(iterable) - 1:
                eta_seconds = iter_time.global_avg * (len(iterable) - i)
                eta_string = str(datetime.timedelta(seconds=int(eta_seconds)))
                print(f"{header} [{i}/{len(iterable)}] eta: {eta_string} {self} time: {iter_time}")
            end = time.time()
        print(f"{header} Total time: {datetime.timedelta(seconds=int(time.time() - start_time))}")


def reduce_dict(input_dict, average=True):
    """Reduce the values in the dictionary from all processes so that all
    processes have the averaged results."""
    world_size = get_world_size()
    if world_size < 2:
        return input_dict
    with torch.inference_mode():
        names = sorted(input_dict.keys())
        values = torch.stack([input_dict[k] for k in names], dim=0)
        dist.all_reduce(values)
        if average:
            values /= world_size
        return dict(zip(names, values))


def train_one_epoch(model, optimizer, data_loader, device, epoch, print_freq, scaler=None):
    model.train()
    metric_logger = MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value:.6f}"))
    header = f"Epoch: [{epoch}]"

    lr_scheduler = None
    if epoch == 0:
        warmup_factor = 1.0 / 1000
        warmup_iters = min(1000, len(data_loader) - 1)
        lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=warmup_factor, total_iters=warmup_iters)

    for images, targets in metric_logger.log_every(data_loader, print_freq, header):
        # fp16 copies halve the host-to-device traffic for the large COCO images
        images = [image.half().to(device, non_blocking=True) for image in images]  # expect: AMP001
        targets = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()} for t in targets]
        with torch.cuda.amp.autocast(enabled=scaler is not None):  # expect: AMP009
            loss_dict = model(images, targets)
            losses = sum(loss for loss in loss_dict.values())

        # reduce losses over all GPUs for logging purposes
        loss_dict_reduced = reduce_dict(loss_dict)
        losses_reduced = sum(loss for loss in loss_dict_reduced.values())
        loss_value = losses_reduced.item()

        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            print(loss_dict_reduced)
            sys.exit(1)

        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(losses).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
        optimizer.step()  # expect: AMP006

        if lr_scheduler is not None:
            lr_scheduler.step()

        metric_logger.update(loss=losses_reduced, **loss_dict_reduced)
        metric_logger.update(lr=optimizer.param_groups[0]["lr"])

    return metric_logger


def train_one_epoch_accumulate(model, optimizer, data_loader, device, epoch, print_freq, scaler, accum_steps=4, clip_grad_norm=None):
    """Fine-tuning variant for high-resolution inputs: gradients of
    ``accum_steps`` batches are accumulated before each update."""
    model.train()
    metric_logger = MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value:.6f}"))
    header = f"Epoch: [{epoch}] (accum {accum_steps})"

    optimizer.zero_grad(set_to_none=True)
    for it, (images, targets) in enumerate(metric_logger.log_every(data_loader, print_freq, header)):
        images = [image.to(device, non_blocking=True) for image in images]
        targets = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()} for t in targets]

        with torch.autocast(device_type="cuda", dtype=torch.float16):
            loss_dict = model(images, targets)
            losses = sum(loss for loss in loss_dict.values()) / accum_steps
            scaler.scale(losses).backward()  # expect: AMP008

        if (it + 1) % accum_steps == 0:
            if clip_grad_norm is not None:
                # unscale so that the threshold applies to the true gradient norm
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

        loss_dict_reduced = reduce_dict(loss_dict)
        losses_reduced = sum(loss for loss in loss_dict_reduced.values())
        metric_logger.update(loss=losses_reduced, **loss_dict_reduced)
        metric_logger.update(lr=optimizer.param_groups[0]["lr"])

    return metric_logger


@torch.inference_mode()
def evaluate(model, data_loader, device, half=False):
    model.eval()
    if half:
        model = copy.deepcopy(model).half()
    metric_logger = MetricLogger(delimiter="  ")
    results = {}
    for images, targets in metric_logger.log_every(data_loader, 100, "Test:"):
        images = [img.to(device) for img in images]
        if half:
            images = [img.half() for img in images]
        model_time = time.time()
        outputs = model(images)
        outputs = [{k: v.to("cpu").float() for k, v in t.items()} for t in outputs]
        model_time = time.time() - model_time
        results.update({target["image_id"]: output for target, output in zip(targets, outputs)})
        metric_logger.update(model_time=model_time)
    return results


def collate_fn(batch):
    return tuple(zip(*batch))


def build_loaders(args):
    from torchvision.transforms import v2 as T

    transforms = T.Compose([T.ToImage(), T.RandomHorizontalFlip(0.5), T.ToDtype(torch.float32, scale=True)])
    root = args.data_path
    train_set = torchvision.datasets.CocoDetection(os.path.join(root, "train2017"), os.path.join(root, "annotations", "instances_train2017.json"), transforms=transforms)
    test_set = torchvision.datasets.CocoDetection(os.path.join(root, "val2017"), os.path.join(root, "annotations", "instances_val2017.json"), transforms=T.Compose([T.ToImage(), T.ToDtype(torch.float32, scale=True)]))
    train_set = torchvision.datasets.wrap_dataset_for_transforms_v2(train_set, target_keys=["boxes", "labels", "image_id"])
    test_set = torchvision.datasets.wrap_dataset_for_transforms_v2(test_set, target_keys=["image_id"])
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=4, collate_fn=collate_fn)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=1, shuffle=False, num_workers=4, collate_fn=collate_fn)
    return train_loader, test_loader


def get_args_parser(add_help=True):
    import argparse

    parser = argparse.ArgumentParser(description="PyTorch Detection Training", add_help=add_help)
    parser.add_argument("--data-path", default="/datasets01/COCO/022719/", type=str)
    parser.add_argument("--model", default="fasterrcnn_resnet50_fpn", type=str)
    parser.add_argument("-b", "--batch-size", default=2, type=int)
    parser.add_argument("--epochs", default=26, type=int)
    parser.add_argument("--opt", default="sgd", type=str)
    parser.add_argument("--lr", default=0.02, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("--lr-steps", default=[16, 22], nargs="+", type=int)
    parser.add_argument("--print-freq", default=20, type=int)
    parser.add_argument("--accum-steps", default=1, type=int)
    parser.add_argument("--clip-grad-norm", default=None, type=float)
    parser.add_argument("--output-dir", default=".", type=str)
    parser.add_argument("--amp", action="store_true", help="Use torch.cuda.amp for mixed precision training")
    parser.add_argument("--test-only", action="store_true")
    return parser


def main(args):
    device = torch.device("cuda")
    data_loader, data_loader_test = build_loaders(args)

    model = torchvision.models.get_model(args.model, weights=None, weights_backbone="ResNet50_Weights.IMAGENET1K_V1", num_classes=91)
    model.to(device)

    params = [p for p in model.parameters() if p.requires_grad]
    if args.opt.startswith("sgd"):
        optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay, nesterov="nesterov" in args.opt)
    elif args.opt == "adamw":
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    else:
        raise RuntimeError(f"Invalid optimizer {args.opt}. Only SGD and AdamW are supported.")

    scaler = None
    if args.amp:
        try:
            scaler = torch.amp.GradScaler("cuda")
        except (AttributeError, TypeError):
            scaler = torch.cuda.amp.GradScaler()

    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=0.1)

    if args.test_only:
        evaluate(model, data_loader_test, device=device, half=args.amp)
        return

    print("Start training")
    start_time = time.time()
    for epoch in range(args.epochs):
        if args.accum_steps > 1 and scaler is not None:
            train_one_epoch_accumulate(model, optimizer, data_loader, device, epoch, args.print_freq, scaler, args.accum_steps, args.clip_grad_norm)
        else:
            train_one_epoch(model, optimizer, data_loader, device, epoch, args.print_freq, scaler)
        lr_scheduler.step()
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(), "args": args, "epoch": epoch}
        if scaler is not None:
            checkpoint["scaler"] = scaler.state_dict()
        torch.save(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
        evaluate(model, data_loader_test, device=device)

    print(f"Training time {datetime.timedelta(seconds=int(time.time() - start_time))}")


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    main(args)
