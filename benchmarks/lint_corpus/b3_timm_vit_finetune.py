"""ViT fine-tuning in the style of timm's train.py / MAE's main_finetune.py, with an optional distillation stage."""
import math
from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

NEG_INF = -1e9


class RmsNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, key_padding_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], NEG_INF)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = RmsNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = RmsNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x, key_padding_mask=None):
        x = x + self.attn(self.norm1(x), key_padding_mask)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, img_size=224, patch_size=16, num_classes=1000, embed_dim=768, depth=12, num_heads=12):
        super().__init__()
        self.num_prefix_tokens = 1
        self.patch_embed = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)
        num_patches = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, embed_dim) * 0.02)
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads) for _ in range(depth)])
        self.norm = RmsNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward_features(self, x, key_padding_mask=None):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x, key_padding_mask)
        x = self.norm(x)
        return x[:, self.num_prefix_tokens:].mean(dim=1)

    def forward(self, x, key_padding_mask=None):
        return self.head(self.forward_features(x, key_padding_mask))


def get_grad_norm_(parameters, norm_type: float = 2.0) -> torch.Tensor:
    parameters = [p for p in parameters if p.grad is not None]
    if len(parameters) == 0:
        return torch.tensor(0.0)
    device = parameters[0].grad.device
    return torch.norm(torch.stack([torch.norm(p.grad.detach(), norm_type).to(device) for p in parameters]), norm_type)


class NativeScalerWithGradNormCount:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, update_grad=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if update_grad:
            self._scaler.unscale_(optimizer)
            if clip_grad is not None:
                norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            else:
                norm = get_grad_norm_(parameters)
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            norm = None
        return norm

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        t = (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr


@torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
def head_loss(model, samples, targets):
    with torch.no_grad():
        feats = model.forward_features(samples)
    return F.cross_entropy(model.head(feats), targets)


def train_head_warmup(model, data_loader, device, epochs=1, lr=1e-3):
    """Linear-probe warm-up of the freshly initialised head before full fine-tuning."""
    model.train()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=lr, momentum=0.9)
    for _ in range(epochs):
        for samples, targets in data_loader:
            samples, targets = samples.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            loss = head_loss(model, samples, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, loss_scaler, amp_autocast, args):
    model.train(True)
    accum_iter = args.accum_iter
    optimizer.zero_grad()
    for it, (samples, targets) in enumerate(data_loader):
        if it % accum_iter == 0:
            adjust_learning_rate(optimizer, it / len(data_loader) + epoch, args)
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        update = (it + 1) % accum_iter == 0

        with amp_autocast():
            outputs = model(samples)
            loss = criterion(outputs, targets)
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                raise RuntimeError(f"Loss is {loss_value}, stopping training")
            loss = loss / accum_iter
            if loss_scaler is not None:
                loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters(), update_grad=update)  # expect: AMP008
        if loss_scaler is None:
            loss.backward()
            if update:
                if args.clip_grad is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()
        if update:
            optimizer.zero_grad()


def train_one_epoch_distill(model, teacher, data_loader, optimizer, device, loss_scaler, amp_autocast, args):
    model.train()
    T = args.kd_temperature
    for samples, targets in data_loader:
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.no_grad():
            teacher_logits = teacher(samples.half()).float()
        with amp_autocast():
            student_logits = model(samples)
            loss_ce = F.cross_entropy(student_logits, targets, label_smoothing=args.smoothing)
        loss_kd = F.kl_div(F.log_softmax(student_logits / T, dim=-1), F.log_softmax(teacher_logits / T, dim=-1), reduction="batchmean", log_target=True) * (T * T)  # expect: AMP002
        loss = (1.0 - args.kd_alpha) * loss_ce + args.kd_alpha * loss_kd
        optimizer.zero_grad()
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters())
        else:
            loss.backward()
            optimizer.step()


@torch.no_grad()
def evaluate(model, data_loader, device, amp_autocast):
    model.eval()
    correct, total = 0, 0
    for images, target in data_loader:
        images, target = images.to(device), target.to(device)
        with amp_autocast():
            output = model(images)
            loss = F.cross_entropy(output, target)
        correct += (output.argmax(-1) == target).sum().item()
        total += target.numel()
    return 100.0 * correct / total, loss.item()


def main(args, train_loader, val_loader):
    device = torch.device(args.device)
    use_amp = args.amp
    amp_dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
    amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype) if use_amp else suppress
    loss_scaler = NativeScalerWithGradNormCount() if use_amp and amp_dtype == torch.float16 else None

    model = VisionTransformer(num_classes=args.nb_classes).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos_embed" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.999))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.smoothing)

    teacher = None
    if args.teacher_path:
        teacher = VisionTransformer(num_classes=args.nb_classes)
        teacher.load_state_dict(torch.load(args.teacher_path, map_location="cpu"))
        teacher = teacher.to(device).half().eval()
        teacher.requires_grad_(False)

    if args.head_warmup_epochs > 0:
        train_head_warmup(model, train_loader, device, epochs=args.head_warmup_epochs)
    for epoch in range(args.epochs):
        if teacher is not None and epoch >= args.kd_start_epoch:
            train_one_epoch_distill(model, teacher, train_loader, optimizer, device, loss_scaler, amp_autocast, args)
        else:
            train_one_epoch(model, criterion, train_loader, optimizer, device, epoch, loss_scaler, amp_autocast, args)
        acc, val_loss = evaluate(model, val_loader, device, amp_autocast)
        print(f"epoch {epoch}: acc1 {acc:.2f} val_loss {val_loss:.4f}")
        to_save = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
        if loss_scaler is not None:
            to_save[loss_scaler.state_dict_key] = loss_scaler.state_dict()
        torch.save(to_save, f"{args.output_dir}/checkpoint-{epoch}.pth")
