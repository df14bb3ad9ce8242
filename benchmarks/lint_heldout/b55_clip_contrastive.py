"""CLIP-style contrastive image-text pretraining with a learnable temperature.

Kaggle notebook exported to a script: image-caption dataset stub, ViT image tower,
causal text transformer, symmetric InfoNCE loss, fp16 autocast, zero-shot eval.
"""
import argparse
import copy
import math
import os
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

CONTEXT_LENGTH, VOCAB_SIZE, SOT, EOT = 77, 49408, 49406, 49407
MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)


class ImageTextDataset(Dataset):
    """Stub for an image-caption csv: random images and BPE token ids ending in EOT."""

    def __init__(self, n=20000, resolution=224):
        self.n, self.resolution = n, resolution

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        image = (torch.rand(3, self.resolution, self.resolution) - MEAN) / STD
        tokens = torch.zeros(CONTEXT_LENGTH, dtype=torch.long)
        length = np.random.randint(5, CONTEXT_LENGTH - 1)
        tokens[0] = SOT
        tokens[1:length] = torch.randint(1, SOT, (length - 1,))
        tokens[length] = EOT
        return image, tokens


class LayerNorm(nn.LayerNorm):
    """Subclass torch's LayerNorm to handle fp16 weights: compute in fp32, cast back."""

    def forward(self, x):
        orig_type = x.dtype
        ret = super().forward(x.type(torch.float32))
        return ret.type(orig_type)


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model, n_head, attn_mask=None):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, n_head)
        self.ln_1 = LayerNorm(d_model)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(d_model, d_model * 4)), ("gelu", QuickGELU()),
                                              ("c_proj", nn.Linear(d_model * 4, d_model))]))
        self.ln_2 = LayerNorm(d_model)
        self.attn_mask = attn_mask

    def attention(self, x):
        mask = self.attn_mask.to(dtype=x.dtype, device=x.device) if self.attn_mask is not None else None
        return self.attn(x, x, x, need_weights=False, attn_mask=mask)[0]

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, width, layers, heads, attn_mask=None):
        super().__init__()
        self.resblocks = nn.Sequential(*[ResidualAttentionBlock(width, heads, attn_mask) for _ in range(layers)])

    def forward(self, x):
        return self.resblocks(x)


class VisionTransformer(nn.Module):
    def __init__(self, input_resolution, patch_size, width, layers, heads, output_dim):
        super().__init__()
        scale = width**-0.5
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn((input_resolution // patch_size) ** 2 + 1, width))
        self.ln_pre = LayerNorm(width)
        self.transformer = Transformer(width, layers, heads)
        self.ln_post = LayerNorm(width)
        self.proj = nn.Parameter(scale * torch.randn(width, output_dim))

    def forward(self, x):
        x = self.conv1(x)
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
        cls = self.class_embedding.to(x.dtype) + torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype, device=x.device)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        x = self.ln_pre(x).permute(1, 0, 2)
        x = self.transformer(x).permute(1, 0, 2)
        return self.ln_post(x[:, 0, :]) @ self.proj


class CLIP(nn.Module):
    def __init__(self, embed_dim=512, image_resolution=224, vision_layers=12, vision_width=768, vision_patch_size=32,
                 transformer_width=512, transformer_heads=8, transformer_layers=12):
        super().__init__()
        self.context_length = CONTEXT_LENGTH
        self.visual = VisionTransformer(image_resolution, vision_patch_size, vision_width, vision_layers,
                                        vision_width // 64, embed_dim)
        self.transformer = Transformer(transformer_width, transformer_layers, transformer_heads, self.build_attention_mask())
        self.token_embedding = nn.Embedding(VOCAB_SIZE, transformer_width)
        self.positional_embedding = nn.Parameter(torch.empty(CONTEXT_LENGTH, transformer_width))
        self.ln_final = LayerNorm(transformer_width)
        self.text_projection = nn.Parameter(torch.empty(transformer_width, embed_dim))
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        nn.init.normal_(self.text_projection, std=transformer_width**-0.5)

    def build_attention_mask(self):
        mask = torch.empty(self.context_length, self.context_length)
        mask.fill_(float("-inf"))
        return mask.triu_(1)

    def encode_image(self, image):
        return self.visual(image)

    def encode_text(self, text):
        x = self.token_embedding(text) + self.positional_embedding
        x = self.transformer(x.permute(1, 0, 2)).permute(1, 0, 2)
        x = self.ln_final(x)
        return x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.text_projection

    def forward(self, image, text):
        image_features = self.encode_image(image)
        text_features = self.encode_text(text)
        image_features = image_features / image_features.norm(dim=1, keepdim=True)
        text_features = text_features / text_features.norm(dim=1, keepdim=True)
        logit_scale = self.logit_scale.exp()
        logits_per_image = logit_scale * image_features @ text_features.t()
        return logits_per_image, logits_per_image.t()


def clip_loss(logits_per_image, logits_per_text):
    labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def cosine_lr(optimizer, base_lr, warmup_length, steps):
    def _lr_adjuster(step):
        if step < warmup_length:
            lr = base_lr * (step + 1) / warmup_length
        else:
            lr = 0.5 * (1 + np.cos(np.pi * (step - warmup_length) / (steps - warmup_length))) * base_lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    return _lr_adjuster


def train_one_epoch(model, loader, optimizer, scheduler, epoch, args):
    model.train()
    for i, (images, texts) in enumerate(loader):
        scheduler(epoch * len(loader) + i)
        images, texts = images.cuda(non_blocking=True), texts.cuda(non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            logits_per_image, logits_per_text = model(images, texts)
        loss = clip_loss(logits_per_image, logits_per_text)  # expect: AMP002
        loss.backward()
        if args.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip_norm, norm_type=2.0)
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if i % args.log_every == 0:
            print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.4f} "
                  f"logit_scale {model.logit_scale.exp().item():.2f} lr {optimizer.param_groups[0]['lr']:.2e}")


@torch.no_grad()
def zero_shot_eval(model, loader, class_tokens):
    model.eval()
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        class_emb = model.encode_text(class_tokens.cuda())
        class_emb = class_emb / class_emb.norm(dim=-1, keepdim=True)
    top1, n = 0, 0
    for images, target in loader:
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            img_emb = model.encode_image(images.cuda(non_blocking=True))
            img_emb = img_emb / img_emb.norm(dim=-1, keepdim=True)
            logits = 100.0 * img_emb @ class_emb.t()
        top1 += (logits.argmax(dim=-1).cpu() == target).sum().item()
        n += target.numel()
    model.train()
    return top1 / max(n, 1)


def save_checkpoint(model, optimizer, epoch, path):
    torch.save({"epoch": epoch, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def export_text_encoder(model, path):
    encoder = copy.deepcopy(model).half().eval()
    torch.save({k: v for k, v in encoder.state_dict().items() if not k.startswith("visual.")}, path)


def main(args):
    torch.manual_seed(args.seed)
    model = CLIP(embed_dim=args.embed_dim)
    if args.pretrained:
        model.load_state_dict(torch.load(args.pretrained, map_location="cpu"))
    model = model.cuda().half()  # expect: AMP001
    named = list(model.named_parameters())
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n  # noqa: E731
    gain_or_bias = [p for n, p in named if exclude(n, p) and p.requires_grad]
    rest = [p for n, p in named if not exclude(n, p) and p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": gain_or_bias, "weight_decay": 0.0}, {"params": rest, "weight_decay": args.wd}], lr=args.lr, betas=(0.9, 0.98), eps=1e-8)  # expect: AMP011
    loader = DataLoader(ImageTextDataset(), batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    eval_loader = DataLoader([(torch.randn(3, 224, 224), i % 10) for i in range(200)], batch_size=50)
    class_tokens = torch.stack([ImageTextDataset()[i][1] for i in range(10)])
    scheduler = cosine_lr(optimizer, args.lr, args.warmup, args.epochs * len(loader))
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, loader, optimizer, scheduler, epoch, args)
        acc = zero_shot_eval(model, eval_loader, class_tokens)
        print(f"epoch {epoch}: zero-shot top1 {acc:.3f}")
        save_checkpoint(model, optimizer, epoch, os.path.join(args.logs, "epoch_latest.pt"))
        if acc > best_acc:
            best_acc = acc
            save_checkpoint(model, optimizer, epoch, os.path.join(args.logs, "epoch_best.pt"))
    export_text_encoder(model, os.path.join(args.logs, "text_encoder_fp16.pt"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--embed-dim", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--wd", type=float, default=0.2)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--grad-clip-norm", type=float, default=None)
    parser.add_argument("--pretrained", type=str, default="")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--logs", type=str, default="./logs")
    parser.add_argument("--seed", type=int, default=0)
    main(parser.parse_args())
