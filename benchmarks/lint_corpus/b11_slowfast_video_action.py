#!/usr/bin/env python3
# Copyright (c) our lab. Based on facebookresearch/SlowFast tools/train_net.py (Apache-2.0)
"""SlowFast R50 8x8 on our kitchen-activity dataset (Kinetics-style clips) + an AVA-style
multi-label head for the per-person actions. Single file version of the parts we changed.

    python tools/train_slowfast.py --cfg configs/kitchen/SLOWFAST_8x8_R50.yaml TRAIN.MIXED_PRECISION True
"""
import math
import pprint
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from fvcore.common.config import CfgNode

import slowfast.utils.checkpoint as cu
import slowfast.utils.distributed as du
import slowfast.utils.logging as logging
import slowfast.utils.misc as misc
from slowfast.datasets import loader
from slowfast.datasets.mixup import MixUp
from slowfast.models.losses import SoftTargetCrossEntropyLoss
from slowfast.utils.meters import AVAMeter, TrainMeter, ValMeter

logger = logging.get_logger(__name__)


# ------------------------------------------------------------------------------------------
# model (trimmed SlowFast: stem + 4 res stages per pathway, lateral fast->slow fusion)
# ------------------------------------------------------------------------------------------
def get_norm(cfg):
    return nn.BatchNorm3d


class ResStem3d(nn.Module):
    def __init__(self, dim_in, dim_out, kernel, stride, padding, norm_module=nn.BatchNorm3d):
        super().__init__()
        self.conv = nn.Conv3d(dim_in, dim_out, kernel, stride=stride, padding=padding, bias=False)
        self.bn = norm_module(dim_out, eps=1e-5, momentum=0.1)
        self.relu = nn.ReLU(True)
        self.pool_layer = nn.MaxPool3d(kernel_size=[1, 3, 3], stride=[1, 2, 2], padding=[0, 1, 1])

    def forward(self, x):
        return self.pool_layer(self.relu(self.bn(self.conv(x))))


class BottleneckTransform(nn.Module):
    def __init__(self, dim_in, dim_out, temp_kernel_size, stride, dim_inner, norm_module=nn.BatchNorm3d):
        super().__init__()
        self.a = nn.Conv3d(dim_in, dim_inner, kernel_size=[temp_kernel_size, 1, 1],
                           padding=[temp_kernel_size // 2, 0, 0], bias=False)
        self.a_bn = norm_module(dim_inner)
        self.b = nn.Conv3d(dim_inner, dim_inner, [1, 3, 3], stride=[1, stride, stride], padding=[0, 1, 1], bias=False)
        self.b_bn = norm_module(dim_inner)
        self.c = nn.Conv3d(dim_inner, dim_out, kernel_size=[1, 1, 1], bias=False)
        self.c_bn = norm_module(dim_out)
        self.c_bn.transform_final_bn = True

    def forward(self, x):
        x = F.relu(self.a_bn(self.a(x)), inplace=True)
        x = F.relu(self.b_bn(self.b(x)), inplace=True)
        x = self.c_bn(self.c(x))
        return x


class ResBlock(nn.Module):
    def __init__(self, dim_in, dim_out, temp_kernel_size, stride, dim_inner, norm_module=nn.BatchNorm3d):
        super().__init__()
        if (dim_in != dim_out) or (stride != 1):
            self.branch1 = nn.Conv3d(dim_in, dim_out, kernel_size=1, stride=[1, stride, stride], bias=False)
            self.branch1_bn = norm_module(dim_out)
        else:
            self.branch1 = None
        self.branch2 = BottleneckTransform(dim_in, dim_out, temp_kernel_size, stride, dim_inner, norm_module)
        self.relu = nn.ReLU(True)

    def forward(self, x):
        f_x = self.branch2(x)
        if self.branch1 is not None:
            x = self.branch1_bn(self.branch1(x)) + f_x
        else:
            x = x + f_x
        return self.relu(x)


class FuseFastToSlow(nn.Module):
    def __init__(self, dim_in, fusion_conv_channel_ratio, fusion_kernel, alpha, norm_module=nn.BatchNorm3d):
        super().__init__()
        self.conv_f2s = nn.Conv3d(dim_in, dim_in * fusion_conv_channel_ratio, kernel_size=[fusion_kernel, 1, 1],
                                  stride=[alpha, 1, 1], padding=[fusion_kernel // 2, 0, 0], bias=False)
        self.bn = norm_module(dim_in * fusion_conv_channel_ratio)
        self.relu = nn.ReLU(True)

    def forward(self, x):
        x_s, x_f = x
        fuse = self.relu(self.bn(self.conv_f2s(x_f)))
        return [torch.cat([x_s, fuse], 1), x_f]


class SlowFastHead(nn.Module):
    def __init__(self, dim_in, num_classes, dropout_rate=0.5, act_func="softmax"):
        super().__init__()
        self.dropout = nn.Dropout(dropout_rate) if dropout_rate > 0 else nn.Identity()
        self.projection = nn.Linear(sum(dim_in), num_classes, bias=True)
        if act_func == "softmax":
            self.act = nn.Softmax(dim=1)
        elif act_func == "sigmoid":
            self.act = nn.Sigmoid()
        else:
            raise NotImplementedError(act_func)
        self.act_func = act_func

    def forward(self, slow, fast):
        # global average pool over T, H, W of each pathway
        s = slow.mean(dim=(2, 3, 4))  # expect: AMP004
        f = fast.mean(dim=(2, 3, 4))  # expect: AMP004
        x = torch.cat([s, f], dim=1)
        x = self.dropout(x)
        x = self.projection(x)
        # AVA-style multi-label training uses the probabilities (bce), single-label keeps logits
        if self.act_func == "sigmoid" or not self.training:
            x = self.act(x)
        return x


class SlowFast(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        alpha = cfg.SLOWFAST.ALPHA
        beta_inv = cfg.SLOWFAST.BETA_INV
        ratio = cfg.SLOWFAST.FUSION_CONV_CHANNEL_RATIO
        width = 64
        norm = get_norm(cfg)
        self.s1_slow = ResStem3d(3, width, [1, 7, 7], [1, 2, 2], [0, 3, 3], norm)
        self.s1_fast = ResStem3d(3, width // beta_inv, [5, 7, 7], [1, 2, 2], [2, 3, 3], norm)
        self.s1_fuse = FuseFastToSlow(width // beta_inv, ratio, cfg.SLOWFAST.FUSION_KERNEL_SZ, alpha, norm)

        dims = [256, 512, 1024, 2048]
        slow_in = width + width // beta_inv * ratio
        fast_in = width // beta_inv
        self.slow_stages = nn.ModuleList()
        self.fast_stages = nn.ModuleList()
        self.fusions = nn.ModuleList()
        for i, d in enumerate(dims):
            stride = 1 if i == 0 else 2
            tks = 1 if i < 2 else 3
            self.slow_stages.append(ResBlock(slow_in, d, tks, stride, d // 4, norm))
            self.fast_stages.append(ResBlock(fast_in, d // beta_inv, 3, stride, d // 4 // beta_inv, norm))
            if i < len(dims) - 1:
                self.fusions.append(FuseFastToSlow(d // beta_inv, ratio, cfg.SLOWFAST.FUSION_KERNEL_SZ, alpha, norm))
                slow_in = d + d // beta_inv * ratio
            else:
                slow_in = d
            fast_in = d // beta_inv
        self.head = SlowFastHead([dims[-1], dims[-1] // beta_inv], cfg.MODEL.NUM_CLASSES,
                                 dropout_rate=cfg.MODEL.DROPOUT_RATE, act_func=cfg.MODEL.HEAD_ACT)

    def forward(self, x, bboxes=None):
        x_s = self.s1_slow(x[0])
        x_f = self.s1_fast(x[1])
        x_s, x_f = self.s1_fuse([x_s, x_f])
        for i in range(len(self.slow_stages)):
            x_s = self.slow_stages[i](x_s)
            x_f = self.fast_stages[i](x_f)
            if i < len(self.fusions):
                x_s, x_f = self.fusions[i]([x_s, x_f])
        return self.head(x_s, x_f)


# ------------------------------------------------------------------------------------------
# optimizer (slowfast/models/optimizer.py, trimmed)
# ------------------------------------------------------------------------------------------
def construct_optimizer(model, cfg):
    bn_parameters, non_bn_parameters, zero_parameters = [], [], []
    skip = {}
    for name_m, m in model.named_modules():
        is_bn = isinstance(m, torch.nn.modules.batchnorm._NormBase)
        for name_p, p in m.named_parameters(recurse=False):
            name = "{}.{}".format(name_m, name_p).strip(".")
            if not p.requires_grad:
                continue
            if is_bn:
                bn_parameters.append(p)
            elif name in skip or (len(p.shape) == 1 and cfg.SOLVER.ZERO_WD_1D_PARAM):
                zero_parameters.append(p)
            else:
                non_bn_parameters.append(p)
    optim_params = [
        {"params": bn_parameters, "weight_decay": cfg.BN.WEIGHT_DECAY},
        {"params": non_bn_parameters, "weight_decay": cfg.SOLVER.WEIGHT_DECAY},
        {"params": zero_parameters, "weight_decay": 0.0},
    ]
    optim_params = [x for x in optim_params if len(x["params"])]
    if cfg.SOLVER.OPTIMIZING_METHOD == "sgd":
        return torch.optim.SGD(optim_params, lr=cfg.SOLVER.BASE_LR, momentum=cfg.SOLVER.MOMENTUM,
                               weight_decay=cfg.SOLVER.WEIGHT_DECAY, dampening=cfg.SOLVER.DAMPENING,
                               nesterov=cfg.SOLVER.NESTEROV)
    elif cfg.SOLVER.OPTIMIZING_METHOD == "adamw":
        return torch.optim.AdamW(optim_params, lr=cfg.SOLVER.BASE_LR, eps=1e-08,
                                 weight_decay=cfg.SOLVER.WEIGHT_DECAY)
    raise NotImplementedError(cfg.SOLVER.OPTIMIZING_METHOD)


def get_epoch_lr(cur_epoch, cfg):
    # cosine with linear warmup
    if cur_epoch < cfg.SOLVER.WARMUP_EPOCHS:
        alpha = cur_epoch / cfg.SOLVER.WARMUP_EPOCHS
        return cfg.SOLVER.WARMUP_START_LR * (1 - alpha) + cfg.SOLVER.BASE_LR * alpha
    return cfg.SOLVER.COSINE_END_LR + (cfg.SOLVER.BASE_LR - cfg.SOLVER.COSINE_END_LR) * \
        (math.cos(math.pi * cur_epoch / cfg.SOLVER.MAX_EPOCH) + 1.0) * 0.5


def set_lr(optimizer, new_lr):
    for param_group in optimizer.param_groups:
        param_group["lr"] = new_lr


# ------------------------------------------------------------------------------------------
# train / eval
# ------------------------------------------------------------------------------------------
def train_epoch(train_loader, model, optimizer, scaler, train_meter, cur_epoch, cfg, writer=None):
    """single-label clips (Kinetics-style)"""
    model.train()
    train_meter.iter_tic()
    data_size = len(train_loader)

    if cfg.MIXUP.ENABLE:
        mixup_fn = MixUp(
            mixup_alpha=cfg.MIXUP.ALPHA,
            cutmix_alpha=cfg.MIXUP.CUTMIX_ALPHA,
            mix_prob=cfg.MIXUP.PROB,
            switch_prob=cfg.MIXUP.SWITCH_PROB,
            label_smoothing=cfg.MIXUP.LABEL_SMOOTH_VALUE,
            num_classes=cfg.MODEL.NUM_CLASSES,
        )
        loss_fun = SoftTargetCrossEntropyLoss(reduction="mean")
    else:
        loss_fun = nn.CrossEntropyLoss(reduction="mean")

    for cur_iter, (inputs, labels, index, time_, meta) in enumerate(train_loader):
        if cfg.NUM_GPUS:
            if isinstance(inputs, (list,)):
                for i in range(len(inputs)):
                    inputs[i] = inputs[i].cuda(non_blocking=True)
            else:
                inputs = inputs.cuda(non_blocking=True)
            labels = labels.cuda()

        epoch_exact = cur_epoch + float(cur_iter) / data_size
        lr = get_epoch_lr(epoch_exact, cfg)
        set_lr(optimizer, lr)

        train_meter.data_toc()
        if cfg.MIXUP.ENABLE:
            samples, labels = mixup_fn(inputs[0], labels)
            inputs[0] = samples

        with torch.cuda.amp.autocast(enabled=cfg.TRAIN.MIXED_PRECISION):  # expect: AMP009
            preds = model(inputs)
        # Compute the loss.
        loss = loss_fun(preds, labels)  # expect: AMP002

        misc.check_nan_losses(loss)

        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if cfg.SOLVER.CLIP_GRAD_VAL:
            torch.nn.utils.clip_grad_value_(model.parameters(), cfg.SOLVER.CLIP_GRAD_VAL)  # expect: AMP005
        elif cfg.SOLVER.CLIP_GRAD_L2NORM:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.SOLVER.CLIP_GRAD_L2NORM)
        scaler.step(optimizer)
        scaler.update()

        if cfg.MIXUP.ENABLE:
            _top_max_k_vals, top_max_k_inds = torch.topk(labels, 2, dim=1, largest=True, sorted=True)
            idx_top1 = torch.arange(labels.shape[0]), top_max_k_inds[:, 0]
            idx_top2 = torch.arange(labels.shape[0]), top_max_k_inds[:, 1]
            preds = preds.detach()
            preds[idx_top1] += preds[idx_top2]
            preds[idx_top2] = 0.0
            labels = top_max_k_inds[:, 0]

        top1_err, top5_err = None, None
        num_topks_correct = misc.topks_correct(preds, labels, (1, 5))
        top1_err, top5_err = [(1.0 - x / preds.size(0)) * 100.0 for x in num_topks_correct]
        if cfg.NUM_GPUS > 1:
            loss, top1_err, top5_err = du.all_reduce([loss, top1_err, top5_err])
        loss, top1_err, top5_err = loss.item(), top1_err.item(), top5_err.item()

        train_meter.update_stats(top1_err, top5_err, loss, lr, inputs[0].size(0) * max(cfg.NUM_GPUS, 1))
        if writer is not None:
            writer.add_scalars({"Train/loss": loss, "Train/lr": lr}, global_step=data_size * cur_epoch + cur_iter)
        train_meter.iter_toc()
        train_meter.log_iter_stats(cur_epoch, cur_iter)
        train_meter.iter_tic()

    train_meter.log_epoch_stats(cur_epoch)
    train_meter.reset()


def train_epoch_ava(train_loader, model, optimizer, scaler, train_meter, cur_epoch, cfg):
    """per-person multi-label actions (the head uses a sigmoid, HEAD_ACT: sigmoid)"""
    model.train()
    loss_fun = nn.BCELoss(reduction="mean")
    data_size = len(train_loader)
    for cur_iter, (inputs, labels, _, meta) in enumerate(train_loader):
        # fp16 clips: the fast pathway at 32x256x256 saturates the PCIe link otherwise
        inputs = [inp.cuda(non_blocking=True).half() for inp in inputs]  # expect: AMP001
        labels = labels.cuda()
        for key, val in meta.items():
            if isinstance(val, (list,)):
                for i in range(len(val)):
                    val[i] = val[i].cuda(non_blocking=True)
            else:
                meta[key] = val.cuda(non_blocking=True)

        lr = get_epoch_lr(cur_epoch + float(cur_iter) / data_size, cfg)
        set_lr(optimizer, lr)

        with torch.autocast("cuda", enabled=cfg.TRAIN.MIXED_PRECISION):
            preds = model(inputs, meta["boxes"])
            loss = loss_fun(preds, labels)  # expect: AMP003

        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()

        train_meter.update_stats(None, None, None, loss.item(), lr)
        train_meter.log_iter_stats(cur_epoch, cur_iter)


@torch.no_grad()
def eval_epoch(val_loader, model, val_meter, cur_epoch, cfg, writer=None):
    model.eval()
    val_meter.iter_tic()
    for cur_iter, (inputs, labels, index, time_, meta) in enumerate(val_loader):
        if cfg.NUM_GPUS:
            inputs = [x.cuda(non_blocking=True) for x in inputs]
            labels = labels.cuda()
        val_meter.data_toc()
        with torch.autocast("cuda", enabled=cfg.TRAIN.MIXED_PRECISION):
            preds = model(inputs)
        num_topks_correct = misc.topks_correct(preds.float(), labels, (1, 5))
        top1_err, top5_err = [(1.0 - x / preds.size(0)) * 100.0 for x in num_topks_correct]
        val_meter.iter_toc()
        val_meter.update_stats(top1_err.item(), top5_err.item(), inputs[0].size(0) * max(cfg.NUM_GPUS, 1))
        val_meter.log_iter_stats(cur_epoch, cur_iter)
        val_meter.iter_tic()
    val_meter.log_epoch_stats(cur_epoch)
    val_meter.reset()


def train(cfg):
    du.init_distributed_training(cfg)
    np.random.seed(cfg.RNG_SEED)
    torch.manual_seed(cfg.RNG_SEED)
    logging.setup_logging(cfg.OUTPUT_DIR)
    logger.info("Train with config:")
    logger.info(pprint.pformat(cfg))

    model = SlowFast(cfg).cuda()
    if cfg.NUM_GPUS > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    optimizer = construct_optimizer(model, cfg)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.TRAIN.MIXED_PRECISION)  # expect: AMP009

    start_epoch = cu.load_train_checkpoint(cfg, model, optimizer, scaler if cfg.TRAIN.MIXED_PRECISION else None)

    train_loader = loader.construct_loader(cfg, "train")
    val_loader = loader.construct_loader(cfg, "val")
    if cfg.DETECTION.ENABLE:
        train_meter = AVAMeter(len(train_loader), cfg, mode="train")
        val_meter = AVAMeter(len(val_loader), cfg, mode="val")
    else:
        train_meter = TrainMeter(len(train_loader), cfg)
        val_meter = ValMeter(len(val_loader), cfg)

    logger.info("Start epoch: {}".format(start_epoch + 1))
    epoch_timer_start = time.time()
    for cur_epoch in range(start_epoch, cfg.SOLVER.MAX_EPOCH):
        loader.shuffle_dataset(train_loader, cur_epoch)
        if cfg.DETECTION.ENABLE:
            train_epoch_ava(train_loader, model, optimizer, scaler, train_meter, cur_epoch, cfg)
        else:
            train_epoch(train_loader, model, optimizer, scaler, train_meter, cur_epoch, cfg)

        if cu.is_checkpoint_epoch(cfg, cur_epoch):
            cu.save_checkpoint(cfg.OUTPUT_DIR, model, optimizer, cur_epoch, cfg,
                               scaler if cfg.TRAIN.MIXED_PRECISION else None)
        if misc.is_eval_epoch(cfg, cur_epoch, None):
            eval_epoch(val_loader, model, val_meter, cur_epoch, cfg)
    logger.info("training done in {:.1f} h".format((time.time() - epoch_timer_start) / 3600))


if __name__ == "__main__":
    from slowfast.config.defaults import get_cfg
    from slowfast.utils.parser import load_config, parse_args

    args = parse_args()
    cfg = load_config(args, args.cfg_files[0])
    train(cfg)
