#!/usr/bin/env python3
""" ImageNet training script for small ViTs (timm-style): native AMP with NativeScaler, fp32
model EMA, Mixup/CutMix soft targets, optional hard-label distillation from a frozen teacher.
"""
import argparse
import time
from contextlib import suppress
from copy import deepcopy
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------- model
class PatchEmbed(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=384):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim, num_heads=6, attn_drop=0.0, fused_attn=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            x = self.attn_drop(attn) @ v
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


def drop_path(x, drop_prob=0.0, training=False, scale_by_keep=True):
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, drop_path=0.0, init_values=1e-5):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.gamma1 = nn.Parameter(init_values * torch.ones(dim))
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))
        self.gamma2 = nn.Parameter(init_values * torch.ones(dim))
        self.drop_prob = drop_path

    def forward(self, x):
        x = x + drop_path(self.gamma1 * self.attn(self.norm1(x)), self.drop_prob, self.training)
        return x + drop_path(self.gamma2 * self.mlp(self.norm2(x)), self.drop_prob, self.training)


class VisionTransformer(nn.Module):
    def __init__(self, num_classes=1000, embed_dim=384, depth=12, num_heads=6, drop_path_rate=0.1, global_pool="avg"):
        super().__init__()
        self.global_pool = global_pool
        self.num_prefix_tokens = 1
        self.patch_embed = PatchEmbed(embed_dim=embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, embed_dim) * 0.02)
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads, drop_path=dpr[i]) for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward_features(self, x):
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        x = self.blocks(x)
        return self.norm(x)

    def forward_head(self, x, pre_logits=False):
        x = x[:, self.num_prefix_tokens :].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        return x if pre_logits else self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


# --------------------------------------------------------------------------- utils
def dispatch_clip_grad(parameters, value, mode="norm"):
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, max_norm=value)
    else:
        torch.nn.utils.clip_grad_value_(parameters, value)


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None, create_graph=False):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if clip_grad is not None:
            self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's params in-place
            dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
        self._scaler.step(optimizer)
        self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()


class ModelEma(nn.Module):
    """Exponential moving average of weights, kept in fp32 (optionally on CPU)."""

    def __init__(self, model, decay=0.9998, device=None):
        super().__init__()
        self.module = deepcopy(model)
        self.module.eval()
        self.module.requires_grad_(False)
        self.decay = decay
        if device is not None:
            self.module.to(device=device)

    @torch.no_grad()
    def update(self, model, step):
        decay = min(self.decay, (1 + step) / (10 + step))
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_v.lerp_(model_v.to(device=ema_v.device), 1.0 - decay)
            else:
                ema_v.copy_(model_v)


def one_hot(x, num_classes, on_value=1.0, off_value=0.0):
    x = x.long().view(-1, 1)
    return torch.full((x.size(0), num_classes), off_value, device=x.device).scatter_(1, x, on_value)


def mixup_target(target, num_classes, lam=1.0, smoothing=0.1):
    off_value = smoothing / num_classes
    on_value = 1.0 - smoothing + off_value
    y1 = one_hot(target, num_classes, on_value=on_value, off_value=off_value)
    y2 = one_hot(target.flip(0), num_classes, on_value=on_value, off_value=off_value)
    return y1 * lam + y2 * (1.0 - lam)


class Mixup:
    def __init__(self, mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.1, num_classes=1000):
        self.mixup_alpha, self.cutmix_alpha, self.switch_prob = mixup_alpha, cutmix_alpha, switch_prob
        self.label_smoothing, self.num_classes = label_smoothing, num_classes

    def __call__(self, x, target):
        use_cutmix = np.random.rand() < self.switch_prob
        lam = float(np.random.beta(self.cutmix_alpha, self.cutmix_alpha) if use_cutmix else np.random.beta(self.mixup_alpha, self.mixup_alpha))
        if use_cutmix:
            H, W = x.shape[-2:]
            cut_h, cut_w = int(H * np.sqrt(1 - lam)), int(W * np.sqrt(1 - lam))
            cy, cx = np.random.randint(H), np.random.randint(W)
            yl, yh = np.clip(cy - cut_h // 2, 0, H), np.clip(cy + cut_h // 2, 0, H)
            xl, xh = np.clip(cx - cut_w // 2, 0, W), np.clip(cx + cut_w // 2, 0, W)
            x[:, :, yl:yh, xl:xh] = x.flip(0)[:, :, yl:yh, xl:xh]
            lam = 1.0 - (yh - yl) * (xh - xl) / float(H * W + 1e-8)
        else:
            x.mul_(lam).add_(x.flip(0).mul_(1.0 - lam))
        return x, mixup_target(target, self.num_classes, lam, self.label_smoothing)


def accuracy(output, target, topk=(1, 5)):
    maxk = min(max(topk), output.size(1))
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.reshape(1, -1).expand_as(pred.t()))
    return [correct[: min(k, maxk)].reshape(-1).float().sum(0) * 100.0 / target.size(0) for k in topk]


def reduce_tensor(tensor, n):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / n


# --------------------------------------------------------------------------- train / eval
def train_one_epoch(epoch, model, loader, optimizer, args, amp_autocast=suppress, loss_scaler=None,
                    model_ema=None, mixup_fn=None, teacher=None):
    model.train()
    num_updates = epoch * len(loader)
    start = time.time()
    for batch_idx, (input, target) in enumerate(loader):
        input = input.cuda(non_blocking=True).contiguous(memory_format=torch.channels_last)
        target = target.cuda(non_blocking=True)
        hard_target = target
        if mixup_fn is not None:
            input, target = mixup_fn(input, target)
        if teacher is not None:
            with torch.no_grad():
                teacher_logits = teacher(input.half()).float()

        with amp_autocast():
            output = model(input)
            if teacher is not None:
                distill = F.cross_entropy(output, teacher_logits.argmax(dim=-1))
        loss = F.cross_entropy(output, target, label_smoothing=0.0 if mixup_fn else args.smoothing)  # expect: AMP002
        if teacher is not None:
            loss = 0.5 * loss + 0.5 * distill

        optimizer.zero_grad(set_to_none=True)
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters())
        else:
            loss.backward()
            if args.clip_grad is not None:
                dispatch_clip_grad(model.parameters(), args.clip_grad)
            optimizer.step()

        num_updates += 1
        if model_ema is not None:
            model_ema.update(model, step=num_updates)
        if batch_idx % args.log_interval == 0:
            top1 = accuracy(output.detach().float(), hard_target, topk=(1,))[0]
            rate = input.size(0) * (batch_idx + 1) / (time.time() - start + 1e-8)
            print(f"epoch {epoch} [{batch_idx}/{len(loader)}] loss {loss.item():.4f} top1 {top1.item():.2f} {rate:.0f} img/s")


def validate(model, loader, amp_autocast=suppress, distributed=False, world_size=1):
    model.eval()
    top1_sum, loss_sum, n = torch.zeros((), device="cuda"), torch.zeros((), device="cuda"), 0
    with torch.no_grad():
        for input, target in loader:
            input = input.cuda(non_blocking=True).contiguous(memory_format=torch.channels_last)
            target = target.cuda(non_blocking=True)
            with amp_autocast():
                output = model(input)
                loss = F.cross_entropy(output, target)
            acc1, _ = accuracy(output, target)
            loss_sum += loss.float() * input.size(0)
            top1_sum += acc1 * input.size(0)
            n += input.size(0)
    if distributed:
        top1_sum, loss_sum = reduce_tensor(top1_sum, world_size), reduce_tensor(loss_sum, world_size)
    return {"loss": loss_sum.item() / n, "top1": top1_sum.item() / n}


def finetune_head(model, loader, epochs, lr):
    """Linear-probe warm-up of a freshly initialised classifier before full fine-tuning."""
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    optimizer = torch.optim.SGD(model.head.parameters(), lr=lr, momentum=0.9)
    model.train()
    for _ in range(epochs):
        for input, target in loader:
            input, target = input.cuda(non_blocking=True), target.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                loss = F.cross_entropy(model(input), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    model.requires_grad_(True)


def build_teacher(path, num_classes):
    teacher = VisionTransformer(num_classes=num_classes, embed_dim=768, num_heads=12)
    teacher.load_state_dict(torch.load(path, map_location="cpu"))
    teacher.requires_grad_(False)
    teacher.eval()
    return teacher.half().cuda()


@torch.inference_mode()
def benchmark_inference(model, batch_size=256, steps=50):
    model = deepcopy(model).half().eval()
    x = torch.randn(batch_size, 3, 224, 224, device="cuda", dtype=torch.float16)
    start = time.time()
    for _ in range(steps):
        model(x)
    torch.cuda.synchronize()
    return batch_size * steps / (time.time() - start)


def save_checkpoint(path, epoch, model, optimizer, loss_scaler, model_ema, metric):
    state = {"epoch": epoch, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), "metric": metric}
    if loss_scaler is not None:
        state[loss_scaler.state_dict_key] = loss_scaler.state_dict()
    if model_ema is not None:
        state["state_dict_ema"] = {k: v.half() for k, v in model_ema.module.state_dict().items()}
    torch.save(state, path)


def main(args, loader_train, loader_eval):
    torch.backends.cuda.matmul.allow_tf32 = True
    model = VisionTransformer(num_classes=args.num_classes).cuda().to(memory_format=torch.channels_last)
    if args.head_warmup_epochs > 0:
        finetune_head(model, loader_train, args.head_warmup_epochs, lr=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, eps=1e-8)
    amp_autocast, loss_scaler = suppress, None
    if args.amp:
        amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)
        loss_scaler = NativeScaler()
    model_ema = ModelEma(model, decay=args.model_ema_decay, device="cpu" if args.model_ema_force_cpu else None)
    mixup_fn = Mixup(label_smoothing=args.smoothing, num_classes=args.num_classes) if args.mixup else None
    teacher = build_teacher(args.teacher, args.num_classes) if args.teacher else None

    best_metric = -1e9
    for epoch in range(args.epochs):
        train_one_epoch(epoch, model, loader_train, optimizer, args, amp_autocast, loss_scaler, model_ema, mixup_fn, teacher)
        metrics = validate(model, loader_eval, amp_autocast)
        ema_metrics = validate(model_ema.module, loader_eval, amp_autocast)
        if ema_metrics["top1"] > best_metric:
            best_metric = ema_metrics["top1"]
            save_checkpoint("model_best.pth.tar", epoch, model, optimizer, loss_scaler, model_ema, best_metric)
        print(f"epoch {epoch}: top1 {metrics['top1']:.2f} ema top1 {ema_metrics['top1']:.2f}")
    print(f"{benchmark_inference(model_ema.module):.0f} img/s (fp16 inference)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--mixup", action="store_true")
    parser.add_argument("--teacher", default="")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--head-warmup-epochs", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--model-ema-decay", type=float, default=0.9998)
    parser.add_argument("--model-ema-force-cpu", action="store_true")
    parser.add_argument("--log-interval", type=int, default=50)
    main(parser.parse_args(), loader_train=None, loader_eval=None)
