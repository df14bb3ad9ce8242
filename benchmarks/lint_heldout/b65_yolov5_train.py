# YOLOv5 🚀 by Ultralytics, AGPL-3.0 license
"""
Train a YOLOv5 detection model (``train``) or classifier (``train_cls``) on a custom dataset.

Usage - Single-GPU training:
    $ python train.py --data coco128.yaml --weights yolov5s.pt --img 640
    $ python train.py --task classify --data imagenette160 --weights yolov5s-cls.pt --img 224
"""

import argparse
import math
import os
import random
import sys
import time
from copy import deepcopy
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import yaml
from torch.cuda import amp
from torch.optim import lr_scheduler
from tqdm import tqdm

FILE = Path(__file__).resolve()
ROOT = FILE.parents[0]  # YOLOv5 root directory
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
ROOT = Path(os.path.relpath(ROOT, Path.cwd()))

import val as validate  # for end-of-epoch mAP
from classify import val as validate_cls
from models.experimental import attempt_load
from models.yolo import ClassificationModel, Model
from utils.autoanchor import check_anchors
from utils.dataloaders import create_classification_dataloader, create_dataloader
from utils.general import (LOGGER, TQDM_BAR_FORMAT, check_dataset, check_img_size, colorstr, increment_path,
                           init_seeds, intersect_dicts, labels_to_class_weights, one_cycle, strip_optimizer)
from utils.loss import ComputeLoss
from utils.metrics import fitness
from utils.torch_utils import (EarlyStopping, ModelEMA, de_parallel, select_device, smart_DDP, smart_optimizer,
                               smartCrossEntropyLoss, torch_distributed_zero_first)

LOCAL_RANK = int(os.getenv("LOCAL_RANK", -1))
RANK = int(os.getenv("RANK", -1))
WORLD_SIZE = int(os.getenv("WORLD_SIZE", 1))


def train(hyp, opt, device):
    save_dir, epochs, batch_size, weights, single_cls, data, cfg, noval, nosave, workers, freeze = (
        Path(opt.save_dir), opt.epochs, opt.batch_size, opt.weights, opt.single_cls, opt.data, opt.cfg,
        opt.noval, opt.nosave, opt.workers, opt.freeze)
    w = save_dir / "weights"
    w.mkdir(parents=True, exist_ok=True)
    last, best = w / "last.pt", w / "best.pt"
    if isinstance(hyp, str):
        with open(hyp, errors="ignore") as f:
            hyp = yaml.safe_load(f)
    LOGGER.info(colorstr("hyperparameters: ") + ", ".join(f"{k}={v}" for k, v in hyp.items()))

    cuda = device.type != "cpu"
    init_seeds(opt.seed + 1 + RANK, deterministic=True)
    with torch_distributed_zero_first(LOCAL_RANK):
        data_dict = check_dataset(data)
    train_path, val_path = data_dict["train"], data_dict["val"]
    nc = 1 if single_cls else int(data_dict["nc"])
    names = {0: "item"} if single_cls and len(data_dict["names"]) != 1 else data_dict["names"]
    is_coco = isinstance(val_path, str) and val_path.endswith("coco/val2017.txt")

    # Model
    pretrained = weights.endswith(".pt")
    if pretrained:
        ckpt = torch.load(weights, map_location="cpu", weights_only=False)
        model = Model(cfg or ckpt["model"].yaml, ch=3, nc=nc, anchors=hyp.get("anchors")).to(device)
        exclude = ["anchor"] if (cfg or hyp.get("anchors")) and not opt.resume else []
        csd = ckpt["model"].float().state_dict()
        csd = intersect_dicts(csd, model.state_dict(), exclude=exclude)
        model.load_state_dict(csd, strict=False)
        LOGGER.info(f"Transferred {len(csd)}/{len(model.state_dict())} items from {weights}")
    else:
        model = Model(cfg, ch=3, nc=nc, anchors=hyp.get("anchors")).to(device)

    # Freeze
    freeze = [f"model.{x}." for x in (freeze if len(freeze) > 1 else range(freeze[0]))]
    for k, v in model.named_parameters():
        v.requires_grad = True
        if any(x in k for x in freeze):
            LOGGER.info(f"freezing {k}")
            v.requires_grad = False

    gs = max(int(model.stride.max()), 32)
    imgsz = check_img_size(opt.imgsz, gs, floor=gs * 2)

    # Optimizer
    nbs = 64  # nominal batch size
    accumulate = max(round(nbs / batch_size), 1)
    hyp["weight_decay"] *= batch_size * accumulate / nbs
    optimizer = smart_optimizer(model, opt.optimizer, hyp["lr0"], hyp["momentum"], hyp["weight_decay"])

    if opt.cos_lr:
        lf = one_cycle(1, hyp["lrf"], epochs)
    else:
        def lf(x):
            return (1 - x / epochs) * (1.0 - hyp["lrf"]) + hyp["lrf"]
    scheduler = lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)

    ema = ModelEMA(model) if RANK in {-1, 0} else None
    best_fitness, start_epoch = 0.0, 0

    if opt.sync_bn and cuda and RANK != -1:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
        LOGGER.info("Using SyncBatchNorm()")

    train_loader, dataset = create_dataloader(
        train_path, imgsz, batch_size // WORLD_SIZE, gs, single_cls, hyp=hyp, augment=True,
        cache=None if opt.cache == "val" else opt.cache, rect=opt.rect, rank=LOCAL_RANK, workers=workers,
        image_weights=opt.image_weights, quad=opt.quad, prefix=colorstr("train: "), shuffle=True, seed=opt.seed)
    labels = np.concatenate(dataset.labels, 0)
    mlc = int(labels[:, 0].max())
    assert mlc < nc, f"Label class {mlc} exceeds nc={nc} in {data}. Possible class labels are 0-{nc - 1}"

    if RANK in {-1, 0}:
        val_loader = create_dataloader(
            val_path, imgsz, batch_size // WORLD_SIZE * 2, gs, single_cls, hyp=hyp,
            cache=None if noval else opt.cache, rect=True, rank=-1, workers=workers * 2, pad=0.5,
            prefix=colorstr("val: "))[0]
        if not opt.noautoanchor:
            check_anchors(dataset, model=model, thr=hyp["anchor_t"], imgsz=imgsz)
        model.half().float()  # pre-reduce anchor precision

    if cuda and RANK != -1:
        model = smart_DDP(model)

    nl = de_parallel(model).model[-1].nl
    hyp["box"] *= 3 / nl
    hyp["cls"] *= nc / 80 * 3 / nl
    hyp["obj"] *= (imgsz / 640) ** 2 * 3 / nl
    model.nc = nc
    model.hyp = hyp
    model.class_weights = labels_to_class_weights(dataset.labels, nc).to(device) * nc
    model.names = names

    # Start training
    t0 = time.time()
    nb = len(train_loader)
    nw = max(round(hyp["warmup_epochs"] * nb), 100)
    last_opt_step = -1
    results = (0, 0, 0, 0, 0, 0, 0)
    scheduler.last_epoch = start_epoch - 1
    scaler = amp.GradScaler(enabled=cuda)  # expect: AMP009
    stopper, stop = EarlyStopping(patience=opt.patience), False
    compute_loss = ComputeLoss(model)
    for epoch in range(start_epoch, epochs):
        model.train()
        mloss = torch.zeros(3, device=device)
        if RANK != -1:
            train_loader.sampler.set_epoch(epoch)
        pbar = enumerate(train_loader)
        if RANK in {-1, 0}:
            pbar = tqdm(pbar, total=nb, bar_format=TQDM_BAR_FORMAT)
        optimizer.zero_grad()
        for i, (imgs, targets, paths, _) in pbar:
            ni = i + nb * epoch
            imgs = imgs.to(device, non_blocking=True).float() / 255

            # Warmup
            if ni <= nw:
                xi = [0, nw]
                accumulate = max(1, np.interp(ni, xi, [1, nbs / batch_size]).round())
                for j, x in enumerate(optimizer.param_groups):
                    x["lr"] = np.interp(ni, xi, [hyp["warmup_bias_lr"] if j == 0 else 0.0, x["initial_lr"] * lf(epoch)])
                    if "momentum" in x:
                        x["momentum"] = np.interp(ni, xi, [hyp["warmup_momentum"], hyp["momentum"]])

            # Multi-scale
            if opt.multi_scale:
                sz = random.randrange(int(imgsz * 0.5), int(imgsz * 1.5) + gs) // gs * gs
                sf = sz / max(imgs.shape[2:])
                if sf != 1:
                    ns = [math.ceil(x * sf / gs) * gs for x in imgs.shape[2:]]
                    imgs = nn.functional.interpolate(imgs, size=ns, mode="bilinear", align_corners=False)

            # Forward
            with amp.autocast(enabled=cuda):  # expect: AMP009
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets.to(device))
                if RANK != -1:
                    loss *= WORLD_SIZE  # gradient averaged between devices in DDP mode
                if opt.quad:
                    loss *= 4.0

            # Backward
            scaler.scale(loss).backward()

            # Optimize
            if ni - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                if ema:
                    ema.update(model)
                last_opt_step = ni

            if RANK in {-1, 0}:
                mloss = (mloss * i + loss_items) / (i + 1)
                mem = f"{torch.cuda.memory_reserved() / 1E9 if torch.cuda.is_available() else 0:.3g}G"
                pbar.set_description(("%11s" * 2 + "%11.4g" * 5) %
                                     (f"{epoch}/{epochs - 1}", mem, *mloss, targets.shape[0], imgs.shape[-1]))

        scheduler.step()

        if RANK in {-1, 0}:
            ema.update_attr(model, include=["yaml", "nc", "hyp", "names", "stride", "class_weights"])
            final_epoch = (epoch + 1 == epochs) or stopper.possible_stop
            if not noval or final_epoch:
                results, maps, _ = validate.run(data_dict, batch_size=batch_size // WORLD_SIZE * 2, imgsz=imgsz,
                                                half=cuda, model=ema.ema, single_cls=single_cls,
                                                dataloader=val_loader, save_dir=save_dir, plots=False,
                                                compute_loss=compute_loss)
            fi = fitness(np.array(results).reshape(1, -1))
            stop = stopper(epoch=epoch, fitness=fi)
            if fi > best_fitness:
                best_fitness = fi
            if (not nosave) or final_epoch:
                ckpt = {
                    "epoch": epoch,
                    "best_fitness": best_fitness,
                    "model": deepcopy(de_parallel(model)).half(),
                    "ema": deepcopy(ema.ema).half(),
                    "updates": ema.updates,
                    "optimizer": optimizer.state_dict(),
                    "opt": vars(opt),
                    "date": datetime.now().isoformat(),
                }
                torch.save(ckpt, last)
                if best_fitness == fi:
                    torch.save(ckpt, best)
                del ckpt
        if stop:
            break

    if RANK in {-1, 0}:
        LOGGER.info(f"\n{epoch - start_epoch + 1} epochs completed in {(time.time() - t0) / 3600:.3f} hours.")
        for f in last, best:
            if f.exists():
                strip_optimizer(f)
                if f is best:
                    LOGGER.info(f"\nValidating {f}...")
                    results, _, _ = validate.run(data_dict, batch_size=batch_size // WORLD_SIZE * 2, imgsz=imgsz,
                                                 model=attempt_load(f, device).half(),
                                                 iou_thres=0.65 if is_coco else 0.60, single_cls=single_cls,
                                                 dataloader=val_loader, save_dir=save_dir, save_json=is_coco,
                                                 verbose=True, plots=True, compute_loss=compute_loss)
    torch.cuda.empty_cache()
    return results


def train_cls(opt, device):
    init_seeds(opt.seed + 1 + RANK, deterministic=True)
    save_dir, data, bs, epochs, nw, imgsz = (Path(opt.save_dir), Path(opt.data), opt.batch_size, opt.epochs,
                                            min(os.cpu_count() - 1, opt.workers), opt.imgsz)
    cuda = device.type != "cpu"
    wdir = save_dir / "weights"
    wdir.mkdir(parents=True, exist_ok=True)
    last, best = wdir / "last.pt", wdir / "best.pt"

    trainloader = create_classification_dataloader(path=data / "train", imgsz=imgsz, batch_size=bs // WORLD_SIZE,
                                                   augment=True, cache=opt.cache, rank=LOCAL_RANK, workers=nw)
    testloader = create_classification_dataloader(path=data / "test", imgsz=imgsz, batch_size=bs // WORLD_SIZE * 2,
                                                  augment=False, cache=opt.cache, rank=-1, workers=nw)
    nc = len(trainloader.dataset.classes)
    model = ClassificationModel(model=attempt_load(opt.model, device="cpu", fuse=False), nc=nc, cutoff=opt.cutoff or 10)
    for p in model.parameters():
        p.requires_grad = True
    model = model.to(device)

    optimizer = smart_optimizer(model, opt.optimizer, opt.lr0, momentum=0.9, decay=opt.decay)
    lrf = 0.01
    scheduler = lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda x: (1 - x / epochs) * (1 - lrf) + lrf)
    ema = ModelEMA(model) if RANK in {-1, 0} else None
    if cuda and RANK != -1:
        model = smart_DDP(model)

    criterion = smartCrossEntropyLoss(label_smoothing=opt.label_smoothing)
    best_fitness = 0.0
    scaler = amp.GradScaler(enabled=cuda)  # expect: AMP009
    for epoch in range(epochs):
        tloss, fitness_ = 0.0, 0.0
        model.train()
        if RANK != -1:
            trainloader.sampler.set_epoch(epoch)
        pbar = enumerate(trainloader)
        if RANK in {-1, 0}:
            pbar = tqdm(enumerate(trainloader), total=len(trainloader), bar_format=TQDM_BAR_FORMAT)
        for i, (images, labels) in pbar:
            images, labels = images.to(device, non_blocking=True), labels.to(device)
            with amp.autocast(enabled=cuda):  # expect: AMP009
                loss = criterion(model(images), labels)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if ema:
                ema.update(model)

            if RANK in {-1, 0}:
                tloss = (tloss * i + loss.item()) / (i + 1)
                if i == len(pbar) - 1:
                    top1, top5, vloss = validate_cls.run(model=ema.ema, dataloader=testloader, criterion=criterion,
                                                         pbar=pbar)
                    fitness_ = top1
        scheduler.step()
        if RANK in {-1, 0}:
            if fitness_ > best_fitness:
                best_fitness = fitness_
            ckpt = {
                "epoch": epoch,
                "best_fitness": best_fitness,
                "model": deepcopy(ema.ema).half(),
                "ema": None,
                "optimizer": None,
                "date": datetime.now().isoformat(),
            }
            torch.save(ckpt, last)
            if best_fitness == fitness_:
                torch.save(ckpt, best)
            del ckpt


def parse_opt(known=False):
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="detect", choices=["detect", "classify"])
    parser.add_argument("--weights", type=str, default=ROOT / "yolov5s.pt", help="initial weights path")
    parser.add_argument("--model", type=str, default="yolov5s-cls.pt", help="classifier initial weights")
    parser.add_argument("--cfg", type=str, default="", help="model.yaml path")
    parser.add_argument("--data", type=str, default=ROOT / "data/coco128.yaml", help="dataset.yaml path")
    parser.add_argument("--hyp", type=str, default=ROOT / "data/hyps/hyp.scratch-low.yaml", help="hyperparameters path")
    parser.add_argument("--epochs", type=int, default=100, help="total training epochs")
    parser.add_argument("--batch-size", type=int, default=16, help="total batch size for all GPUs")
    parser.add_argument("--imgsz", "--img", "--img-size", type=int, default=640, help="train, val image size (pixels)")
    parser.add_argument("--rect", action="store_true", help="rectangular training")
    parser.add_argument("--resume", nargs="?", const=True, default=False, help="resume most recent training")
    parser.add_argument("--nosave", action="store_true", help="only save final checkpoint")
    parser.add_argument("--noval", action="store_true", help="only validate final epoch")
    parser.add_argument("--noautoanchor", action="store_true", help="disable AutoAnchor")
    parser.add_argument("--cache", type=str, nargs="?", const="ram", help="image --cache ram/disk")
    parser.add_argument("--image-weights", action="store_true", help="use weighted image selection for training")
    parser.add_argument("--device", default="", help="cuda device, i.e. 0 or 0,1,2,3 or cpu")
    parser.add_argument("--multi-scale", action="store_true", help="vary img-size +/- 50%%")
    parser.add_argument("--single-cls", action="store_true", help="train multi-class data as single-class")
    parser.add_argument("--optimizer", type=str, choices=["SGD", "Adam", "AdamW"], default="SGD", help="optimizer")
    parser.add_argument("--lr0", type=float, default=0.001, help="classifier initial learning rate")
    parser.add_argument("--decay", type=float, default=5e-5, help="classifier weight decay")
    parser.add_argument("--label-smoothing", type=float, default=0.1, help="Label smoothing epsilon")
    parser.add_argument("--cutoff", type=int, default=None, help="Model layer cutoff index for Classify() head")
    parser.add_argument("--sync-bn", action="store_true", help="use SyncBatchNorm, only available in DDP mode")
    parser.add_argument("--workers", type=int, default=8, help="max dataloader workers (per RANK in DDP mode)")
    parser.add_argument("--project", default=ROOT / "runs/train", help="save to project/name")
    parser.add_argument("--name", default="exp", help="save to project/name")
    parser.add_argument("--quad", action="store_true", help="quad dataloader")
    parser.add_argument("--cos-lr", action="store_true", help="cosine LR scheduler")
    parser.add_argument("--patience", type=int, default=100, help="EarlyStopping patience (epochs without improvement)")
    parser.add_argument("--freeze", nargs="+", type=int, default=[0], help="Freeze layers: backbone=10, first3=0 1 2")
    parser.add_argument("--seed", type=int, default=0, help="Global training seed")
    return parser.parse_known_args()[0] if known else parser.parse_args()


def main(opt):
    opt.save_dir = str(increment_path(Path(opt.project) / opt.name))
    device = select_device(opt.device, batch_size=opt.batch_size)
    if opt.task == "classify":
        train_cls(opt, device)
    else:
        train(opt.hyp, opt, device)


if __name__ == "__main__":
    main(parse_opt())
