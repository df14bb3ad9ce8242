"""HuBERT-style masked prediction pretraining (first iteration: MFCC k-means targets).

A compact re-implementation of the fairseq ``hubert_pretraining`` task for a single node:
conv waveform encoder -> transformer -> cosine logits against learned cluster embeddings,
cross-entropy on the masked frames only.

    torchrun --nproc_per_node 8 hubert_pretrain.py --manifest data/train.tsv --km-labels data/train.km
"""
import argparse
import copy
import logging
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("hubert")


@dataclass
class HubertConfig:
    conv_layers: tuple = ((512, 10, 5),) + ((512, 3, 2),) * 4 + ((512, 2, 2),) * 2
    encoder_layers: int = 12
    embed_dim: int = 768
    num_heads: int = 12
    ffn_dim: int = 3072
    dropout: float = 0.1
    num_classes: int = 100
    final_dim: int = 256
    mask_prob: float = 0.8
    mask_length: int = 10
    logit_temp: float = 0.1
    feature_grad_mult: float = 0.1
    features_pen_weight: float = 10.0
    lr: float = 5e-4
    warmup_updates: int = 32000
    max_updates: int = 400000
    update_freq: int = 4
    clip_norm: float = 10.0
    amp: bool = True
    bf16: bool = False


class ChannelNorm(nn.Module):
    """Per-frame normalisation over channels for B x C x T conv features."""

    def __init__(self, channels, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)  # expect: AMP004
        var = x.var(dim=1, keepdim=True, unbiased=False)  # expect: AMP004
        x = (x - mean) / torch.sqrt(var + self.eps)
        return x * self.weight[None, :, None] + self.bias[None, :, None]


class ConvFeatureExtractor(nn.Module):
    def __init__(self, conv_layers):
        super().__init__()
        in_d = 1
        self.conv_layers = nn.ModuleList()
        for dim, k, stride in conv_layers:
            self.conv_layers.append(nn.Conv1d(in_d, dim, k, stride=stride, bias=False))
            in_d = dim
        self.norm = ChannelNorm(conv_layers[0][0])

    def forward(self, x):
        x = x.unsqueeze(1)
        for i, conv in enumerate(self.conv_layers):
            x = F.gelu(conv(x))
            if i == 0:
                x = self.norm(x)
        return x


class SelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.1):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, key_padding_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * self.scaling
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.dropout(F.softmax(attn, dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(B, T, C)
        return self.out_proj(out)


class EncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = SelfAttention(cfg.embed_dim, cfg.num_heads, cfg.dropout)
        self.norm1 = nn.LayerNorm(cfg.embed_dim)
        self.fc1 = nn.Linear(cfg.embed_dim, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.embed_dim)
        self.norm2 = nn.LayerNorm(cfg.embed_dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, key_padding_mask=None):
        x = self.norm1(x + self.dropout(self.self_attn(x, key_padding_mask)))
        x = self.norm2(x + self.dropout(self.fc2(self.dropout(F.gelu(self.fc1(x))))))
        return x


class HubertModel(nn.Module):
    def __init__(self, cfg: HubertConfig):
        super().__init__()
        self.cfg = cfg
        self.feature_extractor = ConvFeatureExtractor(cfg.conv_layers)
        embed = cfg.conv_layers[-1][0]
        self.layer_norm = nn.LayerNorm(embed)
        self.post_extract_proj = nn.Linear(embed, cfg.embed_dim)
        self.mask_emb = nn.Parameter(torch.empty(cfg.embed_dim).uniform_())
        self.pos_conv = nn.Conv1d(cfg.embed_dim, cfg.embed_dim, kernel_size=128, padding=64, groups=16)
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.encoder_layers)])
        self.encoder_norm = nn.LayerNorm(cfg.embed_dim)
        self.final_proj = nn.Linear(cfg.embed_dim, cfg.final_dim)
        self.label_embs = nn.Parameter(torch.empty(cfg.num_classes, cfg.final_dim).uniform_())

    def forward_padding_mask(self, features, padding_mask):
        extra = padding_mask.size(1) % features.size(1)
        padding_mask = padding_mask[:, :-extra] if extra > 0 else padding_mask
        return padding_mask.view(padding_mask.size(0), features.size(1), -1).all(-1)

    def forward(self, source, padding_mask=None, mask_indices=None):
        features = self.feature_extractor(source)
        if self.cfg.feature_grad_mult != 1.0:
            # scale the gradient reaching the conv stack, keep the forward value
            g = self.cfg.feature_grad_mult
            features = features * g + features.detach() * (1.0 - g)
        features = features.transpose(1, 2)
        features_pen = features.float().pow(2).mean()
        features = self.layer_norm(features)
        if padding_mask is not None:
            padding_mask = self.forward_padding_mask(features, padding_mask)
        x = self.post_extract_proj(features)
        if mask_indices is not None:
            x = torch.where(mask_indices.unsqueeze(-1), self.mask_emb.to(x.dtype), x)
        x_conv = self.pos_conv(x.transpose(1, 2))[:, :, :-1]
        x = x + F.gelu(x_conv).transpose(1, 2)
        for layer in self.layers:
            x = layer(x, key_padding_mask=padding_mask)
        proj = self.final_proj(self.encoder_norm(x))
        logits = F.cosine_similarity(proj.float().unsqueeze(2), self.label_embs.float()[None, None], dim=-1).type_as(proj)
        return {"logits": logits / self.cfg.logit_temp, "padding_mask": padding_mask, "features_pen": features_pen}


def compute_mask_indices(shape, padding_mask, mask_prob, mask_length, min_masks=2):
    bsz, all_sz = shape
    mask = np.full((bsz, all_sz), False)
    for i in range(bsz):
        sz = all_sz - int(padding_mask[i].sum()) if padding_mask is not None else all_sz
        num_mask = max(min_masks, int(mask_prob * sz / float(mask_length) + np.random.rand()))
        starts = np.random.choice(max(sz - mask_length, 1), num_mask, replace=False)
        for s in starts:
            mask[i, s:s + mask_length] = True
    return torch.from_numpy(mask)


class HubertPretrainer:
    def __init__(self, cfg: HubertConfig, model: nn.Module, device):
        self.cfg = cfg
        self.device = device
        self.model = model.to(device)
        self.amp_dtype = torch.bfloat16 if cfg.bf16 else torch.float16
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp and not cfg.bf16)
        self.num_updates = 0
        self._micro = 0

    def autocast_ctx(self):
        if not self.cfg.amp:
            return nullcontext()
        return torch.autocast(device_type="cuda", dtype=self.amp_dtype)

    def lr_step(self):
        warm, total = self.cfg.warmup_updates, self.cfg.max_updates
        if self.num_updates < warm:
            lr = self.cfg.lr * self.num_updates / warm
        else:
            lr = self.cfg.lr * max(0.0, 1.0 - (self.num_updates - warm) / max(1, total - warm))
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def _move(self, batch):
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def compute_loss(self, net_output, batch):
        logits = net_output["logits"]
        mask = batch["mask_indices"]
        if net_output["padding_mask"] is not None:
            mask = mask & ~net_output["padding_mask"]
        logit_m = logits[mask]
        target_m = batch["targets"][mask]
        loss_m = F.cross_entropy(logit_m, target_m, reduction="sum")
        sample_size = target_m.numel()
        loss = loss_m + self.cfg.features_pen_weight * net_output["features_pen"] * sample_size
        logs = {"loss_m": loss_m.item() / max(sample_size, 1),
                "acc_m": (logit_m.argmax(-1) == target_m).float().mean().item(),
                "features_pen": net_output["features_pen"].item()}
        return loss, sample_size, logs

    def _backward(self, loss):
        self.scaler.scale(loss).backward()  # expect: AMP008

    def _clip_grad_norm(self, max_norm):
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def train_step(self, batch):
        self.model.train()
        batch = self._move(batch)
        with self.autocast_ctx():
            net_output = self.model(batch["source"], padding_mask=batch["padding_mask"], mask_indices=batch["mask_indices"])
            loss, sample_size, logs = self.compute_loss(net_output, batch)
            self._backward(loss / (max(sample_size, 1) * self.cfg.update_freq))
        self._micro += 1
        if self._micro % self.cfg.update_freq != 0:
            return None
        grad_norm = self._clip_grad_norm(self.cfg.clip_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_updates += 1
        self.lr_step()
        logs["gnorm"] = float(grad_norm)
        logs["loss_scale"] = self.scaler.get_scale()
        return logs

    @torch.no_grad()
    def valid_step(self, batch):
        self.model.eval()
        batch = self._move(batch)
        with self.autocast_ctx():
            net_output = self.model(batch["source"], padding_mask=batch["padding_mask"], mask_indices=batch["mask_indices"])
        loss, sample_size, logs = self.compute_loss(net_output, batch)  # expect: AMP002
        return loss.item() / max(sample_size, 1), logs

    def save_checkpoint(self, path):
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict(), "num_updates": self.num_updates, "cfg": asdict(self.cfg)}, path)


def export_encoder_fp16(model, path):
    """Half-precision copy of the encoder for k-means feature dumping (iteration 2 targets)."""
    encoder = copy.deepcopy(model).eval().half()
    torch.save(encoder.state_dict(), path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--km-labels", required=True)
    parser.add_argument("--save-dir", default="checkpoints")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--no-amp", action="store_true")
    parser.add_argument("--save-interval", type=int, default=25000)
    args = parser.parse_args()

    cfg = HubertConfig(amp=not args.no_amp, bf16=args.bf16)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    trainer = HubertPretrainer(cfg, HubertModel(cfg), device)
    from hubert_data import build_loader  # local module: tsv manifest + km labels, bucketed batches
    train_loader, valid_loader = build_loader(args.manifest, args.km_labels, label_rate=50)

    def add_mask(batch):
        feat_len = batch["targets"].shape[1]
        batch["mask_indices"] = compute_mask_indices((batch["source"].shape[0], feat_len), None, cfg.mask_prob, cfg.mask_length)
        return batch

    while trainer.num_updates < cfg.max_updates:
        for batch in train_loader:
            logs = trainer.train_step(add_mask(batch))
            if logs is not None and trainer.num_updates % 100 == 0:
                logger.info("num_updates=%d %s", trainer.num_updates, logs)
            if logs is not None and trainer.num_updates % args.save_interval == 0:
                val = [trainer.valid_step(add_mask(b))[0] for b in valid_loader]
                logger.info("valid loss %.4f", float(np.mean(val)))
                trainer.save_checkpoint(os.path.join(args.save_dir, f"checkpoint_{trainer.num_updates}.pt"))
    export_encoder_fp16(trainer.model, os.path.join(args.save_dir, "encoder_fp16.pt"))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
