"""Detector trainer with an amp switch, EMA and multi-scale (YOLOX style)."""
import datetime
import os
import time

import torch
import torch.nn as nn


class ModelEMA:
    def __init__(self, model, decay=0.9998):
        import copy

        self.ema = copy.deepcopy(model).eval()
        self.decay = decay
        self.updates = 0
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        with torch.no_grad():
            self.updates += 1
            d = self.decay * (1 - pow(2.718, -self.updates / 2000))
            msd = model.state_dict()
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v.mul_(d).add_(msd[k].detach(), alpha=1 - d)


class Trainer:
    def __init__(self, exp, args):
        self.exp = exp
        self.args = args
        self.max_epoch = exp.max_epoch
        self.amp_training = args.fp16
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)
        self.data_type = torch.float16 if args.fp16 else torch.float32
        self.device = f"cuda:{args.local_rank}"
        self.use_model_ema = exp.ema
        self.save_history_ckpt = exp.save_history_ckpt
        self.input_size = exp.input_size
        self.file_name = os.path.join(exp.output_dir, args.experiment_name)

    def train(self):
        self.before_train()
        try:
            for self.epoch in range(self.start_epoch, self.max_epoch):
                self.train_in_epoch()
        finally:
            self.after_train()

    def before_train(self):
        model = self.exp.get_model()
        model.to(self.device)
        self.optimizer = self.exp.get_optimizer(self.args.batch_size)
        self.model = model
        self.start_epoch = 0
        self.train_loader = self.exp.get_data_loader(batch_size=self.args.batch_size)
        self.prefetcher = iter(self.train_loader)
        self.max_iter = len(self.train_loader)
        self.lr_scheduler = self.exp.get_lr_scheduler(self.exp.basic_lr_per_img * self.args.batch_size, self.max_iter)
        if self.use_model_ema:
            self.ema_model = ModelEMA(model, 0.9998)
        self.model.train()

    def train_in_epoch(self):
        for self.iter in range(self.max_iter):
            self.train_one_iter()

    def train_one_iter(self):
        iter_start_time = time.time()
        inps, targets = next(self.prefetcher)
        inps = inps.to(self.data_type)
        targets = targets.to(self.data_type)
        targets.requires_grad = False
        inps, targets = self.exp.preprocess(inps, targets, self.input_size)
        data_end_time = time.time()
        with torch.autocast("cuda", enabled=self.amp_training):
            outputs = self.model(inps, targets)
        loss = outputs["total_loss"]
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.use_model_ema:
            self.ema_model.update(self.model)
        lr = self.lr_scheduler.update_lr(self.progress_in_iter + 1)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        self.iter_time = time.time() - iter_start_time
        self.data_time = data_end_time - iter_start_time

    @property
    def progress_in_iter(self):
        return self.epoch * self.max_iter + self.iter

    def after_train(self):
        print(f"Training of experiment is done, {datetime.datetime.now()}")

    def save_ckpt(self, ckpt_name):
        save_model = self.ema_model.ema if self.use_model_ema else self.model
        ckpt_state = {
            "start_epoch": self.epoch + 1,
            "model": save_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }
        torch.save(ckpt_state, os.path.join(self.file_name, ckpt_name + "_ckpt.pth"))


class DirectHalfTrainer(Trainer):
    """A fork that converts the model itself instead of using autocast."""

    def before_train(self):
        super().before_train()
        self.model = self.model.half()  # expect: AMP001

    def train_one_iter(self):
        inps, targets = next(self.prefetcher)
        inps = inps.cuda().half()  # expect: AMP001
        outputs = self.model(inps, targets.cuda())
        self.optimizer.zero_grad()
        outputs["total_loss"].backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
        self.optimizer.step()
