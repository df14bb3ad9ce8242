"""Runner utilities for the detector codebase.

History: this module started on apex (O1), moved to ``torch.cuda.amp`` in 2021 and is
being ported to ``torch.amp``. The old paths stay until every cluster image ships a
recent torch; see MIGRATION.md.
"""
import functools
import logging
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Function
from torch.nn.utils import clip_grad

try:
    from apex import amp as apex_amp
except ImportError:
    apex_amp = None

try:
    from torch.amp import GradScaler as _GradScaler
    _SCALER_TAKES_DEVICE = True
except ImportError:  # torch < 2.3
    from torch.cuda.amp import GradScaler as _GradScaler
    _SCALER_TAKES_DEVICE = False

logger = logging.getLogger(__name__)
TORCH_VERSION = torch.__version__


def digit_version(version_str):
    parts = []
    for x in version_str.split("+")[0].split("."):
        if x.isdigit():
            parts.append(int(x))
        elif "rc" in x:
            parts.extend([int(x.split("rc")[0]), -1])
    return tuple(parts)


if digit_version(TORCH_VERSION) >= digit_version("2.4.0"):
    amp_autocast = functools.partial(torch.amp.autocast, "cuda")
    custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="cuda")
else:
    amp_autocast = torch.cuda.amp.autocast
    custom_bwd = torch.cuda.amp.custom_bwd


def make_scaler(**kwargs):
    if _SCALER_TAKES_DEVICE:
        return _GradScaler("cuda", **kwargs)
    return _GradScaler(**kwargs)


def auto_fp16(apply_to=None, out_fp32=False):
    """Decorator from the mmcv days: run ``forward`` in fp16 when ``self.fp16_enabled``."""

    def decorator(old_func):
        @functools.wraps(old_func)
        def new_func(*args, **kwargs):
            if not getattr(args[0], "fp16_enabled", False):
                return old_func(*args, **kwargs)
            if TORCH_VERSION != "parrots" and digit_version(TORCH_VERSION) >= digit_version("1.6.0"):
                with torch.cuda.amp.autocast(enabled=True):  # expect: AMP009
                    output = old_func(*args, **kwargs)
            else:
                output = old_func(*args, **kwargs)
            if out_fp32 and isinstance(output, torch.Tensor):
                output = output.float()
            return output

        return new_func

    return decorator


class SigmoidFocalLossFunction(Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, logits, targets, gamma=2.0, alpha=0.25):
        p = torch.sigmoid(logits)
        ctx.save_for_backward(logits, targets)
        ctx.gamma, ctx.alpha = gamma, alpha
        ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        p_t = p * targets + (1 - p) * (1 - targets)
        a_t = alpha * targets + (1 - alpha) * (1 - targets)
        return a_t * ce * (1 - p_t) ** gamma

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_out):
        logits, targets = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            p = torch.sigmoid(x)
            ce = F.binary_cross_entropy_with_logits(x, targets, reduction="none")
            p_t = p * targets + (1 - p) * (1 - targets)
            a_t = ctx.alpha * targets + (1 - ctx.alpha) * (1 - targets)
            (g,) = torch.autograd.grad(a_t * ce * (1 - p_t) ** ctx.gamma, x, grad_out)
        return g, None, None, None


class LegacyMultiheadAttention(nn.Module):
    """Copied from the 2020 DETR port; kept for the old checkpoints."""

    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, key_padding_mask=None):
        B, N, C = x.shape
        q, k, v = self.in_proj(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn_weights = (q * self.scaling) @ k.transpose(-2, -1)
        if key_padding_mask is not None:
            attn_weights = attn_weights.masked_fill(key_padding_mask[:, None, None, :], -1e8)  # expect: AMP007
        attn = self.dropout(attn_weights.softmax(dim=-1))
        return self.out_proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class CrossAttention(LegacyMultiheadAttention):
    """Decoder cross-attention: query from x, keys and values from the encoder memory."""

    def forward(self, x, memory, key_padding_mask=None):
        B, N, C = x.shape
        M = memory.shape[1]
        w_q, w_kv = self.in_proj.weight.split([C, 2 * C])
        b_q, b_kv = self.in_proj.bias.split([C, 2 * C])
        q = F.linear(x, w_q, b_q).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = F.linear(memory, w_kv, b_kv).reshape(B, M, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn_weights = (q * self.scaling) @ k.transpose(-2, -1)
        if key_padding_mask is not None:
            attn_weights = attn_weights.masked_fill(
                key_padding_mask[:, None, None, :], -1e8 if attn_weights.dtype == torch.float32 else -1e4
            )
        attn = self.dropout(attn_weights.softmax(dim=-1))
        return self.out_proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class ComputeLoss:
    """Dense YOLO-style loss over the maps the assigner produced."""

    def __init__(self, hyp):
        self.hyp = hyp
        self.BCEcls = nn.BCEWithLogitsLoss()
        self.BCEobj = nn.BCELoss()  # objectness used to be trained on probabilities

    def __call__(self, preds, targets):
        lbox = lobj = lcls = 0.0
        for pi, ti in zip(preds, targets):
            pos = ti["obj"] > 0
            obj_prob = pi[..., 4].sigmoid()
            lobj = lobj + self.BCEobj(obj_prob, ti["obj"])  # expect: AMP003
            if pos.any():
                ps = pi[pos]
                lbox = lbox + F.smooth_l1_loss(ps[:, :4], ti["box"][pos], beta=0.1)
                lcls = lcls + self.BCEcls(ps[:, 5:], ti["cls"][pos])
        loss = self.hyp["box"] * lbox + self.hyp["obj"] * lobj + self.hyp["cls"] * lcls
        return loss, {"box": float(lbox), "obj": float(lobj), "cls": float(lcls)}


class Hook:
    def before_train_iter(self, runner):
        pass

    def after_train_iter(self, runner):
        pass


class OptimizerHook(Hook):
    def __init__(self, grad_clip=None):
        self.grad_clip = grad_clip

    def clip_grads(self, params):
        params = [p for p in params if p.requires_grad and p.grad is not None]
        if params:
            return clip_grad.clip_grad_norm_(params, **self.grad_clip)
        return None

    def after_train_iter(self, runner):
        runner.optimizer.zero_grad()
        runner.outputs["loss"].backward()
        if self.grad_clip is not None:
            grad_norm = self.clip_grads(runner.model.parameters())
            if grad_norm is not None:
                runner.log_buffer.update({"grad_norm": float(grad_norm)})
        runner.optimizer.step()


class Fp16OptimizerHook(OptimizerHook):
    """Dynamic loss scaling through the native GradScaler (replaced our own in 2021)."""

    def __init__(self, grad_clip=None, loss_scale="dynamic"):
        super().__init__(grad_clip)
        scaler_kwargs = {} if loss_scale == "dynamic" else {"init_scale": float(loss_scale), "growth_interval": 10**9}
        self.loss_scaler = torch.cuda.amp.GradScaler(**scaler_kwargs)  # expect: AMP009

    def after_train_iter(self, runner):
        runner.model.zero_grad()
        runner.optimizer.zero_grad()
        self.loss_scaler.scale(runner.outputs["loss"]).backward()
        if self.grad_clip is not None:
            grad_norm = self.clip_grads(runner.model.parameters())  # expect: AMP005
            if grad_norm is not None:
                runner.log_buffer.update({"grad_norm": float(grad_norm)})
        self.loss_scaler.step(runner.optimizer)
        self.loss_scaler.update()
        runner.log_buffer.update({"loss_scale": self.loss_scaler.get_scale()})


def train(model, train_loader, optimizer, scheduler, hyp, epochs, use_amp=True, use_apex=False,
          max_norm=10.0, device="cuda"):
    compute_loss = ComputeLoss(hyp)
    if use_apex:
        model, optimizer = apex_amp.initialize(model, optimizer, opt_level="O1")
    scaler = make_scaler() if (use_amp and not use_apex) else None
    for epoch in range(epochs):
        model.train()
        t0 = time.time()
        for i, (imgs, targets) in enumerate(train_loader):
            imgs = imgs.to(device, non_blocking=True).float() / 255.0
            with torch.autocast("cuda", enabled=use_amp):
                preds = model(imgs)
                loss, items = compute_loss(preds, targets)
            optimizer.zero_grad(set_to_none=True)
            if use_apex:
                with apex_amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            elif scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if max_norm > 0:
                if scaler is not None:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            optimizer.step()  # expect: AMP006
            scheduler.step()
            if i % 50 == 0:
                logger.info("epoch %d iter %d loss %.4f %s (%.1fs)", epoch, i, loss.item(), items, time.time() - t0)


def finetune_head(model, loader, optimizer, args):
    """Head-only adaptation used by tools/adapt.py."""
    ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    model.train()
    for imgs, targets in loader:
        imgs = imgs.cuda(non_blocking=True).float() / 255.0
        with ctx:
            loss_dict = model(imgs, targets)
            loss = sum(v for k, v in loss_dict.items() if "loss" in k)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


@torch.no_grad()
def validate(model, loader, device="cuda"):
    model.eval()
    outputs = []
    for imgs, _ in loader:
        with amp_autocast():
            preds = model(imgs.to(device, non_blocking=True).float() / 255.0)
        outputs.append([p.float().cpu() for p in preds])
    model.train()
    return outputs
