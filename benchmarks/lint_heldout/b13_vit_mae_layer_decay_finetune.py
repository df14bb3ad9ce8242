# --------------------------------------------------------
# Fine-tuning a MAE-pretrained ViT-B/16 with layer-wise lr decay (MAE main_finetune style)
# --------------------------------------------------------
import argparse
import math
import sys
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKEN_DROP_KEEP = 0.7


class Attention(nn.Module):
    def __init__(self, dim, num_heads=12, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, keep_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if keep_mask is not None:
            attn = attn.masked_fill(~keep_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x, keep_mask=None):
        x = x + self.attn(self.norm1(x), keep_mask)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, img_size=224, patch=16, dim=768, depth=12, heads=12, num_classes=1000, drop_tokens=False):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        n = (img_size // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        self.drop_tokens = drop_tokens

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        keep = None
        if self.drop_tokens and self.training:
            keep = torch.rand(x.shape[:2], device=x.device) < TOKEN_DROP_KEEP
            keep[:, 0] = True
        for blk in self.blocks:
            x = blk(x, keep)
        x = x[:, 1:, :].mean(dim=1)
        return self.head(self.fc_norm(x))


def param_groups_lrd(model, weight_decay=0.05, layer_decay=0.75):
    num_layers = len(model.blocks) + 1
    scales = [layer_decay ** (num_layers - i) for i in range(num_layers + 1)]
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim == 1 or n in ("pos_embed", "cls_token")
        if n.startswith(("cls_token", "pos_embed", "patch_embed")):
            layer_id = 0
        elif n.startswith("blocks"):
            layer_id = int(n.split(".")[1]) + 1
        else:
            layer_id = num_layers
        key = f"layer_{layer_id}_{'no_decay' if no_decay else 'decay'}"
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                           "lr_scale": scales[layer_id]}
        groups[key]["params"].append(p)
    return list(groups.values())


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        return torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1).mean()


class NativeScalerWithGradNormCount:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, update_grad=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        norm = None
        if update_grad:
            self._scaler.unscale_(optimizer)
            if clip_grad is not None:
                norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()
        return norm

    def state_dict(self):
        return self._scaler.state_dict()


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (
            1.0 + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    return lr


def train_one_epoch(model, criterion, loader, optimizer, device, epoch, loss_scaler, args, teacher=None):
    model.train(True)
    accum_iter = args.accum_iter
    optimizer.zero_grad()
    for it, (samples, targets) in enumerate(loader):
        if it % accum_iter == 0:
            adjust_learning_rate(optimizer, it / len(loader) + epoch, args)
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)

        with torch.cuda.amp.autocast():  # expect: AMP009
            outputs = model(samples)
            loss = criterion(outputs, targets)
        if teacher is not None:
            with torch.no_grad():
                teacher_out = teacher(samples)
            T = args.distill_tau
            loss = loss + args.distill_alpha * T * T * F.kl_div(  # expect: AMP002
                F.log_softmax(outputs / T, dim=-1), F.softmax(teacher_out.float() / T, dim=-1), reduction="batchmean")

        loss_value = loss.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)
        loss /= accum_iter
        loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters(),
                    update_grad=(it + 1) % accum_iter == 0)
        if (it + 1) % accum_iter == 0:
            optimizer.zero_grad()
        torch.cuda.synchronize()


def linear_probe_warmup(model, loader, device, steps=500):
    """Train only the head for a few hundred steps before unfreezing the backbone."""
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith(("head", "fc_norm")))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    for step, (samples, targets) in enumerate(loader):
        if step == steps:
            break
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(samples.to(device)), targets.to(device))
        loss = scaler.scale(loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.head.parameters(), 1.0)  # expect: AMP005
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.requires_grad_(True)


@torch.no_grad()
def evaluate(loader, model, device):
    model.eval()
    correct, total = 0, 0
    for images, target in loader:
        images, target = images.to(device), target.to(device)
        with torch.amp.autocast("cuda"):
            output = model(images)
        correct += (output.argmax(-1) == target).sum().item()
        total += target.numel()
    return 100.0 * correct / total


def main(args, train_loader, val_loader, teacher=None):
    device = torch.device("cuda")
    model = VisionTransformer(num_classes=args.nb_classes, drop_tokens=args.token_drop).to(device)
    ckpt = torch.load(args.finetune, map_location="cpu")
    model.load_state_dict(ckpt["model"], strict=False)
    linear_probe_warmup(model, train_loader, device)
    optimizer = torch.optim.AdamW(param_groups_lrd(model, args.weight_decay, args.layer_decay), lr=args.lr)
    loss_scaler = NativeScalerWithGradNormCount()
    criterion = SoftTargetCrossEntropy() if args.mixup > 0 else nn.CrossEntropyLoss(label_smoothing=0.1)
    best = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, train_loader, optimizer, device, epoch, loss_scaler, args, teacher)
        acc = evaluate(val_loader, model, device)
        if acc > best:
            best = acc
            torch.save({"model": model.state_dict(), "scaler": loss_scaler.state_dict(), "epoch": epoch},
                       f"{args.output_dir}/checkpoint-best.pth")
        print(f"epoch {epoch}: acc1 {acc:.2f} (best {best:.2f})")
