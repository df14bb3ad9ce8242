"""wav2vec 2.0-style self-supervised speech pre-training.

Conv waveform encoder -> masked transformer context network; targets come from a
Gumbel product quantiser over the (unmasked) conv features. Objective:
contrastive InfoNCE over distractors + codebook diversity + feature penalty,
optionally plus a speaker-ID head on mean-pooled utterance embeddings.
"""
import argparse
import functools
import logging
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speech.data import RawAudioDataset, collate_audio
from speech.masking import compute_mask_indices
from speech.utils import buffered_arange, save_checkpoint

logger = logging.getLogger("w2v")

ARCHS = {
    "base": dict(conv_layers=[(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2, embed_dim=768, layers=12,
                 heads=12, ffn_dim=3072, final_dim=256, latent_vars=320, latent_groups=2, act="GELU",
                 norm_features=False, utt_dim=256),
    "small": dict(conv_layers=[(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2, embed_dim=512, layers=6,
                  heads=8, ffn_dim=2048, final_dim=256, latent_vars=320, latent_groups=2, act="GELU",
                  norm_features=True, utt_dim=256),
}


class Fp32GroupNorm(nn.GroupNorm):
    def forward(self, input):
        out = F.group_norm(
            input.float(), self.num_groups,
            self.weight.float() if self.weight is not None else None,
            self.bias.float() if self.bias is not None else None,
            self.eps,
        )
        return out.to(input.dtype)


class ConvFeatureExtractor(nn.Module):
    def __init__(self, conv_layers, dropout=0.0, act="GELU"):
        super().__init__()
        blocks, in_d = [], 1
        for i, (dim, k, stride) in enumerate(conv_layers):
            blocks.append(nn.Sequential(
                nn.Conv1d(in_d, dim, k, stride=stride, bias=False),
                nn.Dropout(dropout),
                Fp32GroupNorm(dim, dim, affine=True) if i == 0 else nn.Identity(),
                getattr(nn, act)(),
            ))
            in_d = dim
        self.conv_layers = nn.ModuleList(blocks)

    def forward(self, x):
        x = x.unsqueeze(1)
        for conv in self.conv_layers:
            x = conv(x)
        return x


class TimeNorm(nn.Module):
    """Per-utterance normalisation of every channel over time."""

    def forward(self, x):
        mu = x.mean(dim=1, keepdim=True)  # expect: AMP004
        sigma = x.std(dim=1, keepdim=True)  # expect: AMP004
        return (x - mu) / (sigma + 1e-8)  # expect: AMP011


class SelfAttention(nn.Module):
    def __init__(self, dim, heads, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, key_padding_mask=None):
        B, T, C = x.shape
        q = (self.q_proj(x) * self.scaling).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        attn = torch.matmul(q, k.transpose(-2, -1))
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.dropout(attn.softmax(dim=-1))
        out = torch.matmul(attn, v).transpose(1, 2).reshape(B, T, C)
        return self.out_proj(out)


class TransformerLayer(nn.Module):
    def __init__(self, dim, heads, ffn_dim, dropout=0.1, act="GELU"):
        super().__init__()
        self.self_attn = SelfAttention(dim, heads, dropout)
        self.norm1 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), getattr(nn, act)(), nn.Dropout(dropout), nn.Linear(ffn_dim, dim))
        self.norm2 = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, padding_mask=None):
        x = self.norm1(x + self.dropout(self.self_attn(x, padding_mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class ContextEncoder(nn.Module):
    def __init__(self, dim, layers, heads, ffn_dim, dropout=0.1, act="GELU", conv_pos=128, conv_pos_groups=16,
                 layerdrop=0.05):
        super().__init__()
        self.pos_conv = nn.Conv1d(dim, dim, conv_pos, padding=conv_pos // 2, groups=conv_pos_groups)
        nn.init.normal_(self.pos_conv.weight, mean=0, std=math.sqrt(4 / (conv_pos * dim)))
        nn.init.zeros_(self.pos_conv.bias)
        self.layer_norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList([TransformerLayer(dim, heads, ffn_dim, dropout, act) for _ in range(layers)])
        self.layerdrop = layerdrop

    def forward(self, x, padding_mask=None):
        if padding_mask is not None:
            x = x.masked_fill(padding_mask.unsqueeze(-1), 0.0)
        pos = self.pos_conv(x.transpose(1, 2))[:, :, :-1]
        x = self.layer_norm(x + F.gelu(pos).transpose(1, 2))
        for layer in self.layers:
            if self.training and np.random.random() < self.layerdrop:
                continue
            x = layer(x, padding_mask)
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
        self.curr_temp = max(self.max_temp * self.temp_decay ** num_updates, self.min_temp)

    def forward(self, x):
        bsz, tsz, fsz = x.shape
        x = self.weight_proj(x.reshape(-1, fsz))
        x = x.view(bsz * tsz * self.groups, -1)
        _, k = x.max(-1)
        hard_x = torch.zeros_like(x, dtype=torch.float32).scatter_(-1, k.view(-1, 1), 1.0)
        hard_probs = hard_x.view(bsz * tsz, self.groups, -1).mean(dim=0)
        code_ppl = torch.exp(-torch.sum(hard_probs * torch.log(hard_probs + 1e-7), dim=-1)).sum()
        avg_probs = torch.softmax(x.view(bsz * tsz, self.groups, -1).float(), dim=-1).mean(dim=0)
        prob_ppl = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-7), dim=-1)).sum()

        if self.training:
            u = torch.rand(x.shape, dtype=x.dtype, device=x.device)
            gumbels = -torch.log(-torch.log(u + 1e-10) + 1e-10)  # expect: AMP011
            soft = ((x + gumbels) / self.curr_temp).softmax(dim=-1)
            x = (hard_x - soft).detach() + soft
        else:
            x = hard_x
        x = x.view(bsz * tsz, -1, 1) * self.vars
        x = x.view(bsz * tsz, self.groups, self.num_vars, -1).sum(-2).view(bsz, tsz, -1)
        return {"x": x, "code_perplexity": code_ppl, "prob_perplexity": prob_ppl,
                "num_vars": self.num_vars * self.groups, "temp": self.curr_temp}


class Wav2Vec2Model(nn.Module):
    def __init__(self, cfg, num_negatives=100, logit_temp=0.1, mask_prob=0.65, mask_length=10):
        super().__init__()
        C = cfg["conv_layers"][-1][0]
        D = cfg["embed_dim"]
        self.feature_extractor = ConvFeatureExtractor(cfg["conv_layers"], act=cfg["act"])
        self.layer_norm = nn.LayerNorm(C)
        self.post_extract_proj = nn.Linear(C, D)
        self.feat_norm = TimeNorm() if cfg["norm_features"] else nn.Identity()
        self.mask_emb = nn.Parameter(torch.empty(D).uniform_())
        self.encoder = ContextEncoder(D, cfg["layers"], cfg["heads"], cfg["ffn_dim"], act=cfg["act"])
        self.quantizer = GumbelVectorQuantizer(C, cfg["latent_vars"], cfg["latent_groups"], cfg["final_dim"])
        self.project_q = nn.Linear(cfg["final_dim"], cfg["final_dim"])
        self.final_proj = nn.Linear(D, cfg["final_dim"])
        self.utt_proj = nn.Linear(D, cfg["utt_dim"])
        self.dropout_input = nn.Dropout(0.1)
        self.dropout_features = nn.Dropout(0.1)
        self.num_negatives, self.logit_temp = num_negatives, logit_temp
        self.mask_prob, self.mask_length = mask_prob, mask_length

    def sample_negatives(self, y, num):
        bsz, tsz, fsz = y.shape
        y = y.reshape(-1, fsz)
        with torch.no_grad():
            tszs = buffered_arange(num).unsqueeze(-1).expand(-1, self.num_negatives).flatten()
            neg_idxs = torch.randint(0, tsz - 1, (bsz, self.num_negatives * num), device=y.device)
            neg_idxs[neg_idxs >= tszs] += 1
            neg_idxs = neg_idxs + torch.arange(bsz, device=y.device).unsqueeze(1) * tsz
        negs = y[neg_idxs.view(-1)].view(bsz, num, self.num_negatives, fsz).permute(2, 0, 1, 3)
        return negs

    def compute_preds(self, x, y, negatives):
        neg_is_pos = (y == negatives).all(-1)
        targets = torch.cat([y.unsqueeze(0), negatives], dim=0)
        logits = torch.cosine_similarity(x.float(), targets.float(), dim=-1) / self.logit_temp
        if neg_is_pos.any():
            logits[1:][neg_is_pos] = float("-inf")
        return logits

    def forward(self, source, padding_mask=None):
        features = self.feature_extractor(source)
        features_pen = features.float().pow(2).mean()
        features = self.layer_norm(features.transpose(1, 2))
        B, T, C = features.shape
        unmasked = self.dropout_features(features.clone())
        if padding_mask is not None:
            frames = padding_mask.size(1) // T
            padding_mask = padding_mask[:, : frames * T].view(B, T, frames).all(-1)

        x = self.post_extract_proj(features)
        x = self.dropout_input(self.feat_norm(x))
        mask = compute_mask_indices((B, T), padding_mask, self.mask_prob, self.mask_length, min_masks=2)
        mask = torch.from_numpy(mask).to(x.device)
        x[mask] = self.mask_emb.to(x.dtype)

        x = self.encoder(x, padding_mask)
        utt = self.utt_proj(x)
        pooled = utt.mean(dim=1)  # expect: AMP004

        y = unmasked[mask].view(B, -1, C)
        q = self.quantizer(y)
        y = self.project_q(q["x"])
        negs = self.sample_negatives(y, y.size(1))
        x = self.final_proj(x[mask].view(B, -1, x.size(-1)))
        logits = self.compute_preds(x, y, negs)
        return {"logits": logits, "features_pen": features_pen, "prob_perplexity": q["prob_perplexity"],
                "code_perplexity": q["code_perplexity"], "num_vars": q["num_vars"], "temp": q["temp"],
                "pooled": pooled}


class Wav2VecCriterion(nn.Module):
    def __init__(self, loss_weights=(0.1, 10.0), utt_dim=256, num_speakers=0):
        super().__init__()
        self.loss_weights = loss_weights
        self.speaker_head = nn.Linear(utt_dim, num_speakers) if num_speakers else None

    def forward(self, net_output, speaker_ids=None):
        logits = net_output["logits"]
        logits = logits.transpose(0, 2).reshape(-1, logits.size(0))
        target = torch.zeros(logits.size(0), dtype=torch.long, device=logits.device)
        loss = F.cross_entropy(logits, target, reduction="sum")
        sample_size = target.numel()
        n = net_output["num_vars"]
        diversity = (n - net_output["prob_perplexity"]) / n
        loss = loss + self.loss_weights[0] * diversity * sample_size
        loss = loss + self.loss_weights[1] * net_output["features_pen"] * sample_size
        if self.speaker_head is not None and speaker_ids is not None:
            spk_logits = self.speaker_head(net_output["pooled"])
            loss = loss + F.cross_entropy(spk_logits, speaker_ids, reduction="sum")
        with torch.no_grad():
            acc = (logits.argmax(-1) == 0).float().mean()
        return loss / sample_size, {"acc": acc.item(), "code_ppl": net_output["code_perplexity"].item(),
                                    "temp": net_output["temp"]}


def train(model, criterion, loader, optimizer, scheduler, scaler, args):
    amp_ctx = functools.partial(torch.autocast, device_type="cuda", dtype=torch.float16, enabled=args.fp16)
    model.train()
    num_updates = 0
    for epoch in range(args.max_epoch):
        for i, batch in enumerate(loader):
            source = batch["source"].cuda(non_blocking=True)
            padding_mask = batch["padding_mask"].cuda(non_blocking=True)
            speakers = batch["speaker"].cuda(non_blocking=True) if "speaker" in batch else None
            with amp_ctx():
                net_output = model(source, padding_mask)
                loss, logs = criterion(net_output, speakers)
            scaler.scale(loss / args.update_freq).backward()
            if (i + 1) % args.update_freq != 0:
                continue
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            num_updates += 1
            model.quantizer.set_num_updates(num_updates)
            if num_updates % args.log_interval == 0:
                logger.info("ep %d upd %d loss %.3f acc %.3f code_ppl %.1f temp %.3f gnorm %.2f scale %.0f",
                            epoch, num_updates, loss.item(), logs["acc"], logs["code_ppl"], logs["temp"],
                            grad_norm.item(), scaler.get_scale())
            if num_updates % args.save_interval == 0:
                save_checkpoint(args.save_dir, model, optimizer, scaler, num_updates)


@torch.no_grad()
def validate(model, criterion, loader, args):
    model.eval()
    total, n = 0.0, 0
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
            net_output = model(batch["source"].cuda(), batch["padding_mask"].cuda())
            loss, _ = criterion(net_output)
        total += loss.item()
        n += 1
    model.train()
    return total / max(n, 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("manifest")
    p.add_argument("--arch", default="base", choices=list(ARCHS))
    p.add_argument("--max-tokens", type=int, default=1_400_000)
    p.add_argument("--max-epoch", type=int, default=100)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=32000)
    p.add_argument("--total-updates", type=int, default=400000)
    p.add_argument("--update-freq", type=int, default=8)
    p.add_argument("--clip-norm", type=float, default=25.0)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--num-speakers", type=int, default=0)
    p.add_argument("--log-interval", type=int, default=200)
    p.add_argument("--save-interval", type=int, default=25000)
    p.add_argument("--save-dir", default="checkpoints/w2v")
    args = p.parse_args()

    cfg = ARCHS[args.arch]
    model = Wav2Vec2Model(cfg).cuda()
    criterion = Wav2VecCriterion(utt_dim=cfg["utt_dim"], num_speakers=args.num_speakers).cuda()
    params = list(model.parameters()) + list(criterion.parameters())
    optimizer = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup, max(0.0, (args.total_updates - s) / (args.total_updates - args.warmup)))
    )
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)  # expect: AMP009
    dataset = RawAudioDataset(args.manifest, sample_rate=16000, max_sample_size=250000, min_sample_size=32000)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=dataset.batch_by_size(args.max_tokens),
                                         collate_fn=collate_audio, num_workers=6)
    os.makedirs(args.save_dir, exist_ok=True)
    train(model, criterion, loader, optimizer, scheduler, scaler, args)


if __name__ == "__main__":
    main()
