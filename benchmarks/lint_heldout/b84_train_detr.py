"""Training entry point for Deformable-DETR on COCO (model, matcher and criterion live in models/)."""
import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
from torch.utils.data import DataLoader

import util.misc as utils
from datasets import build_dataset, get_coco_api_from_dataset
from datasets.coco_eval import CocoEvaluator
from models import build_model


def train_one_epoch(model, criterion, data_loader, optimizer, scaler, device, epoch, max_norm=0.1):
    model.train()
    criterion.train()
    weight_dict = criterion.weight_dict
    t0 = time.time()
    for it, (samples, targets) in enumerate(data_loader):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(samples)
            loss_dict = criterion(outputs, targets)
            losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict.keys() if k in weight_dict)
        loss_value = losses.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            print({k: v.item() for k, v in loss_dict.items()})
            sys.exit(1)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(losses).backward()
        if max_norm > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        if it % 50 == 0:
            logits_mean = outputs["pred_logits"].mean().item()
            print(f"epoch {epoch} [{it}/{len(data_loader)}] loss {loss_value:.4f} "
                  f"logits_mean {logits_mean:.3f} lr {optimizer.param_groups[0]['lr']:.2e} "
                  f"{time.time() - t0:.1f}s")
    return {"loss": loss_value}


@torch.no_grad()
def evaluate(model, criterion, postprocessors, data_loader, base_ds, device):
    model.eval()
    criterion.eval()
    coco_evaluator = CocoEvaluator(base_ds, ("bbox",))
    for samples, targets in data_loader:
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
            outputs = model(samples)
        orig_target_sizes = torch.stack([t["orig_size"] for t in targets], dim=0)
        results = postprocessors["bbox"](outputs, orig_target_sizes)
        coco_evaluator.update({t["image_id"].item(): r for t, r in zip(targets, results)})
    coco_evaluator.synchronize_between_processes()
    coco_evaluator.accumulate()
    coco_evaluator.summarize()
    return coco_evaluator.coco_eval["bbox"].stats.tolist()


def benchmark_step(model, criterion, data_loader, optimizer, device, iters=30):
    """Measures steady-state training throughput (imgs/s) for the README table."""
    model.train()
    samples, targets = next(iter(data_loader))
    samples = samples.to(device)
    targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
    weight_dict = criterion.weight_dict
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_dict = criterion(model(samples), targets)
            losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict.keys() if k in weight_dict)
            losses.backward()  # expect: AMP008
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return iters * samples.tensors.shape[0] / (time.perf_counter() - start)


def get_args_parser():
    parser = argparse.ArgumentParser("Deformable DETR", add_help=False)
    parser.add_argument("--lr", default=2e-4, type=float)
    parser.add_argument("--lr_backbone", default=2e-5, type=float)
    parser.add_argument("--batch_size", default=2, type=int)
    parser.add_argument("--weight_decay", default=1e-4, type=float)
    parser.add_argument("--epochs", default=50, type=int)
    parser.add_argument("--lr_drop", default=40, type=int)
    parser.add_argument("--clip_max_norm", default=0.1, type=float)
    parser.add_argument("--coco_path", default="./data/coco", type=str)
    parser.add_argument("--output_dir", default="outputs/deformable_detr")
    parser.add_argument("--benchmark", action="store_true")
    parser.add_argument("--num_workers", default=2, type=int)
    return parser


def main(args):
    device = torch.device("cuda")
    model, criterion, postprocessors = build_model(args)
    model.to(device)
    param_dicts = [
        {"params": [p for n, p in model.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    dataset_train, dataset_val = build_dataset("train", args), build_dataset("val", args)
    loader_train = DataLoader(dataset_train, batch_size=args.batch_size, shuffle=True,
                              collate_fn=utils.collate_fn, num_workers=args.num_workers, drop_last=True)
    loader_val = DataLoader(dataset_val, batch_size=args.batch_size, shuffle=False,
                            collate_fn=utils.collate_fn, num_workers=args.num_workers)
    if args.benchmark:
        print(f"{benchmark_step(model, criterion, loader_train, optimizer, device):.1f} img/s")
        return

    base_ds = get_coco_api_from_dataset(dataset_val)
    os.makedirs(args.output_dir, exist_ok=True)
    start_time = time.time()
    for epoch in range(args.epochs):
        stats = train_one_epoch(model, criterion, loader_train, optimizer, scaler, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        utils.save_on_master({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                              "lr_scheduler": lr_scheduler.state_dict(), "scaler": scaler.state_dict(),
                              "epoch": epoch, "args": args}, os.path.join(args.output_dir, "checkpoint.pth"))
        coco_stats = evaluate(model, criterion, postprocessors, loader_val, base_ds, device)
        with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
            f.write(json.dumps({"epoch": epoch, **stats, "coco_bbox": coco_stats}) + "\n")
    print("Training time", str(datetime.timedelta(seconds=int(time.time() - start_time))))


if __name__ == "__main__":
    parser = argparse.ArgumentParser("Deformable DETR training", parents=[get_args_parser()])
    main(parser.parse_args())
