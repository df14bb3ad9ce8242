#!/usr/bin/env python3
# YOLOX-style trainer with an optional foreground auxiliary head and
# feature distillation from a frozen teacher.

import datetime
import os
import time
from copy import deepcopy

import torch
import torch.nn as nn
import torch.nn.functional as F
from loguru import logger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

from yolox.data import DataPrefetcher
from yolox.exp import Exp
from yolox.utils import (
    MeterBuffer,
    ModelEMA,
    all_reduce_norm,
    get_local_rank,
    get_model_info,
    get_rank,
    get_world_size,
    gpu_mem_usage,
    is_parallel,
    load_ckpt,
    occupy_mem,
    save_checkpoint,
    setup_logger,
    synchronize,
)


class ForegroundAuxHead(nn.Module):
    """Predicts a class-agnostic foreground map on the stride-8 FPN level."""

    def __init__(self, in_channels, hidden=128, reduction=4):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, hidden, 3, 1, 1, bias=False)
        self.fc1 = nn.Conv2d(hidden, hidden // reduction, 1)
        self.fc2 = nn.Conv2d(hidden // reduction, hidden, 1)
        self.bn = nn.BatchNorm2d(hidden)
        self.act = nn.SiLU(inplace=True)
        self.pred = nn.Conv2d(hidden, 1, 1)

    def forward(self, x, valid_mask=None):
        feat = self.stem(x)
        pooled = feat.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        gate = torch.sigmoid(self.fc2(F.silu(self.fc1(pooled))))
        feat = self.act(self.bn(feat * gate))
        logits = self.pred(feat)
        if valid_mask is not None:
            # letterbox padding never contains objects
            logits[~valid_mask] = -1e5  # expect: AMP007
        return logits


class Trainer:
    def __init__(self, exp: Exp, args):
        self.exp = exp
        self.args = args

        # training related attr
        self.max_epoch = exp.max_epoch
        self.amp_training = args.fp16
        self.scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)  # expect: AMP009
        self.is_distributed = get_world_size() > 1
        self.rank = get_rank()
        self.local_rank = get_local_rank()
        self.device = "cuda:{}".format(self.local_rank)
        self.use_model_ema = exp.ema

        # data/dataloader related attr
        self.data_type = torch.float16 if args.fp16 else torch.float32
        self.input_size = exp.input_size
        self.best_ap = 0

        # metric record
        self.meter = MeterBuffer(window_size=exp.print_interval)
        self.file_name = os.path.join(exp.output_dir, args.experiment_name)
        if self.rank == 0:
            os.makedirs(self.file_name, exist_ok=True)
        setup_logger(self.file_name, distributed_rank=self.rank, filename="train_log.txt", mode="a")

    def train(self):
        self.before_train()
        try:
            self.train_in_epoch()
        finally:
            self.after_train()

    def train_in_epoch(self):
        for self.epoch in range(self.start_epoch, self.max_epoch):
            self.before_epoch()
            self.train_in_iter()
            self.after_epoch()

    def train_in_iter(self):
        for self.iter in range(self.max_iter):
            self.before_iter()
            self.train_one_iter()
            self.after_iter()

    def valid_mask(self, inps):
        # padded pixels are filled with the constant 114 by the preprocessing
        stride8 = F.avg_pool2d(inps.float(), kernel_size=8, stride=8)
        return (stride8 != 114.0).any(dim=1, keepdim=True)

    def foreground_targets(self, targets, shape):
        """Rasterise the ground-truth boxes (cls, cx, cy, w, h) to a stride-8 mask."""
        n, _, h, w = shape
        fg = torch.zeros(shape, device=targets.device)
        for b in range(n):
            for cls_id, cx, cy, bw, bh in targets[b].tolist():
                if bw <= 0 or bh <= 0:
                    continue
                x0, x1 = int(max(cx - bw / 2, 0) / 8), int(min(cx + bw / 2, w * 8 - 1) / 8) + 1
                y0, y1 = int(max(cy - bh / 2, 0) / 8), int(min(cy + bh / 2, h * 8 - 1) / 8) + 1
                fg[b, 0, y0:y1, x0:x1] = 1.0
        return fg

    def train_one_iter(self):
        iter_start_time = time.time()

        inps, targets = self.prefetcher.next()
        inps = inps.to(self.data_type)
        targets = targets.to(self.data_type)
        targets.requires_grad = False
        inps, targets = self.exp.preprocess(inps, targets, self.input_size)
        data_end_time = time.time()

        with torch.cuda.amp.autocast(enabled=self.amp_training, dtype=torch.float16):  # expect: AMP009
            outputs = self.model(inps, targets, return_features=True)
            fpn_outs = outputs["fpn_outs"]
            fg_prob = torch.sigmoid(self.aux_head(fpn_outs[0], self.valid_mask(inps)))
            fg_target = self.foreground_targets(targets, fg_prob.shape)
            aux_loss = self.aux_bce(fg_prob, fg_target)  # expect: AMP003

        loss = outputs["total_loss"] + self.exp.aux_weight * aux_loss
        outputs["aux_loss"] = aux_loss
        if self.teacher is not None:
            with torch.no_grad():
                teacher_outs = self.teacher.backbone(inps)
            distill_loss = sum(F.mse_loss(fpn_outs[i], teacher_outs[i]) for i in range(len(teacher_outs)))  # expect: AMP002
            loss = loss + self.exp.distill_weight * distill_loss
            outputs["distill_loss"] = distill_loss

        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.optimizer_step()

        if self.use_model_ema:
            self.ema_model.update(self.model)

        lr = self.lr_scheduler.update_lr(self.progress_in_iter + 1)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr

        iter_end_time = time.time()
        self.meter.update(
            iter_time=iter_end_time - iter_start_time,
            data_time=data_end_time - iter_start_time,
            lr=lr,
            **{k: v for k, v in outputs.items() if k != "fpn_outs"},
        )

    def optimizer_step(self):
        if self.exp.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=self.exp.clip_grad_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def before_train(self):
        logger.info("args: {}".format(self.args))
        logger.info("exp value:\n{}".format(self.exp))

        torch.cuda.set_device(self.local_rank)
        model = self.exp.get_model()
        logger.info("Model Summary: {}".format(get_model_info(model, self.exp.test_size)))
        model.to(self.device)

        self.optimizer = self.exp.get_optimizer(self.args.batch_size)
        model = self.resume_train(model)

        self.aux_head = ForegroundAuxHead(self.exp.fpn_channels[0]).to(self.device)
        self.aux_bce = nn.BCELoss()
        self.optimizer.add_param_group({"params": self.aux_head.parameters()})

        self.teacher = None
        if self.exp.teacher_ckpt:
            self.teacher = deepcopy(model)
            self.teacher.load_state_dict(torch.load(self.exp.teacher_ckpt, map_location=self.device)["model"])
            self.teacher.eval().requires_grad_(False)

        self.no_aug = self.start_epoch >= self.max_epoch - self.exp.no_aug_epochs
        self.train_loader = self.exp.get_data_loader(
            batch_size=self.args.batch_size,
            is_distributed=self.is_distributed,
            no_aug=self.no_aug,
            cache_img=self.args.cache,
        )
        self.prefetcher = DataPrefetcher(self.train_loader)
        self.max_iter = len(self.train_loader)
        self.lr_scheduler = self.exp.get_lr_scheduler(self.exp.basic_lr_per_img * self.args.batch_size, self.max_iter)
        if self.args.occupy:
            occupy_mem(self.local_rank)

        if self.is_distributed:
            model = DDP(model, device_ids=[self.local_rank], broadcast_buffers=False)

        if self.use_model_ema:
            self.ema_model = ModelEMA(model, 0.9998)
            self.ema_model.updates = self.max_iter * self.start_epoch

        self.model = model
        self.evaluator = self.exp.get_evaluator(batch_size=self.args.batch_size, is_distributed=self.is_distributed)
        if self.rank == 0:
            self.tblogger = SummaryWriter(os.path.join(self.file_name, "tensorboard"))
        logger.info("Training start...")

    def after_train(self):
        logger.info("Training of experiment is done and the best AP is {:.2f}".format(self.best_ap * 100))

    def before_epoch(self):
        logger.info("---> start train epoch{}".format(self.epoch + 1))
        if self.epoch + 1 == self.max_epoch - self.exp.no_aug_epochs or self.no_aug:
            logger.info("--->No mosaic aug now!")
            self.train_loader.close_mosaic()
            self.exp.eval_interval = 1

    def after_epoch(self):
        self.save_ckpt(ckpt_name="latest")
        if (self.epoch + 1) % self.exp.eval_interval == 0:
            all_reduce_norm(self.model)
            self.evaluate_and_save_model()

    def before_iter(self):
        pass

    def after_iter(self):
        if (self.iter + 1) % self.exp.print_interval == 0:
            left_iters = self.max_iter * self.max_epoch - (self.progress_in_iter + 1)
            eta_seconds = self.meter["iter_time"].global_avg * left_iters
            eta_str = "ETA: {}".format(datetime.timedelta(seconds=int(eta_seconds)))
            loss_meter = self.meter.get_filtered_meter("loss")
            loss_str = ", ".join(["{}: {:.1f}".format(k, v.latest) for k, v in loss_meter.items()])
            logger.info("epoch: {}/{}, iter: {}/{}, mem: {:.0f}Mb, {}, lr: {:.3e}, {}".format(
                self.epoch + 1, self.max_epoch, self.iter + 1, self.max_iter, gpu_mem_usage(), loss_str, self.meter["lr"].latest, eta_str))
            if self.rank == 0:
                for k, v in loss_meter.items():
                    self.tblogger.add_scalar(f"train/{k}", v.latest, self.progress_in_iter)
            self.meter.clear_meters()

        if (self.progress_in_iter + 1) % 10 == 0:
            self.input_size = self.exp.random_resize(self.train_loader, self.epoch, self.rank, self.is_distributed)

    @property
    def progress_in_iter(self):
        return self.epoch * self.max_iter + self.iter

    def resume_train(self, model):
        self.start_epoch = 0
        if self.args.ckpt is not None:
            logger.info("loading checkpoint for fine tuning")
            ckpt = torch.load(self.args.ckpt, map_location=self.device)["model"]
            model = load_ckpt(model, ckpt)
        return model

    def evaluate_and_save_model(self):
        evalmodel = self.ema_model.ema if self.use_model_ema else self.model
        if is_parallel(evalmodel):
            evalmodel = evalmodel.module
        (ap50_95, ap50, summary) = self.exp.eval(evalmodel, self.evaluator, self.is_distributed)
        update_best_ckpt = ap50_95 > self.best_ap
        self.best_ap = max(self.best_ap, ap50_95)
        if self.rank == 0:
            self.tblogger.add_scalar("val/COCOAP50", ap50, self.epoch + 1)
            logger.info("\n" + summary)
        synchronize()
        self.save_ckpt("last_epoch", update_best_ckpt)

    def save_ckpt(self, ckpt_name, update_best_ckpt=False):
        if self.rank == 0:
            save_model = self.ema_model.ema if self.use_model_ema else self.model
            if is_parallel(save_model):
                save_model = save_model.module
            logger.info("Save weights to {}".format(self.file_name))
            ckpt_state = {
                "start_epoch": self.epoch + 1,
                "model": save_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "best_ap": self.best_ap,
            }
            save_checkpoint(ckpt_state, update_best_ckpt, self.file_name, ckpt_name)
            if update_best_ckpt:
                torch.save({"model": deepcopy(save_model).half().state_dict()}, os.path.join(self.file_name, "best_fp16.pth"))
