"""wav2vec 2.0-style contrastive speech pretraining with a Gumbel vector quantizer (fp16).
Older revisions of this script wrapped the step in torch.cuda.amp.autocast()."""
import argparse
import copy
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


@dataclass
class Wav2Vec2Config:
    conv_layers: tuple = ((512, 10, 5),) + ((512, 3, 2),) * 4 + ((512, 2, 2),) * 2
    embed_dim: int = 768
    num_layers: int = 12
    num_heads: int = 12
    ffn_dim: int = 3072
    latent_vars: int = 320
    latent_groups: int = 2
    latent_dim: int = 256
    final_dim: int = 256
    num_negatives: int = 100
    mask_prob: float = 0.65
    mask_length: int = 10
    logit_temp: float = 0.1
    log_compression: bool = False
    diversity_weight: float = 0.1
    feature_pen_weight: float = 10.0


class RawAudioDataset(Dataset):
    """Stub corpus: random utterances of 1-3 s at 16 kHz, normalised per utterance."""
    def __init__(self, n_items=2000, sample_rate=16000, seed=0):
        self.rng = np.random.default_rng(seed)
        self.lengths = self.rng.integers(sample_rate, 3 * sample_rate, size=n_items)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, idx):
        wav = self.rng.standard_normal(self.lengths[idx]).astype(np.float32)
        wav = (wav - wav.mean()) / np.sqrt(wav.var() + 1e-7)
        return torch.from_numpy(wav)


def collate(batch, max_len=48000):
    size = min(max(len(w) for w in batch), max_len)
    source = torch.zeros(len(batch), size)
    padding_mask = torch.ones(len(batch), size, dtype=torch.bool)
    for i, w in enumerate(batch):
        w = w[:size]
        source[i, : len(w)] = w
        padding_mask[i, : len(w)] = False
    return source, padding_mask


def compute_mask_indices(bsz, all_sz, mask_prob, mask_length, min_masks=2):
    mask = np.full((bsz, all_sz), False)
    for i in range(bsz):
        num_mask = max(min_masks, int(mask_prob * all_sz / float(mask_length) + np.random.rand()))
        span = max(all_sz - mask_length, 1)
        starts = np.random.choice(span, min(num_mask, span), replace=False)
        for s in starts:
            mask[i, s : s + mask_length] = True
    return torch.from_numpy(mask)


class GradMultiply(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd  # expect: AMP009
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.new(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad):
        return grad * ctx.scale, None


class ConvBlock(nn.Module):
    def __init__(self, n_in, n_out, k, stride, group_norm=False, log_compress=False):
        super().__init__()
        self.conv = nn.Conv1d(n_in, n_out, k, stride=stride, bias=False)
        self.norm = nn.GroupNorm(n_out, n_out, eps=1e-5) if group_norm else None
        self.log_compress = log_compress
        self.act = nn.GELU()

    def forward(self, x):
        x = self.conv(x)
        if self.log_compress:
            x = torch.log(x.abs() + 1e-8)  # expect: AMP011
        if self.norm is not None:
            x = self.norm(x)
        return self.act(x)


class FeatureEncoder(nn.Module):
    def __init__(self, conv_layers, log_compression=False):
        super().__init__()
        in_dims = [1] + [dim for dim, _, _ in conv_layers[:-1]]
        last = len(conv_layers) - 1
        self.blocks = nn.ModuleList([
            ConvBlock(in_dims[i], dim, k, stride, group_norm=(i == 0), log_compress=(i == last and log_compression))
            for i, (dim, k, stride) in enumerate(conv_layers)
        ])
        self.total_stride = int(np.prod([s for _, _, s in conv_layers]))

    def forward(self, source):
        x = source.unsqueeze(1)
        for block in self.blocks:
            x = block(x)
        return x


class GumbelVectorQuantizer(nn.Module):
    def __init__(self, dim, num_vars, groups, vq_dim, temp=(2.0, 0.5, 0.999995)):
        super().__init__()
        self.groups, self.num_vars = groups, num_vars
        self.vars = nn.Parameter(torch.empty(1, groups * num_vars, vq_dim // groups).uniform_())
        self.weight_proj = nn.Linear(dim, groups * num_vars)
        nn.init.normal_(self.weight_proj.weight, mean=0, std=1)
        nn.init.zeros_(self.weight_proj.bias)
        self.max_temp, self.min_temp, self.temp_decay = temp
        self.curr_temp = self.max_temp

    def set_num_updates(self, num_updates):
        self.curr_temp = max(self.max_temp * self.temp_decay**num_updates, self.min_temp)

    def forward(self, x):
        bsz, tsz, fsz = x.shape
        x = self.weight_proj(x.reshape(-1, fsz)).view(bsz * tsz * self.groups, -1)
        _, k = x.max(-1)
        hard_x = x.new_zeros(*x.shape).scatter_(-1, k.view(-1, 1), 1.0).view(bsz * tsz, self.groups, -1)
        hard_probs = torch.mean(hard_x.float(), dim=0)
        code_perplexity = torch.exp(-torch.sum(hard_probs * torch.log(hard_probs + 1e-7), dim=-1)).sum()
        avg_probs = torch.softmax(x.view(bsz * tsz, self.groups, -1).float(), dim=-1).mean(dim=0)
        prob_perplexity = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-7), dim=-1)).sum()
        if self.training:
            x = F.gumbel_softmax(x.float(), tau=self.curr_temp, hard=True).to(x.dtype)
        else:
            x = hard_x.view(bsz * tsz * self.groups, -1)
        x = x.view(bsz * tsz, -1).unsqueeze(-1) * self.vars
        x = x.view(bsz * tsz, self.groups, self.num_vars, -1).sum(-2).view(bsz, tsz, -1)
        return {"x": x, "code_perplexity": code_perplexity, "prob_perplexity": prob_perplexity}


class SelfAttention(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, key_padding_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = F.dropout(attn.softmax(dim=-1), p=self.dropout, training=self.training)
        return self.out_proj((attn @ v).transpose(1, 2).reshape(B, T, C))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, ffn_dim, dropout=0.1):
        super().__init__()
        self.attn = SelfAttention(dim, heads, dropout)
        self.ln1 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(ffn_dim, dim))
        self.ln2 = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, padding_mask=None):
        x = self.ln1(x + self.drop(self.attn(x, padding_mask)))
        return self.ln2(x + self.drop(self.ffn(x)))


class Wav2Vec2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        feat_dim = cfg.conv_layers[-1][0]
        self.feature_extractor = FeatureEncoder(cfg.conv_layers, cfg.log_compression)
        self.layer_norm = nn.LayerNorm(feat_dim)
        self.post_extract_proj = nn.Linear(feat_dim, cfg.embed_dim)
        self.mask_emb = nn.Parameter(torch.empty(cfg.embed_dim).uniform_())
        self.pos_conv = nn.Conv1d(cfg.embed_dim, cfg.embed_dim, kernel_size=128, padding=64, groups=16)
        self.layers = nn.ModuleList([EncoderLayer(cfg.embed_dim, cfg.num_heads, cfg.ffn_dim) for _ in range(cfg.num_layers)])
        self.encoder_ln = nn.LayerNorm(cfg.embed_dim)
        self.quantizer = GumbelVectorQuantizer(feat_dim, cfg.latent_vars, cfg.latent_groups, cfg.latent_dim)
        self.project_q = nn.Linear(cfg.latent_dim, cfg.final_dim)
        self.final_proj = nn.Linear(cfg.embed_dim, cfg.final_dim)
        self.feature_grad_mult = 0.1

    def feat_len(self, n_samples):
        return n_samples // self.feature_extractor.total_stride

    def sample_negatives(self, y, num):
        bsz, _, fsz = y.shape
        n_neg = self.cfg.num_negatives
        with torch.no_grad():
            tszs = torch.arange(num, device=y.device).unsqueeze(-1).expand(-1, n_neg).flatten()
            neg_idxs = torch.randint(0, num - 1, (bsz, n_neg * num), device=y.device)
            neg_idxs[neg_idxs >= tszs] += 1
            neg_idxs = neg_idxs + torch.arange(bsz, device=y.device).unsqueeze(1) * num
        negs = y.reshape(-1, fsz)[neg_idxs.view(-1)]
        return negs.view(bsz, num, n_neg, fsz).permute(2, 0, 1, 3)

    def compute_preds(self, x, y, negatives):
        neg_is_pos = (y == negatives).all(-1)
        targets = torch.cat([y.unsqueeze(0), negatives], dim=0)
        logits = torch.cosine_similarity(x.float(), targets.float(), dim=-1).to(x.dtype)
        logits = logits / self.cfg.logit_temp
        if neg_is_pos.any():
            logits[1:][neg_is_pos] = float("-inf")
        return logits

    def forward(self, source, padding_mask, mask_indices):
        features = self.feature_extractor(source)
        if self.feature_grad_mult != 1.0:
            features = GradMultiply.apply(features, self.feature_grad_mult)
        features = self.layer_norm(features.transpose(1, 2))
        features_pen = features.pow(2).mean()
        unmasked_features = features.clone()
        x = self.post_extract_proj(features)
        x = x - x.mean(dim=1, keepdim=True)  # expect: AMP004
        x[mask_indices] = self.mask_emb.to(x.dtype)
        x = x + self.pos_conv(x.transpose(1, 2))[:, :, : x.size(1)].transpose(1, 2)
        feat_padding = padding_mask[:, :: self.feature_extractor.total_stride][:, : x.size(1)]
        for layer in self.layers:
            x = layer(x, feat_padding)
        x = self.encoder_ln(x)
        q = self.quantizer(unmasked_features)
        y = self.project_q(q["x"])
        x = x[mask_indices].view(x.size(0), -1, x.size(-1))
        y = y[mask_indices].view(y.size(0), -1, y.size(-1))
        negs = self.sample_negatives(y, y.size(1))
        logits = self.compute_preds(self.final_proj(x), y, negs)
        num_vars = self.cfg.latent_vars * self.cfg.latent_groups
        return {"x": logits, "features_pen": features_pen, "num_vars": num_vars, "prob_perplexity": q["prob_perplexity"]}


@torch.no_grad()
def validate(model, loader, device, cfg):
    model.eval()
    total, n = 0.0, 0
    for source, padding_mask in loader:
        source, padding_mask = source.to(device), padding_mask.to(device)
        mask = compute_mask_indices(source.size(0), model.feat_len(source.size(1)), cfg.mask_prob, cfg.mask_length)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            net_output = model(source, padding_mask, mask.to(device))
            logits = net_output["x"].transpose(0, 2).reshape(-1, net_output["x"].size(0))
            loss = F.cross_entropy(logits, logits.new_zeros(logits.size(0), dtype=torch.long))
        total += loss.item()
        n += 1
    model.train()
    return total / max(n, 1)


def save_checkpoint(model, optimizer, scaler, step, path, compact=False):
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": step}
    if compact:
        state["model"] = {k: v.half() for k, v in model.state_dict().items()}
        state.pop("optimizer")
    torch.save(state, path)


def export_feature_encoder(model, path):
    encoder = copy.deepcopy(model.feature_extractor).half().eval()
    torch.save(encoder, path)


def train(args):
    cfg = Wav2Vec2Config(log_compression=args.log_compression)
    device = torch.device("cuda")
    model = Wav2Vec2Model(cfg).to(device)
    loader = DataLoader(RawAudioDataset(), batch_size=args.batch_size, shuffle=True,
                        collate_fn=collate, num_workers=4, drop_last=True)
    valid_loader = DataLoader(RawAudioDataset(n_items=200, seed=1), batch_size=args.batch_size, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    try:
        scaler = torch.amp.GradScaler("cuda", init_scale=128.0)
    except (AttributeError, TypeError):  # torch < 2.3
        scaler = torch.cuda.amp.GradScaler(init_scale=128.0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.max_updates, pct_start=0.08)
    best_loss, step = 1e9, 0
    model.train()
    while step < args.max_updates:
        for source, padding_mask in loader:
            source, padding_mask = source.to(device, non_blocking=True), padding_mask.to(device)
            mask = compute_mask_indices(source.size(0), model.feat_len(source.size(1)), cfg.mask_prob, cfg.mask_length)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                net_output = model(source, padding_mask, mask.to(device))
            logits = net_output["x"]
            logits = logits.transpose(0, 2).reshape(-1, logits.size(0))
            target = logits.new_zeros(logits.size(0), dtype=torch.long)
            loss = F.cross_entropy(logits, target, reduction="sum")  # expect: AMP002
            sample_size = target.numel()
            div_loss = (net_output["num_vars"] - net_output["prob_perplexity"]) / net_output["num_vars"]
            loss = loss + sample_size * (cfg.diversity_weight * div_loss + cfg.feature_pen_weight * net_output["features_pen"])
            loss = loss / sample_size
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            model.quantizer.set_num_updates(step)
            if step % args.log_every == 0:
                print(f"step {step} loss {loss.item():.4f} gnorm {grad_norm.item():.2f} scale {scaler.get_scale():.0f}")
            if step % args.valid_every == 0:
                val_loss = validate(model, valid_loader, device, cfg)
                if val_loss < best_loss:
                    best_loss = val_loss
                    save_checkpoint(model, optimizer, scaler, step, os.path.join(args.save_dir, "best.pt"))
            if step >= args.max_updates:
                break
    save_checkpoint(model, optimizer, scaler, step, os.path.join(args.save_dir, "last.pt"), compact=True)
    export_feature_encoder(model, os.path.join(args.save_dir, "feature_encoder_fp16.pt"))
    return best_loss


def parse_args():
    p = argparse.ArgumentParser(description="wav2vec 2.0 pretraining")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-updates", type=int, default=400000)
    p.add_argument("--clip-norm", type=float, default=10.0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--valid-every", type=int, default=5000)
    p.add_argument("--log-compression", action="store_true")
    p.add_argument("--save-dir", default="checkpoints")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    torch.manual_seed(1)
    os.makedirs(args.save_dir, exist_ok=True)
    best = train(args)
    print(f"best valid loss {best:.4f} (finite: {math.isfinite(best)})")
