"""ViT-B/16 ImageNet-1k recipe (timm style): AdamW, mixup, EMA, DeiT distillation, fp16/bf16."""
import argparse
import copy
import time
from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


class Attention(nn.Module):
    def __init__(self, dim, num_heads=12):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, keep_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if keep_mask is not None:
            attn = attn.masked_fill(~keep_mask[:, None, None, :], torch.finfo(attn.dtype).min)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, img_size=224, patch=16, dim=768, depth=12, heads=12, num_classes=1000,
                 global_pool="token"):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (img_size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.global_pool = global_pool
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        x = x[:, 1:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        return self.head(x)


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        return torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1).mean()


class NativeScaler:
    def __init__(self):
        self._scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None):
        self._scaler.scale(loss).backward()
        if clip_grad is not None:
            self._scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        self._scaler.step(optimizer)
        self._scaler.update()


class ModelEma:
    def __init__(self, model, decay=0.9998):
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.is_floating_point():
                e.lerp_(m.detach(), 1.0 - self.decay)


def train_one_epoch(model, loader, optimizer, criterion, amp_autocast, loss_scaler, model_ema, mixup_fn, args):
    model.train()
    for images, target in loader:
        images, target = images.cuda(non_blocking=True), target.cuda(non_blocking=True)
        if mixup_fn is not None:
            images, target = mixup_fn(images, target)
        with amp_autocast():
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters())
        else:
            loss.backward()
            if args.clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
        if model_ema is not None:
            model_ema.update(model)


def train_one_epoch_distill(model, teacher, loader, optimizer, loss_scaler, args):
    model.train()
    T = args.distill_tau
    for images, target in loader:
        images, target = images.cuda(non_blocking=True), target.cuda(non_blocking=True)
        with torch.no_grad():
            teacher_logits = teacher(images.half()).float()
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
            base_loss = F.cross_entropy(output, target, label_smoothing=args.smoothing)
        s_logp = F.log_softmax(output / T, dim=1)
        t_logp = F.log_softmax(teacher_logits / T, dim=1)
        distill_loss = F.kl_div(s_logp, t_logp, reduction="batchmean", log_target=True) * (T * T)  # expect: AMP002
        loss = base_loss * (1 - args.distill_alpha) + distill_loss * args.distill_alpha
        optimizer.zero_grad(set_to_none=True)
        loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters())


def warmup_head(model, loader, num_classes, steps, lr=1e-3):
    """Linear-probe warm-up of a re-initialised head before full fine-tuning at 384px."""
    model.head = nn.Linear(model.head.in_features, num_classes).cuda()
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    optimizer = torch.optim.SGD(model.head.parameters(), lr=lr, momentum=0.9)
    model.train()
    for step, (images, target) in enumerate(loader):
        images, target = images.cuda(non_blocking=True), target.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            output = model(images)
            loss = F.cross_entropy(output, target, label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 >= steps:
            break
    model.requires_grad_(True)


def benchmark_train_throughput(model, batch_size=128, img_size=224, steps=30):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(batch_size, 3, img_size, img_size, device="cuda")
    y = torch.randint(0, 1000, (batch_size,), device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # expect: AMP008
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return steps * batch_size / (time.perf_counter() - start)


@torch.no_grad()
def validate(model, loader, amp_autocast):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for images, target in loader:
        images, target = images.cuda(non_blocking=True), target.cuda(non_blocking=True)
        with amp_autocast():
            output = model(images)
            loss_sum += F.cross_entropy(output, target, reduction="sum").item()
        correct += (output.argmax(-1) == target).sum().item()
        total += target.numel()
    return loss_sum / total, 100.0 * correct / total


def build_teacher():
    teacher = torchvision.models.regnet_y_16gf(weights="IMAGENET1K_SWAG_E2E_V1")
    teacher.requires_grad_(False)
    return teacher.cuda().half().eval()


def main(args):
    model = VisionTransformer(global_pool="avg").cuda()
    groups = [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.05},
              {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, eps=1e-8)
    amp_dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
    amp_autocast, loss_scaler = suppress, None
    if args.amp:
        amp_autocast = partial(torch.autocast, device_type="cuda", dtype=amp_dtype)
        if amp_dtype == torch.float16:
            loss_scaler = NativeScaler()
    model_ema = ModelEma(model) if args.model_ema else None
    criterion = SoftTargetCrossEntropy() if args.mixup > 0 else nn.CrossEntropyLoss(label_smoothing=0.1)
    train_loader, val_loader, mixup_fn = build_data(args)  # noqa: F821  (project helper)
    best_acc = -1e9
    for epoch in range(args.epochs):
        if args.distill:
            train_one_epoch_distill(model, build_teacher(), train_loader, optimizer, NativeScaler(), args)
        else:
            train_one_epoch(model, train_loader, optimizer, criterion, amp_autocast, loss_scaler,
                            model_ema, mixup_fn, args)
        _, acc = validate(model_ema.module if model_ema else model, val_loader, amp_autocast)
        if acc > best_acc:
            best_acc = acc
            torch.save({"model": model.state_dict(), "epoch": epoch}, "vit_best.pth")
    print(f"best top-1 {best_acc:.2f}, {benchmark_train_throughput(model):.0f} img/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--amp", "--model-ema", "--distill"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--amp-dtype", default="float16")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--clip-grad", type=float, default=None)
    for flag, default in (("--lr", 1e-3), ("--mixup", 0.8), ("--smoothing", 0.1),
                          ("--distill-tau", 3.0), ("--distill-alpha", 0.5)):
        parser.add_argument(flag, type=float, default=default)
    main(parser.parse_args())
