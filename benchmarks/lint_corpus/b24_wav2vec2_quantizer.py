"""wav2vec 2.0-style pretraining: conv feature encoder, transformer context network,
Gumbel product quantizer and the contrastive + diversity objective."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CONV_LAYERS = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


class ConvFeatureEncoder(nn.Module):
    def __init__(self, layers=CONV_LAYERS):
        super().__init__()
        blocks, cin = [], 1
        for i, (dim, k, s) in enumerate(layers):
            mods = [nn.Conv1d(cin, dim, k, stride=s, bias=False)]
            if i == 0:
                mods.append(nn.GroupNorm(dim, dim, affine=True))
            mods.append(nn.GELU())
            blocks.append(nn.Sequential(*mods))
            cin = dim
        self.blocks = nn.ModuleList(blocks)
        self.layers = layers

    def output_lengths(self, lengths):
        for _, k, s in self.layers:
            lengths = torch.div(lengths - k, s, rounding_mode="floor") + 1
        return lengths

    def forward(self, wav):
        x = wav.unsqueeze(1)
        for blk in self.blocks:
            x = blk(x)
        return x.transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x, padding_mask=None):
        b, t, c = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q * self.scaling, k.transpose(-1, -2))
        if padding_mask is not None:
            scores = scores.masked_fill(padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        probs = F.dropout(scores.softmax(-1), p=self.dropout, training=self.training)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, c)
        return self.out_proj(out)


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, ffn_dim=3072, dropout=0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(ffn_dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, padding_mask=None):
        x = x + self.dropout(self.attn(self.norm1(x), padding_mask))
        return x + self.dropout(self.ffn(self.norm2(x)))


class PositionalConvEmbedding(nn.Module):
    def __init__(self, dim, k=128, groups=16):
        super().__init__()
        conv = nn.Conv1d(dim, dim, k, padding=k // 2, groups=groups)
        self.conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)
        self.k = k

    def forward(self, x):
        y = self.conv(x.transpose(1, 2))
        if self.k % 2 == 0:
            y = y[:, :, :-1]
        return F.gelu(y).transpose(1, 2)


class GumbelVectorQuantizer(nn.Module):
    def __init__(self, dim, num_vars=320, groups=2, vq_dim=256, temp=(2.0, 0.5, 0.999995)):
        super().__init__()
        self.groups, self.num_vars = groups, num_vars
        self.vars = nn.Parameter(torch.empty(1, groups * num_vars, vq_dim // groups).uniform_())
        self.weight_proj = nn.Linear(dim, groups * num_vars)
        nn.init.normal_(self.weight_proj.weight, mean=0, std=1)
        nn.init.zeros_(self.weight_proj.bias)
        self.max_temp, self.min_temp, self.temp_decay = temp
        self.curr_temp = self.max_temp

    def set_num_updates(self, n):
        self.curr_temp = max(self.max_temp * self.temp_decay**n, self.min_temp)

    def forward(self, x):
        bsz, tsz, _ = x.shape
        x = self.weight_proj(x).view(bsz * tsz * self.groups, -1)
        k = x.argmax(-1)
        hard_x = x.new_zeros(*x.shape).scatter_(-1, k.view(-1, 1), 1.0).view(bsz * tsz, self.groups, -1)
        hard_probs = torch.mean(hard_x, dim=0)  # expect: AMP004
        code_ppl = torch.exp(-torch.sum(hard_probs * torch.log(hard_probs + 1e-7), dim=-1)).sum()
        avg_probs = torch.softmax(x.view(bsz * tsz, self.groups, -1).float(), dim=-1).mean(dim=0)
        prob_ppl = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-7), dim=-1)).sum()
        if self.training:
            u = torch.rand_like(x)
            gumbels = -torch.log(-torch.log(u + 1e-10) + 1e-10)  # expect: AMP011
            y_soft = ((x + gumbels) / self.curr_temp).softmax(-1)
            y_hard = torch.zeros_like(y_soft).scatter_(-1, y_soft.argmax(-1, keepdim=True), 1.0)
            x = (y_hard - y_soft).detach() + y_soft
        else:
            x = hard_x.view(bsz * tsz * self.groups, -1)
        q = x.view(bsz * tsz, -1).unsqueeze(-1) * self.vars
        q = q.view(bsz * tsz, self.groups, self.num_vars, -1).sum(-2).view(bsz, tsz, -1)
        return {"x": q, "code_perplexity": code_ppl, "prob_perplexity": prob_ppl, "num_vars": self.num_vars * self.groups}


def compute_mask(b, t, mask_prob, span, device):
    num_spans = max(1, int(mask_prob * t / span))
    starts = torch.stack([torch.randperm(t - span, device=device)[:num_spans] for _ in range(b)])
    idx = (starts.unsqueeze(-1) + torch.arange(span, device=device)).view(b, -1)
    mask = torch.zeros(b, t, dtype=torch.bool, device=device)
    mask.scatter_(1, idx, True)
    # equal number of masked frames per row so targets can be viewed as (B, M, C)
    keep = int(mask.sum(1).min())
    ranks = mask.long().cumsum(1)
    return mask & (ranks <= keep)


def sample_negatives(y, n):
    b, t, c = y.shape
    with torch.no_grad():
        idx = torch.randint(0, t - 1, (b, t * n), device=y.device)
        own = torch.arange(t, device=y.device).unsqueeze(-1).expand(-1, n).flatten()
        idx[idx >= own] += 1
        idx = idx + torch.arange(b, device=y.device).unsqueeze(1) * t
    return y.reshape(-1, c)[idx.view(-1)].view(b, t, n, c).permute(2, 0, 1, 3)


def contrastive_logits(x, y, negatives, temp):
    neg_is_pos = (y == negatives).all(-1)
    targets = torch.cat([y.unsqueeze(0), negatives], dim=0)
    logits = torch.cosine_similarity(x.float(), targets.float(), dim=-1) / temp
    if neg_is_pos.any():
        logits[1:][neg_is_pos] = float("-inf")
    return logits


class Wav2Vec2Pretrain(nn.Module):
    def __init__(self, dim=768, depth=12, heads=12, final_dim=256, mask_prob=0.65, mask_len=10, num_negatives=100):
        super().__init__()
        self.feature_encoder = ConvFeatureEncoder()
        self.layer_norm = nn.LayerNorm(512)
        self.post_extract_proj = nn.Linear(512, dim)
        self.mask_emb = nn.Parameter(torch.empty(dim).uniform_())
        self.pos_conv = PositionalConvEmbedding(dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(depth))
        self.encoder_norm = nn.LayerNorm(dim)
        self.quantizer = GumbelVectorQuantizer(512, vq_dim=final_dim)
        self.project_q = nn.Linear(final_dim, final_dim)
        self.final_proj = nn.Linear(dim, final_dim)
        self.utt_proj = nn.Linear(dim, final_dim)
        self.mask_prob, self.mask_len, self.num_negatives = mask_prob, mask_len, num_negatives
        self.logit_temp = 0.1

    def forward(self, wav, wav_lengths):
        features = self.feature_encoder(wav)
        features_pen = features.pow(2).mean()
        features = self.layer_norm(features)
        unmasked = features.clone()
        x = self.post_extract_proj(features)
        b, t, _ = x.shape
        frames = self.feature_encoder.output_lengths(wav_lengths)
        padding_mask = torch.arange(t, device=x.device)[None, :] >= frames[:, None]
        mask = compute_mask(b, t, self.mask_prob, self.mask_len, x.device) & ~padding_mask
        x = x.clone()
        x[mask] = self.mask_emb.to(x.dtype)
        x = x + self.pos_conv(x)
        for layer in self.layers:
            x = layer(x, padding_mask)
        x = self.encoder_norm(x)
        utt = self.utt_proj(x).mean(dim=1)  # expect: AMP004
        q = self.quantizer(unmasked)
        y = self.project_q(q["x"])
        y = y[mask].view(b, -1, y.size(-1))
        x = self.final_proj(x)[mask].view(b, -1, y.size(-1))
        negs = sample_negatives(y, self.num_negatives)
        return {
            "logits": contrastive_logits(x, y, negs, self.logit_temp),
            "features_pen": features_pen,
            "prob_perplexity": q["prob_perplexity"],
            "code_perplexity": q["code_perplexity"],
            "num_vars": q["num_vars"],
            "utt": utt,
        }


def utterance_variance_reg(utt, target_std=1.0):
    std = torch.sqrt(utt.float().var(dim=0) + 1e-4)
    return F.relu(target_std - std).mean()


def train(loader, total_updates=400_000, lr=5e-4, device="cuda"):
    model = Wav2Vec2Pretrain().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda", init_scale=128.0)
    step = 0
    while step < total_updates:
        for wav, wav_lengths in loader:
            wav, wav_lengths = wav.to(device), wav_lengths.to(device)
            model.quantizer.set_num_updates(step)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(wav, wav_lengths)
                logits = out["logits"]
                logits = logits.transpose(0, 2).reshape(-1, logits.size(0))
                target = logits.new_zeros(logits.size(0), dtype=torch.long)
                sample_size = target.numel()
                loss = F.cross_entropy(logits, target, reduction="sum")
                diversity = (out["num_vars"] - out["prob_perplexity"]) / out["num_vars"]
                loss = loss + (0.1 * diversity + 10.0 * out["features_pen"]) * sample_size
                loss = loss + utterance_variance_reg(out["utt"]) * sample_size
                scaler.scale(loss / sample_size).backward()  # expect: AMP008
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if step % 200 == 0:
                print(f"step {step} loss {loss.item() / sample_size:.3f} gnorm {grad_norm:.2f} "
                      f"code_ppl {out['code_perplexity'].item():.1f} temp {model.quantizer.curr_temp:.3f}")
            if step >= total_updates:
                break
    return model
