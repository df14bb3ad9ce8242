# Copyright (c) OpenMMLab. All rights reserved.
"""Object-context segmentation baseline: config, model and custom train loops.

The default path trains through mmengine's ``AmpOptimWrapper``; the two loops
at the bottom drive ``torch.amp`` by hand for the export experiments, where the
model is not wrapped in an OptimWrapper.
"""
import time
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.registry import LOOPS, MODELS
from mmengine.runner import IterBasedTrainLoop
from mmseg.models.losses import accuracy

# ---------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------
crop_size = (512, 1024)
data_preprocessor = dict(
    type="SegDataPreProcessor",
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    bgr_to_rgb=True,
    pad_val=0,
    seg_pad_val=255,
    size=crop_size,
)
model = dict(
    type="ObjectContextSegmentor",
    data_preprocessor=data_preprocessor,
    backbone=dict(type="MixVisionTransformer", embed_dims=64, num_layers=[3, 4, 6, 3]),
    in_channels=512,
    channels=256,
    num_classes=19,
    region_thr=0.5,
    ignore_index=255,
)
optim_wrapper = dict(
    type="AmpOptimWrapper",
    dtype="float16",
    loss_scale="dynamic",
    optimizer=dict(type="AdamW", lr=6e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    clip_grad=dict(max_norm=1.0, norm_type=2),
    paramwise_cfg=dict(custom_keys={"pos_block": dict(decay_mult=0.0), "norm": dict(decay_mult=0.0), "head": dict(lr_mult=10.0)}),
)
param_scheduler = [
    dict(type="LinearLR", start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type="PolyLR", eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False),
]
train_cfg = dict(type="IterBasedTrainLoop", max_iters=160000, val_interval=16000)
val_cfg = dict(type="ValLoop")
test_cfg = dict(type="TestLoop")
default_hooks = dict(
    timer=dict(type="IterTimerHook"),
    logger=dict(type="LoggerHook", interval=50, log_metric_by_epoch=False),
    param_scheduler=dict(type="ParamSchedulerHook"),
    checkpoint=dict(type="CheckpointHook", by_epoch=False, interval=16000, save_best="mIoU"),
)
custom_hooks = [dict(type="EMAHook", momentum=0.0002, priority="ABOVE_NORMAL")]


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------
class RegionCrossAttention(nn.Module):
    """Queries attend to the pixels; with ``region_mask`` each query only sees its own region."""

    def __init__(self, dim: int, num_heads: int = 8):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def _split(self, x):
        b, n, c = x.shape
        return x.view(b, n, self.num_heads, c // self.num_heads).transpose(1, 2)

    def forward(self, query, pixels, region_mask: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None):
        q, k, v = self._split(self.q_proj(query)), self._split(self.k_proj(pixels)), self._split(self.v_proj(pixels))
        sim = (q @ k.transpose(-2, -1)) * self.scale
        if key_padding_mask is not None:
            sim = sim.masked_fill(key_padding_mask[:, None, None, :], -1e9 if sim.dtype == torch.float32 else -1e4)
        if region_mask is not None:
            # an empty region falls back to attending everywhere
            region_mask = region_mask & ~region_mask.all(dim=-1, keepdim=True)
            sim = torch.where(region_mask[:, None], torch.tensor(-1e9, device=sim.device), sim)  # expect: AMP007
        attn = sim.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).flatten(2)
        return self.norm(query + self.out_proj(out))


@MODELS.register_module()
class ObjectContextSegmentor(BaseModel):
    def __init__(self, backbone: dict, in_channels: int, channels: int, num_classes: int, region_thr: float = 0.5,
                 ignore_index: int = 255, align_corners: bool = False, void_classes: Sequence[int] = (),
                 data_preprocessor=None, init_cfg=None):
        super().__init__(data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        self.backbone = MODELS.build(backbone)
        self.bottleneck = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
                                        nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
        self.aux_head = nn.Conv2d(channels, num_classes, 1)
        self.object_queries = nn.Embedding(num_classes, channels)
        self.region_attn = RegionCrossAttention(channels)
        self.pixel_attn = RegionCrossAttention(channels)
        self.fuse = nn.Sequential(nn.Conv2d(2 * channels, channels, 1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
        self.dropout = nn.Dropout2d(0.1)
        self.conv_seg = nn.Conv2d(channels, num_classes, 1)
        self.region_thr = region_thr
        self.void_classes = list(void_classes)
        self.ignore_index = ignore_index
        self.align_corners = align_corners

    def _forward(self, inputs, data_samples=None):
        x = self.bottleneck(self.backbone(inputs)[-1])
        b, c, h, w = x.shape
        pixels = x.flatten(2).transpose(1, 2)
        coarse = self.aux_head(x)
        region_mask = coarse.flatten(2).sigmoid() < self.region_thr
        pad_mask = None
        if data_samples is not None:
            # pixels added by the preprocessor's size-divisor padding
            pad_mask = torch.stack([self._pad_mask(s, (h, w), x.device) for s in data_samples]).flatten(1)
        objects = self.object_queries.weight.unsqueeze(0).expand(b, -1, -1)
        objects = self.region_attn(objects, pixels, region_mask, key_padding_mask=pad_mask)
        context = self.pixel_attn(pixels, objects)
        x = torch.cat([pixels, context], dim=-1).transpose(1, 2).reshape(b, 2 * c, h, w)
        return self.conv_seg(self.dropout(self.fuse(x))), coarse

    @staticmethod
    def _pad_mask(sample, feat_hw, device):
        img_h, img_w = sample.metainfo["img_shape"][:2]
        pad_h, pad_w = sample.metainfo["pad_shape"][:2]
        mask = torch.zeros(pad_h, pad_w, dtype=torch.bool, device=device)
        mask[img_h:, :] = True
        mask[:, img_w:] = True
        return F.interpolate(mask[None, None].float(), size=feat_hw, mode="nearest")[0, 0].bool()

    def forward(self, inputs, data_samples=None, mode: str = "tensor"):
        if mode == "loss":
            return self.loss(inputs, data_samples)
        if mode == "predict":
            return self.predict(inputs, data_samples)
        return self._forward(inputs)

    def loss(self, inputs, data_samples) -> Dict[str, torch.Tensor]:
        seg_logits, aux_logits = self._forward(inputs, data_samples)
        gt = torch.stack([s.gt_sem_seg.data for s in data_samples]).squeeze(1).long()
        seg_logits = F.interpolate(seg_logits, size=gt.shape[-2:], mode="bilinear", align_corners=self.align_corners)
        aux_logits = F.interpolate(aux_logits, size=gt.shape[-2:], mode="bilinear", align_corners=self.align_corners)
        return dict(
            loss_ce=F.cross_entropy(seg_logits, gt, ignore_index=self.ignore_index),
            aux_loss_ce=0.4 * F.cross_entropy(aux_logits, gt, ignore_index=self.ignore_index),
            acc_seg=accuracy(seg_logits, gt, ignore_index=self.ignore_index),
        )

    def predict(self, inputs, data_samples):
        seg_logits, _ = self._forward(inputs, data_samples)
        size = data_samples[0].metainfo["ori_shape"]
        seg_logits = F.interpolate(seg_logits, size=size, mode="bilinear", align_corners=self.align_corners)
        if self.void_classes:
            seg_logits[:, self.void_classes] = -10000.0
        for sample, logits in zip(data_samples, seg_logits):
            sample.set_data({"pred_sem_seg": logits.argmax(dim=0, keepdim=True)})
        return data_samples

    def train_step(self, data: Union[dict, tuple, list], optim_wrapper) -> Dict[str, torch.Tensor]:
        with optim_wrapper.optim_context(self):
            data = self.data_preprocessor(data, True)
            losses = self._run_forward(data, mode="loss")
        parsed_losses, log_vars = self.parse_losses(losses)
        optim_wrapper.update_params(parsed_losses)
        return log_vars


# ---------------------------------------------------------------------------
# hand-written AMP loops
# ---------------------------------------------------------------------------
@LOOPS.register_module()
class NativeAmpIterLoop(IterBasedTrainLoop):
    def __init__(self, runner, dataloader, max_iters: int, val_begin: int = 1, val_interval: int = 1000,
                 clip_grad: Optional[dict] = None, aux_weight: float = 0.4, ignore_index: int = 255):
        super().__init__(runner, dataloader, max_iters, val_begin, val_interval)
        self.clip_grad = clip_grad
        self.aux_weight = aux_weight
        self.ignore_index = ignore_index
        self.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=1000)
        self.optimizer = runner.optim_wrapper.optimizer

    def run_iter(self, data_batch: Sequence[dict]) -> None:
        self.runner.call_hook("before_train_iter", batch_idx=self._iter, data_batch=data_batch)
        model = self.runner.model
        data = model.data_preprocessor(data_batch, True)
        gt = torch.stack([s.gt_sem_seg.data for s in data["data_samples"]]).squeeze(1).long()
        with torch.autocast("cuda", dtype=torch.float16):
            seg_logits, aux_logits = model(data["inputs"], mode="tensor")
        seg_logits = F.interpolate(seg_logits, size=gt.shape[-2:], mode="bilinear", align_corners=False)
        aux_logits = F.interpolate(aux_logits.float(), size=gt.shape[-2:], mode="bilinear", align_corners=False)
        loss_ce = F.cross_entropy(seg_logits, gt, ignore_index=self.ignore_index)  # expect: AMP002
        loss_aux = self.aux_weight * F.cross_entropy(aux_logits, gt, ignore_index=self.ignore_index)
        loss = loss_ce + loss_aux

        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.clip_grad is not None:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), **self.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()

        outputs = dict(loss=loss.detach(), loss_ce=loss_ce.detach(), loss_aux=loss_aux.detach(),
                       loss_scale=self.scaler.get_scale())
        self.runner.call_hook("after_train_iter", batch_idx=self._iter, data_batch=data_batch, outputs=outputs)
        self._iter += 1


@LOOPS.register_module()
class AccumNativeAmpLoop(IterBasedTrainLoop):
    """Gradient accumulation over ``accumulative_counts`` iterations with a plain torch optimizer."""

    def __init__(self, runner, dataloader, max_iters: int, accumulative_counts: int = 4, **kwargs):
        super().__init__(runner, dataloader, max_iters, **kwargs)
        self.accumulative_counts = accumulative_counts
        self.optimizer = runner.optim_wrapper.optimizer

    def run(self):
        self.runner.call_hook("before_train")
        self.runner.call_hook("before_train_epoch")
        scaler = torch.amp.GradScaler("cuda")
        model = self.runner.model
        while self._iter < self._max_iters:
            model.train()
            data_batch = next(self.dataloader_iterator)
            self.runner.call_hook("before_train_iter", batch_idx=self._iter, data_batch=data_batch)
            data = model.data_preprocessor(data_batch, True)
            with torch.autocast("cuda", dtype=torch.float16):
                losses = model(**data, mode="loss")
            parsed_losses, log_vars = model.parse_losses(losses)
            scaler.scale(parsed_losses / self.accumulative_counts).backward()
            if (self._iter + 1) % self.accumulative_counts == 0:
                scaler.step(self.optimizer)  # expect: AMP006
                self.optimizer.zero_grad(set_to_none=True)
            self.runner.call_hook("after_train_iter", batch_idx=self._iter, data_batch=data_batch, outputs=log_vars)
            self._iter += 1

            self._decide_current_val_interval()
            if (self.runner.val_loop is not None and self._iter >= self.val_begin
                    and (self._iter % self.val_interval == 0 or self._iter == self._max_iters)):
                self.runner.val_loop.run()
        self.runner.call_hook("after_train_epoch")
        self.runner.call_hook("after_train")
        return model


def benchmark_train_speed(model, data_batch, optimizer, num_iters: int = 50, warmup: int = 5) -> float:
    """Rough fp16 training throughput (iter/s) of a built model on one batch."""
    scaler = torch.amp.GradScaler("cuda")
    model.train()
    data = model.data_preprocessor(data_batch, True)
    times: List[float] = []
    for i in range(num_iters + warmup):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            losses = model(**data, mode="loss")
            loss, _ = model.parse_losses(losses)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return len(times) / sum(times)
