"""Image classification training in the style of torchvision's references/classification/train.py."""
import argparse
import copy
import datetime
import os
import time

import torch
import torch.nn.functional as F
import torch.utils.data
import torchvision
from torch import nn
from torchvision.transforms import v2 as T


def get_args_parser(add_help=True):
    parser = argparse.ArgumentParser(description="PyTorch Classification Training", add_help=add_help)
    parser.add_argument("--data-path", default="/datasets01/imagenet_full_size/061417/", type=str)
    parser.add_argument("--model", default="resnet18", type=str)
    parser.add_argument("--device", default="cuda", type=str)
    parser.add_argument("-b", "--batch-size", default=32, type=int)
    parser.add_argument("--epochs", default=90, type=int)
    parser.add_argument("-j", "--workers", default=16, type=int)
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("--label-smoothing", default=0.0, type=float)
    parser.add_argument("--clip-grad-norm", default=None, type=float)
    parser.add_argument("--print-freq", default=10, type=int)
    parser.add_argument("--output-dir", default=".", type=str)
    parser.add_argument("--amp", action="store_true", help="Use torch.cuda.amp for mixed precision training")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--model-ema", action="store_true")
    parser.add_argument("--probe-epochs", default=0, type=int)
    parser.add_argument("--logit-penalty", default=0.0, type=float)
    return parser


def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema=None, scaler=None):
    model.train()
    start_time = time.time()
    for i, (image, target) in enumerate(data_loader):
        image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
        if args.channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", enabled=scaler is not None):
            output = model(image)
        loss = criterion(output, target)  # expect: AMP002

        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            if args.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if args.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()  # expect: AMP006

        if model_ema is not None and i % 32 == 0:
            model_ema.update_parameters(model)

        if i % args.print_freq == 0:
            acc1 = (output.argmax(dim=1) == target).float().mean().item() * 100.0
            elapsed = str(datetime.timedelta(seconds=int(time.time() - start_time)))
            print(f"Epoch: [{epoch}] [{i}/{len(data_loader)}] loss {loss.item():.4f} acc1 {acc1:.2f} "
                  f"lr {optimizer.param_groups[0]['lr']:.5f} elapsed {elapsed}")


def evaluate(model, criterion, data_loader, device, log_suffix=""):
    model.eval()
    total, correct, loss_sum = 0, 0, 0.0
    with torch.inference_mode():
        for image, target in data_loader:
            image = image.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                output = model(image)
                loss = criterion(output, target)
            loss_sum += loss.item() * image.shape[0]
            correct += (output.argmax(1) == target).sum().item()
            total += image.shape[0]
    acc = 100.0 * correct / max(total, 1)
    print(f"Test {log_suffix}: Acc@1 {acc:.3f} loss {loss_sum / max(total, 1):.4f}")
    return acc


def train_linear_probe(backbone, num_classes, data_loader, device, args):
    """Fit a linear classifier on frozen features, a quick sanity check of a checkpoint."""
    backbone.eval()
    backbone.requires_grad_(False)
    feat_dim = backbone.fc.in_features
    backbone.fc = nn.Identity()
    head = nn.Linear(feat_dim, num_classes).to(device).half()  # expect: AMP001
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.probe_epochs):
        for image, target in data_loader:
            image, target = image.to(device), target.to(device)
            with torch.no_grad():
                feats = backbone(image)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                logits = head(feats)
                loss = F.cross_entropy(logits, target) + args.logit_penalty * logits.var(dim=1).mean()  # expect: AMP004
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        print(f"probe epoch {epoch}: loss {loss.item():.4f}")
    return head


def export_fp16_checkpoint(model_without_ddp, path):
    """Write a compact half-precision copy of the weights for the serving team."""
    model_fp16 = copy.deepcopy(model_without_ddp).half().eval()
    torch.save({"model": model_fp16.state_dict()}, path)


def load_data(traindir, valdir):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(),
                          T.ToImage(), T.ToDtype(torch.float32, scale=True), normalize])
    val_tf = T.Compose([T.Resize(256, antialias=True), T.CenterCrop(224),
                        T.ToImage(), T.ToDtype(torch.float32, scale=True), normalize])
    dataset = torchvision.datasets.ImageFolder(traindir, train_tf)
    dataset_test = torchvision.datasets.ImageFolder(valdir, val_tf)
    return dataset, dataset_test


def main(args):
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True

    dataset, dataset_test = load_data(os.path.join(args.data_path, "train"), os.path.join(args.data_path, "val"))
    data_loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                              num_workers=args.workers, pin_memory=True, drop_last=True)
    data_loader_test = torch.utils.data.DataLoader(dataset_test, batch_size=args.batch_size,
                                                   num_workers=args.workers, pin_memory=True)

    model = torchvision.models.get_model(args.model, weights=None, num_classes=len(dataset.classes))
    model.to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None  # expect: AMP009
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    model_ema = None
    if args.model_ema:
        model_ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9998))

    best_acc = 0.0
    start_time = time.time()
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema, scaler)
        lr_scheduler.step()
        acc = evaluate(model, criterion, data_loader_test, device)
        if model_ema is not None:
            evaluate(model_ema, criterion, data_loader_test, device, log_suffix="EMA")
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "epoch": epoch,
            "args": args,
        }
        if scaler:
            checkpoint["scaler"] = scaler.state_dict()
        torch.save(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))
        if acc > best_acc:
            best_acc = acc
            export_fp16_checkpoint(model, os.path.join(args.output_dir, "model_best_fp16.pth"))

    total_time = str(datetime.timedelta(seconds=int(time.time() - start_time)))
    print(f"Training time {total_time}, best acc {best_acc:.2f}")
    if args.probe_epochs > 0:
        train_linear_probe(copy.deepcopy(model), len(dataset.classes), data_loader, device, args)


if __name__ == "__main__":
    main(get_args_parser().parse_args())
