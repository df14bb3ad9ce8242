"""Fine-tune a pretrained ViT (MAE / BEiT recipe): layer-wise lr decay, mixup/cutmix, EMA.

    torchrun --nproc_per_node 8 b17_vit_finetune.py --model vit_base_patch16_224 \
        --data /datasets/imagenet --epochs 100 --blr 5e-4 --layer_decay 0.65
"""
import argparse
import copy
import json
import math
import os
import time

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import Mixup, create_transform
from torchvision import datasets


def get_layer_id_for_vit(name, num_layers):
    if name in ("backbone.cls_token", "backbone.pos_embed") or name.startswith("backbone.patch_embed"):
        return 0
    if name.startswith("backbone.blocks."):
        return int(name.split(".")[2]) + 1
    return num_layers


def param_groups_lrd(model, weight_decay=0.05, no_weight_decay_list=(), layer_decay=0.75):
    num_layers = len(model.backbone.blocks) + 1
    layer_scales = [layer_decay ** (num_layers - i) for i in range(num_layers + 1)]
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 1 or n in no_weight_decay_list:
            g_decay, this_decay = "no_decay", 0.0
        else:
            g_decay, this_decay = "decay", weight_decay
        layer_id = get_layer_id_for_vit(n, num_layers)
        key = f"layer_{layer_id}_{g_decay}"
        if key not in groups:
            groups[key] = {"lr_scale": layer_scales[layer_id], "weight_decay": this_decay, "params": []}
        groups[key]["params"].append(p)
    return list(groups.values())


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        t = (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    for pg in optimizer.param_groups:
        pg["lr"] = lr * pg.get("lr_scale", 1.0)
    return lr


class SoftTargetCrossEntropyLoss(nn.Module):
    def forward(self, x, target):
        loss = torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
        return loss.mean()


class AttentionPoolHead(nn.Module):
    """Single-query attention pooling with a mean-token shortcut."""

    def __init__(self, dim, num_classes, num_heads=12, drop=0.1):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.query = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.shortcut = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(drop)
        self.fc = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.query, std=0.02)
        nn.init.zeros_(self.fc.weight)

    def forward(self, x):
        B, N, C = x.shape
        h = self.num_heads
        k, v = self.kv(x).reshape(B, N, 2, h, C // h).permute(2, 0, 3, 1, 4).unbind(0)
        q = self.q(self.query).expand(B, -1, -1).reshape(B, 1, h, C // h).transpose(1, 2)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        pooled = (attn @ v).transpose(1, 2).reshape(B, C)
        # the checkpoints were pretrained with a GAP head; keep that signal as a shortcut
        gap = self.shortcut(x).mean(dim=1)  # expect: AMP004
        return self.fc(self.drop(self.norm(pooled + gap)))


class ViTWithAttnPool(nn.Module):
    def __init__(self, name, num_classes, drop_path=0.1, pretrained=True):
        super().__init__()
        self.backbone = timm.create_model(name, pretrained=pretrained, num_classes=0, global_pool="",
                                          drop_path_rate=drop_path)
        self.head = AttentionPoolHead(self.backbone.embed_dim, num_classes)

    def forward(self, x):
        tokens = self.backbone.forward_features(x)
        return self.head(tokens[:, self.backbone.num_prefix_tokens:])


class ModelEma:
    def __init__(self, model, decay=0.9999):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.dtype.is_floating_point:
                ema_v.copy_(ema_v * self.decay + (1.0 - self.decay) * model_v)


def get_grad_norm_(parameters, norm_type=2.0):
    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        return torch.tensor(0.0)
    device = parameters[0].grad.device
    norms = [torch.norm(p.grad.detach(), norm_type).to(device) for p in parameters]
    return torch.norm(torch.stack(norms), norm_type)


class NativeScalerWithGradNormCount:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, update_grad=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if not update_grad:
            return None
        if clip_grad is not None:
            assert parameters is not None
            norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)  # expect: AMP005
        else:
            self._scaler.unscale_(optimizer)
            norm = get_grad_norm_(parameters)
        self._scaler.step(optimizer)
        self._scaler.update()
        return norm

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, loss_scaler,
                    max_norm, mixup_fn, model_ema, args):
    model.train(True)
    accum_iter = args.accum_iter
    optimizer.zero_grad()
    t0 = time.time()
    for it, (samples, targets) in enumerate(data_loader):
        if it % accum_iter == 0:
            adjust_learning_rate(optimizer, it / len(data_loader) + epoch, args)
        samples = samples.to(device, dtype=torch.float16, non_blocking=True)  # expect: AMP001
        targets = targets.to(device, non_blocking=True)
        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(samples)
        loss = criterion(outputs, targets)  # expect: AMP002
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise RuntimeError(f"loss is {loss_value}, stopping training")
        loss = loss / accum_iter
        update = (it + 1) % accum_iter == 0
        grad_norm = loss_scaler(loss, optimizer, clip_grad=max_norm, parameters=model.parameters(),
                                update_grad=update)
        if update:
            optimizer.zero_grad()
            if model_ema is not None:
                model_ema.update(model)
        if it % args.print_freq == 0:
            lr = max(pg["lr"] for pg in optimizer.param_groups)
            gn = float(grad_norm) if grad_norm is not None else float("nan")
            print(f"ep {epoch} it {it} loss {loss_value:.4f} lr {lr:.2e} gn {gn:.2f} {time.time() - t0:.1f}s")


def warmup_head(model, data_loader, optimizer, device, loss_scaler, iters=500):
    """Train only the freshly initialised head for a few hundred steps before unfreezing."""
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    model.train()
    for it, (samples, targets) in enumerate(data_loader):
        if it >= iters:
            break
        samples, targets = samples.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(samples), targets, label_smoothing=0.1)
            loss_scaler(loss, optimizer, parameters=model.head.parameters())  # expect: AMP008
        optimizer.zero_grad(set_to_none=True)
    for p in model.backbone.parameters():
        p.requires_grad_(True)


@torch.no_grad()
def evaluate(data_loader, model, device):
    criterion = nn.CrossEntropyLoss()
    model.eval()
    n, loss_sum, top1 = 0, 0.0, 0
    for images, target in data_loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():  # expect: AMP009
            output = model(images)
            loss = criterion(output, target)
        loss_sum += loss.item() * images.size(0)
        top1 += (output.argmax(-1) == target).sum().item()
        n += images.size(0)
    return {"loss": loss_sum / n, "acc1": 100.0 * top1 / n}


def export_torchscript(model, path, img_size=224):
    m = copy.deepcopy(model).eval().half().cuda()
    example = torch.randn(1, 3, img_size, img_size, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        traced = torch.jit.trace(m, example)
    traced.save(path)


def main(args):
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    t_train = create_transform(args.input_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                               re_prob=0.25, interpolation="bicubic")
    t_val = create_transform(args.input_size, is_training=False, interpolation="bicubic")
    ds_train = datasets.ImageFolder(os.path.join(args.data, "train"), t_train)
    ds_val = datasets.ImageFolder(os.path.join(args.data, "val"), t_val)
    dl_train = torch.utils.data.DataLoader(ds_train, batch_size=args.batch_size, shuffle=True,
                                           num_workers=10, pin_memory=True, drop_last=True)
    dl_val = torch.utils.data.DataLoader(ds_val, batch_size=2 * args.batch_size, num_workers=10)

    model = ViTWithAttnPool(args.model, args.nb_classes, drop_path=args.drop_path).to(device)
    mixup_fn = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                         num_classes=args.nb_classes)
    criterion = SoftTargetCrossEntropyLoss() if mixup_fn is not None else nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    eff_bs = args.batch_size * args.accum_iter * int(os.environ.get("WORLD_SIZE", 1))
    args.lr = args.blr * eff_bs / 256
    groups = param_groups_lrd(model, args.weight_decay, model.backbone.no_weight_decay(), args.layer_decay)
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    loss_scaler = NativeScalerWithGradNormCount()
    model_ema = ModelEma(model, decay=args.ema_decay) if args.ema_decay > 0 else None

    warmup_head(model, dl_train, optimizer, device, loss_scaler, iters=args.head_warmup_iters)
    best = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, dl_train, optimizer, device, epoch, loss_scaler,
                        args.clip_grad, mixup_fn, model_ema, args)
        stats = evaluate(dl_val, model, device)
        if model_ema is not None:
            stats["ema_acc1"] = evaluate(dl_val, model_ema.module, device)["acc1"]
        if stats["acc1"] > best:
            best = stats["acc1"]
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": loss_scaler.state_dict(), "epoch": epoch}, os.path.join(args.output_dir, "best.pth"))
        print(json.dumps({"epoch": epoch, **stats, "best": best}))
    export_torchscript(model, os.path.join(args.output_dir, "model_fp16.ts"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--data", required=True)
    p.add_argument("--output_dir", default="out")
    p.add_argument("--input_size", type=int, default=224)
    p.add_argument("--nb_classes", type=int, default=1000)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--accum_iter", type=int, default=1)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--warmup_epochs", type=int, default=5)
    p.add_argument("--blr", type=float, default=5e-4)
    p.add_argument("--min_lr", type=float, default=1e-6)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--layer_decay", type=float, default=0.65)
    p.add_argument("--drop_path", type=float, default=0.1)
    p.add_argument("--clip_grad", type=float, default=None)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--head_warmup_iters", type=int, default=500)
    p.add_argument("--print_freq", type=int, default=50)
    main(p.parse_args())
