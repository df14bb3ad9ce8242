"""Conformer encoder + Transformer decoder, joint CTC / attention training
(ESPnet-style recipe, LibriSpeech 100h)."""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def utterance_cmvn(feats, lens):
    # per-utterance mean/variance normalisation of the fbank input (fp32 from the loader)
    mask = (torch.arange(feats.size(1), device=feats.device)[None] < lens[:, None]).unsqueeze(-1)
    n = lens.view(-1, 1, 1).to(feats.dtype)
    mean = (feats * mask).sum(1, keepdim=True) / n
    var = ((feats - mean) ** 2 * mask).sum(1, keepdim=True) / n
    return (feats - mean) / torch.sqrt(var + 1e-10) * mask


@dataclass
class ASROutput:
    ctc_logits: torch.Tensor
    enc_lens: torch.Tensor
    att_logits: torch.Tensor


class Conv2dSubsampling(nn.Module):
    def __init__(self, idim, odim):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)
        self.xscale = math.sqrt(odim)

    def forward(self, x, lens):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f)) * self.xscale
        return x, ((lens - 1) // 2 - 1) // 2


class ChannelNorm(nn.Module):
    """LayerNorm over channels for (B, C, T) activations of the depthwise conv."""

    def __init__(self, channels):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        mu = x.mean(dim=1, keepdim=True)  # expect: AMP004
        var = x.var(dim=1, keepdim=True, unbiased=False)  # expect: AMP004
        x = (x - mu) * torch.rsqrt(var + 1e-12)  # expect: AMP011
        return x * self.weight[:, None] + self.bias[:, None]


class ConvModule(nn.Module):
    def __init__(self, d, kernel=31):
        super().__init__()
        self.pointwise1 = nn.Conv1d(d, 2 * d, 1)
        self.depthwise = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.norm = ChannelNorm(d)
        self.pointwise2 = nn.Conv1d(d, d, 1)

    def forward(self, x, pad_mask):
        x = x.masked_fill(pad_mask.unsqueeze(-1), 0.0).transpose(1, 2)
        x = F.glu(self.pointwise1(x), dim=1)
        x = F.silu(self.norm(self.depthwise(x)))
        return self.pointwise2(x).transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, d, heads, ff_mult=4, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.ff1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, ff_mult * d), nn.SiLU(), nn.Dropout(dropout), nn.Linear(ff_mult * d, d))
        self.norm_mha = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm_conv = nn.LayerNorm(d)
        self.conv = ConvModule(d)
        self.ff2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, ff_mult * d), nn.SiLU(), nn.Dropout(dropout), nn.Linear(ff_mult * d, d))
        self.norm_final = nn.LayerNorm(d)

    def _mhsa(self, x, pad_mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = pad_mask[:, None, None, :]
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        return self.out(torch.matmul(attn, v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x, pad_mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self._mhsa(self.norm_mha(x), pad_mask)
        x = x + self.conv(self.norm_conv(x), pad_mask)
        x = x + 0.5 * self.ff2(x)
        return self.norm_final(x)


class LabelSmoothingLoss(nn.Module):
    def __init__(self, size, padding_idx=-1, smoothing=0.1):
        super().__init__()
        self.size, self.padding_idx = size, padding_idx
        self.confidence, self.smoothing = 1.0 - smoothing, smoothing
        self.criterion = nn.KLDivLoss(reduction="none")

    def forward(self, x, target):
        x, target = x.view(-1, self.size), target.view(-1)
        true_dist = torch.full_like(x, self.smoothing / (self.size - 1))
        ignore = target == self.padding_idx
        total = len(target) - ignore.sum().item()
        target = target.masked_fill(ignore, 0)
        true_dist.scatter_(1, target.unsqueeze(1), self.confidence)
        kl = self.criterion(torch.log_softmax(x, dim=1), true_dist)
        return kl.masked_fill(ignore.unsqueeze(1), 0.0).sum() / total


class ConformerASR(nn.Module):
    def __init__(self, idim=80, d=256, heads=4, enc_layers=12, dec_layers=6, vocab=5000):
        super().__init__()
        self.embed = Conv2dSubsampling(idim, d)
        self.encoder = nn.ModuleList([ConformerBlock(d, heads) for _ in range(enc_layers)])
        self.ctc_lo = nn.Linear(d, vocab)
        self.dec_embed = nn.Embedding(vocab, d)
        layer = nn.TransformerDecoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, dec_layers)
        self.output_layer = nn.Linear(d, vocab)

    def forward(self, feats, feat_lens, ys_in):
        x, lens = self.embed(utterance_cmvn(feats, feat_lens), feat_lens)
        pad_mask = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        for blk in self.encoder:
            x = blk(x, pad_mask)
        causal = torch.triu(torch.ones(ys_in.size(1), ys_in.size(1), dtype=torch.bool, device=x.device), 1)
        dec = self.decoder(self.dec_embed(ys_in), x, tgt_mask=causal, memory_key_padding_mask=pad_mask)
        return ASROutput(ctc_logits=self.ctc_lo(x), enc_lens=lens, att_logits=self.output_layer(dec))


@torch.no_grad()
def recognize(model, feats, feat_lens, blank=0):
    model.eval()
    amp_ctx = torch.amp.autocast("cuda") if hasattr(torch, "amp") else torch.cuda.amp.autocast()
    with amp_ctx:
        x, lens = model.embed(utterance_cmvn(feats, feat_lens), feat_lens)
        pad_mask = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        for blk in model.encoder:
            x = blk(x, pad_mask)
        best = model.ctc_lo(x).argmax(-1)
    hyps = []
    for seq, n in zip(best.tolist(), lens.tolist()):
        out, prev = [], blank
        for tok in seq[:n]:
            if tok != prev and tok != blank:
                out.append(tok)
            prev = tok
        hyps.append(out)
    return hyps


def train(args, loader):
    model = ConformerASR(vocab=args.vocab).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), eps=1e-9)
    warmup = args.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, (warmup / (s + 1)) ** 0.5))
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    att_criterion = LabelSmoothingLoss(args.vocab, padding_idx=-1, smoothing=0.1)
    for epoch in range(args.epochs):
        for feats, feat_lens, ys, ys_lens, ys_in, ys_out in loader:
            feats, feat_lens = feats.cuda(non_blocking=True), feat_lens.cuda()
            ys_in, ys_out = ys_in.cuda(), ys_out.cuda()
            with torch.cuda.amp.autocast():  # expect: AMP009
                out = model(feats, feat_lens, ys_in)
                att_loss = att_criterion(out.att_logits, ys_out)
            log_probs = out.ctc_logits.log_softmax(-1).transpose(0, 1)
            ctc_loss = F.ctc_loss(log_probs, ys, out.enc_lens, ys_lens, zero_infinity=True)  # expect: AMP002
            loss = args.ctc_weight * ctc_loss + (1.0 - args.ctc_weight) * att_loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
        print(f"epoch {epoch}: ctc {ctc_loss.item():.3f} att {att_loss.item():.3f} |g| {grad_norm:.2f}")
    return model
