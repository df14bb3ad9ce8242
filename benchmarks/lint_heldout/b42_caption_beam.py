"""Image captioning: region features -> transformer decoder, with an auxiliary
multi-label attribute head (MIL mean pooling) and beam-search decoding.

Written against the older ``torch.cuda.amp`` API; fp16 autocast with a GradScaler.
"""
import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD, BOS, EOS = 0, 1, 2


@dataclass
class CaptionConfig:
    feat_dim: int = 2048
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 3
    vocab: int = 10_000
    n_attrs: int = 1_000
    max_len: int = 24
    smoothing: float = 0.1
    attr_weight: float = 0.5
    attr_loss: str = "bce"
    lr: float = 2e-4
    epochs: int = 30


@dataclass
class CaptionOutput:
    logits: torch.Tensor       # (B, T, vocab)
    attr_logits: torch.Tensor  # (B, n_attrs), MIL-pooled over regions


class MultiHeadAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h, self.dk = h, d // h
        self.scale = self.dk ** -0.5
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x, ctx, key_pad=None, causal=False):
        B, T, _ = x.shape
        S = ctx.size(1)
        q = self.q(x).view(B, T, self.h, self.dk).transpose(1, 2)
        k = self.k(ctx).view(B, S, self.h, self.dk).transpose(1, 2)
        v = self.v(ctx).view(B, S, self.h, self.dk).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale
        if causal:
            future = torch.ones(T, S, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(future, float("-inf"))
        if key_pad is not None:
            att = att.masked_fill(key_pad[:, None, None, :], -1e9)  # expect: AMP007
        y = att.softmax(dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = MultiHeadAttention(d, h)
        self.cross_attn = MultiHeadAttention(d, h)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mem, mem_pad):
        h = self.ln1(x)
        x = x + self.self_attn(h, h, causal=True)
        x = x + self.cross_attn(self.ln2(x), mem, key_pad=mem_pad)
        return x + self.ff(self.ln3(x))


class CaptionModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.feat_proj = nn.Sequential(nn.Linear(cfg.feat_dim, cfg.d_model), nn.ReLU(), nn.Linear(cfg.d_model, cfg.d_model))
        self.attr_head = nn.Linear(cfg.d_model, cfg.n_attrs)
        self.init_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model, padding_idx=PAD)
        self.pos = nn.Embedding(cfg.max_len + 1, cfg.d_model)
        self.layers = nn.ModuleList([DecoderLayer(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def encode(self, feats, keep):
        mem = self.feat_proj(feats)
        w = keep.unsqueeze(-1).to(mem.dtype)
        # masked average: the sums run in fp32 under CUDA autocast
        pooled = (mem * w).sum(1) / w.sum(1).clamp_min(1.0)
        return mem, pooled

    def decode(self, tokens, mem, mem_pad, pooled):
        pos = torch.arange(tokens.size(1), device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)[None] + self.init_proj(pooled)[:, None]
        for layer in self.layers:
            x = layer(x, mem, mem_pad)
        return self.lm_head(self.ln_f(x))

    def forward(self, feats, keep, tokens):
        mem, pooled = self.encode(feats, keep)
        # MIL: per-region attribute logits, mean-pooled over the regions
        attr_logits = self.attr_head(mem).mean(dim=1)  # expect: AMP004
        return CaptionOutput(self.decode(tokens, mem, ~keep, pooled), attr_logits)

    @torch.no_grad()
    def beam_search(self, feats, keep, beam=5, max_len=20, length_penalty=0.6):
        B = feats.size(0)
        mem, pooled = self.encode(feats, keep)
        mem = mem.repeat_interleave(beam, 0)
        pooled = pooled.repeat_interleave(beam, 0)
        pad = (~keep).repeat_interleave(beam, 0)
        seqs = torch.full((B * beam, 1), BOS, dtype=torch.long, device=feats.device)
        scores = torch.full((B, beam), -1e9, dtype=torch.float32, device=feats.device)
        scores[:, 0] = 0.0
        scores = scores.view(-1)
        finished = torch.zeros(B * beam, dtype=torch.bool, device=feats.device)
        for _ in range(max_len):
            logp = F.log_softmax(self.decode(seqs, mem, pad, pooled)[:, -1].float(), dim=-1)
            logp[finished] = -1e9
            logp[finished, EOS] = 0.0
            cand = (scores[:, None] + logp).view(B, -1)
            top, idx = cand.topk(beam, dim=-1)
            src = (idx // logp.size(-1)) + torch.arange(B, device=feats.device)[:, None] * beam
            tok = idx % logp.size(-1)
            seqs = torch.cat([seqs[src.view(-1)], tok.view(-1, 1)], dim=1)
            finished = finished[src.view(-1)] | (tok.view(-1) == EOS)
            scores = top.view(-1)
            if finished.all():
                break
        lengths = (seqs != EOS).sum(-1).float()
        best = (scores / lengths ** length_penalty).view(B, beam).argmax(-1)
        return seqs.view(B, beam, -1)[torch.arange(B), best]


class LabelSmoothedCE(nn.Module):
    def __init__(self, eps, ignore_index=PAD):
        super().__init__()
        self.eps, self.ignore_index = eps, ignore_index

    def forward(self, logits, target):
        logp = F.log_softmax(logits, dim=-1)
        nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        smooth = -logp.mean(dim=-1)
        loss = (1 - self.eps) * nll + self.eps * smooth
        mask = target != self.ignore_index
        return (loss * mask).sum() / mask.sum()


def focal_attr_loss(p, y, gamma=2.0):
    pos = y * (1 - p) ** gamma * torch.log(p + 1e-8)  # expect: AMP011
    neg = (1 - y) * p ** gamma * torch.log(1 - p + 1e-4)
    return -(pos + neg).sum(-1).mean()


def train_epoch(model, loader, optimizer, scaler, cfg, epoch):
    model.train()
    ce = LabelSmoothedCE(cfg.smoothing)
    attr_criterion = nn.BCELoss()
    for it, batch in enumerate(loader):
        feats = batch["feats"].cuda(non_blocking=True).type(torch.cuda.HalfTensor)  # expect: AMP001
        keep = batch["keep"].cuda(non_blocking=True)
        tokens = batch["tokens"].cuda(non_blocking=True)
        attrs = batch["attrs"].cuda(non_blocking=True).float()
        with torch.cuda.amp.autocast(dtype=torch.float16):  # expect: AMP009
            out = model(feats, keep, tokens[:, :-1])
            loss_cap = ce(out.logits, tokens[:, 1:])
            attr_prob = torch.sigmoid(out.attr_logits)
            if cfg.attr_loss == "bce":
                loss_attr = attr_criterion(attr_prob, attrs)  # expect: AMP003
            else:
                loss_attr = focal_attr_loss(attr_prob, attrs)
            loss = loss_cap + cfg.attr_weight * loss_attr
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        scaler.step(optimizer)
        scaler.update()
        if it % 100 == 0:
            print(f"epoch {epoch} it {it} cap {loss_cap.item():.3f} attr {loss_attr.item():.3f}")


@torch.no_grad()
def evaluate(model, loader, vocab):
    model.eval()
    hyps, refs = [], []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model.beam_search(batch["feats"].cuda(), batch["keep"].cuda())
        hyps += [" ".join(vocab[t] for t in s.tolist() if t not in (PAD, BOS, EOS)) for s in out]
        refs += batch["refs"]
    model.train()
    return hyps, refs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--attr-loss", choices=["bce", "focal"], default="bce")
    args = p.parse_args()
    cfg = CaptionConfig(attr_loss=args.attr_loss)
    data = torch.load(args.data)
    model = CaptionModel(cfg).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.05)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs)
    for epoch in range(cfg.epochs):
        train_epoch(model, data["train"], optimizer, scaler, cfg, epoch)
        sched.step()
        hyps, _ = evaluate(model, data["val"], data["vocab"])
        print(f"epoch {epoch}: {hyps[0]}")
        torch.save(model.state_dict(), f"caption_{epoch}.pt")
    print(f"lr final {sched.get_last_lr()[0]:.2e}, log-vocab {math.log(cfg.vocab):.2f}")


if __name__ == "__main__":
    main()
