"""Vision Transformer with token dropping, an attention-pool head and DeiT distillation.

Layout follows timm / DeiT: ``norm_layer`` / ``act_layer`` factories, a
``forward_features`` / ``forward_head`` split, builder functions collected in a
registry, a timm-style ``NativeScaler`` and ``train_one_epoch`` / ``evaluate``.
"""
import copy
import math
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class NativeScaler:
    """Backward, optional unscale + clip, step and update in one call (timm)."""

    def __init__(self):
        self._scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if clip_grad is not None:
            assert parameters is not None
            self._scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        self._scaler.step(optimizer)
        self._scaler.update()


class DropPath(nn.Module):
    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class PatchEmbed(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, attn_drop=0.0, track_logits=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.track_logits = track_logits
        self.register_buffer("logit_std", torch.zeros(()), persistent=False)

    def forward(self, x, key_padding_mask: Optional[torch.Tensor] = None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if self.track_logits and self.training:
            # ViT-22B style monitoring of attention-logit growth
            self.logit_std = attn.detach().std()  # expect: AMP004
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = attn.softmax(dim=-1)
        cls_attn = attn[:, :, 0, 1:].mean(dim=1)
        x = (self.attn_drop(attn) @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x), cls_attn


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=True, drop_path=0.0, keep_rate=1.0,
                 act_layer=nn.GELU, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, track_logits=True)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer)
        self.keep_rate = keep_rate

    def forward(self, x, key_padding_mask=None):
        h, cls_attn = self.attn(self.norm1(x), key_padding_mask)
        x = x + self.drop_path(h)
        if self.keep_rate < 1.0:
            x = self._keep_topk(x, cls_attn)
        return x + self.drop_path(self.mlp(self.norm2(x)))

    def _keep_topk(self, x, cls_attn):
        """EViT: keep the tokens the class token attends to most, fuse the others into one."""
        n_tokens = x.shape[1] - 1
        n_keep = math.ceil(self.keep_rate * n_tokens)
        order = cls_attn.argsort(dim=-1, descending=True)
        keep_idx, drop_idx = order[:, :n_keep], order[:, n_keep:]
        tokens = x[:, 1:]
        kept = tokens.gather(1, keep_idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        dropped = tokens.gather(1, drop_idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        w = cls_attn.gather(1, drop_idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-8)
        fused = (dropped * w.unsqueeze(-1).to(dropped.dtype)).sum(dim=1, keepdim=True)
        return torch.cat([x[:, :1], kept, fused], dim=1)


class AttentionPoolHead(nn.Module):
    """Attention pooling with a learned latent query (timm ``AttentionPoolLatent``)."""

    def __init__(self, dim, num_heads=8, mlp_ratio=4.0, latent_len=1, pool="avg", norm_layer=nn.LayerNorm):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.pool = pool
        self.latent = nn.Parameter(torch.zeros(1, latent_len, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, dim * 2)
        self.proj = nn.Linear(dim, dim)
        self.norm = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        B, N, C = x.shape
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, -1, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        x = self.proj(x.transpose(1, 2).reshape(B, -1, C))
        x = x + self.mlp(self.norm(x))
        if self.pool == "token":
            return x[:, 0]
        return x.mean(dim=1)  # expect: AMP004


class VisionTransformer(nn.Module):
    def __init__(self, img_size=224, patch_size=16, num_classes=1000, global_pool="token", embed_dim=768,
                 depth=12, num_heads=12, mlp_ratio=4.0, drop_path_rate=0.0,
                 keep_rates=None, distilled=False, norm_layer=None, act_layer=None):
        super().__init__()
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU
        self.global_pool = global_pool
        self.num_prefix_tokens = 2 if distilled else 1
        self.patch_embed = PatchEmbed(img_size, patch_size, 3, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + self.num_prefix_tokens, embed_dim) * 0.02)
        dpr = [r.item() for r in torch.linspace(0, drop_path_rate, depth)]
        keep_rates = keep_rates or [1.0] * depth
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, mlp_ratio, drop_path=dpr[i], keep_rate=keep_rates[i],
                  act_layer=act_layer, norm_layer=norm_layer)
            for i in range(depth)
        ])
        self.norm = norm_layer(embed_dim)
        self.attn_pool = AttentionPoolHead(embed_dim, num_heads, norm_layer=norm_layer) if global_pool == "map" else None
        self.head = nn.Linear(embed_dim, num_classes)
        self.head_dist = nn.Linear(embed_dim, num_classes) if distilled else None

    def _pos_embed(self, x):
        prefix = [self.cls_token.expand(x.shape[0], -1, -1)]
        if self.dist_token is not None:
            prefix.append(self.dist_token.expand(x.shape[0], -1, -1))
        return torch.cat(prefix + [x], dim=1) + self.pos_embed

    def forward_features(self, x, key_padding_mask=None):
        x = self._pos_embed(self.patch_embed(x))
        for blk in self.blocks:
            x = blk(x, key_padding_mask)
        return self.norm(x)

    def forward_head(self, x, pre_logits=False):
        if self.attn_pool is not None:
            x_cls = x_dist = self.attn_pool(x)
        elif self.global_pool == "avg":
            x_cls = x_dist = x[:, self.num_prefix_tokens:].mean(dim=1)
        else:
            x_cls, x_dist = x[:, 0], x[:, self.num_prefix_tokens - 1]
        if pre_logits:
            return x_cls, x_dist
        return self.head(x_cls), self.head_dist(x_dist) if self.head_dist is not None else None

    def forward(self, x, key_padding_mask=None):
        x_cls, x_dist = self.forward_head(self.forward_features(x, key_padding_mask))
        if x_dist is None:
            return x_cls
        if self.training:
            return x_cls, x_dist
        return (x_cls + x_dist) / 2


def vit_small_patch16_224(**kwargs):
    return VisionTransformer(embed_dim=384, depth=12, num_heads=6, **kwargs)


VIT_MODELS = {
    "vit_small_patch16_224": vit_small_patch16_224,
    "vit_base_patch16_224": lambda **kw: VisionTransformer(embed_dim=768, depth=12, num_heads=12, **kw),
    "deit_small_distilled_evit": lambda **kw: VisionTransformer(
        embed_dim=384, depth=12, num_heads=6, distilled=True, keep_rates=[1.0] * 3 + [0.7] + [1.0] * 8, **kw),
}


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        loss = torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
        return loss.mean()


class DistillationLoss(nn.Module):
    """DeiT: base criterion on the class token, soft/hard distillation on the dist token."""

    def __init__(self, base_criterion, teacher_model, distillation_type="soft", alpha=0.5, tau=1.0):
        super().__init__()
        self.base_criterion = base_criterion
        self.teacher_model = teacher_model
        self.distillation_type = distillation_type
        self.alpha = alpha
        self.tau = tau

    def forward(self, inputs, outputs, labels):
        outputs_kd = None
        if isinstance(outputs, tuple):
            outputs, outputs_kd = outputs
        base_loss = self.base_criterion(outputs, labels)
        if self.distillation_type == "none" or outputs_kd is None:
            return base_loss
        with torch.no_grad():
            teacher_outputs = self.teacher_model(inputs)
        if self.distillation_type == "soft":
            T = self.tau
            distillation_loss = F.kl_div(
                F.log_softmax(outputs_kd / T, dim=1), F.log_softmax(teacher_outputs / T, dim=1),
                reduction="sum", log_target=True) * (T * T) / outputs_kd.numel()
        else:
            distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))
        return base_loss * (1 - self.alpha) + distillation_loss * self.alpha


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, loss_scaler, max_norm=None):
    model.train()
    for step, (samples, targets) in enumerate(data_loader):
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            outputs = model(samples)
            loss = criterion(samples, outputs, targets)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise SystemExit(f"Loss is {loss_value}, stopping training")
        optimizer.zero_grad()
        is_second_order = getattr(optimizer, "is_second_order", False)
        loss_scaler(loss, optimizer, clip_grad=max_norm, parameters=model.parameters(), create_graph=is_second_order)
        if step % 50 == 0:
            print(f"epoch {epoch} step {step} loss {loss_value:.4f}")


@torch.no_grad()
def evaluate(data_loader, model, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for images, target in data_loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            output = model(images)
            loss = F.cross_entropy(output, target)
        loss_sum += loss.item() * target.numel()
        correct += (output.argmax(dim=-1) == target).sum().item()
        total += target.numel()
    return {"acc1": 100.0 * correct / total, "loss": loss_sum / total}


def export_half(model, path):
    """Compact fp16 checkpoint for serving."""
    model_half = copy.deepcopy(model).half().eval()
    torch.save(model_half.state_dict(), path)


def main(args, data_loader_train, data_loader_val):
    device = torch.device(args.device)
    model = VIT_MODELS[args.model](num_classes=args.nb_classes, drop_path_rate=args.drop_path, global_pool=args.global_pool)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = DDP(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    optimizer = torch.optim.AdamW(model_without_ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    loss_scaler = NativeScaler()
    teacher = VIT_MODELS[args.teacher_model](num_classes=args.nb_classes)
    teacher.load_state_dict(torch.load(args.teacher_path, map_location="cpu"))
    teacher.to(device).eval()
    criterion = DistillationLoss(SoftTargetCrossEntropy(), teacher, args.distillation_type,
                                 args.distillation_alpha, args.distillation_tau)
    for epoch in range(args.start_epoch, args.epochs):
        train_one_epoch(model, criterion, data_loader_train, optimizer, device, epoch, loss_scaler, args.clip_grad)
        stats = evaluate(data_loader_val, model, device)
        print(f"epoch {epoch}: acc1 {stats['acc1']:.2f}")
    export_half(model_without_ddp, args.output_dir + "/model_fp16.pth")
