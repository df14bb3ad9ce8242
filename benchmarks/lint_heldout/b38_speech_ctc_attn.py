"""Joint CTC / attention ASR trainer (transformer encoder-decoder, SpecAugment).

loss = ctc_weight * CTC(encoder) + (1 - ctc_weight) * label-smoothed CE(decoder)

    python b38_speech_ctc_attn.py --amp --accum-grad 4 --epochs 50
    python b38_speech_ctc_attn.py --pure-fp16         # experimental: weights in fp16
"""
import argparse
import copy
import math
import os
import random

import torch
import torch.nn.functional as F
from torch import nn

BLANK_ID, SOS_ID, EOS_ID, IGNORE_ID = 0, 1, 1, -1


class _SwishFunction(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad_out * s * (1 + x * (1 - s))


class Swish(nn.Module):
    def forward(self, x):
        return _SwishFunction.apply(x)


class SpecAugment(nn.Module):
    def __init__(self, n_freq=2, max_f=27, n_time=2, max_t=40):
        super().__init__()
        self.n_freq, self.max_f, self.n_time, self.max_t = n_freq, max_f, n_time, max_t

    def forward(self, x, lengths):
        if not self.training:
            return x
        x = x.clone()
        for b in range(x.shape[0]):
            fill = x[b, : lengths[b]].mean()
            for _ in range(self.n_freq):
                f = random.randint(0, self.max_f)
                f0 = random.randint(0, max(0, x.shape[2] - f))
                x[b, :, f0:f0 + f] = fill
            for _ in range(self.n_time):
                t = random.randint(0, min(self.max_t, int(lengths[b]) // 5))
                t0 = random.randint(0, max(0, int(lengths[b]) - t))
                x[b, t0:t0 + t, :] = fill
        return x


class MultiHeadAttention(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.h, self.d_k = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.drop = nn.Dropout(dropout)

    def forward(self, query, key, value, mask):
        b = query.size(0)
        q = self.q(query).view(b, -1, self.h, self.d_k).transpose(1, 2)
        k = self.k(key).view(b, -1, self.h, self.d_k).transpose(1, 2)
        v = self.v(value).view(b, -1, self.h, self.d_k).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        mask = mask.unsqueeze(1)
        scores = scores.masked_fill(~mask, -1e8 if scores.dtype == torch.float32 else -1e4)
        attn = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)
        x = (self.drop(attn) @ v).transpose(1, 2).reshape(b, -1, self.h * self.d_k)
        return self.o(x)


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, ff):
        super().__init__()
        self.attn = MultiHeadAttention(dim, heads)
        self.ff = nn.Sequential(nn.Linear(dim, ff), Swish(), nn.Dropout(0.1), nn.Linear(ff, dim))
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x, mask):
        y = self.n1(x)
        x = x + self.attn(y, y, y, mask)
        return x + self.ff(self.n2(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads, ff):
        super().__init__()
        self.self_attn, self.src_attn = MultiHeadAttention(dim, heads), MultiHeadAttention(dim, heads)
        self.ff = nn.Sequential(nn.Linear(dim, ff), nn.ReLU(), nn.Linear(ff, dim))
        self.n1, self.n2, self.n3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x, tgt_mask, memory, memory_mask):
        y = self.n1(x)
        x = x + self.self_attn(y, y, y, tgt_mask)
        y = self.n2(x)
        x = x + self.src_attn(y, memory, memory, memory_mask)
        return x + self.ff(self.n3(x))


class ASRModel(nn.Module):
    def __init__(self, n_mels, vocab, dim=256, heads=4, ff=1024, enc_layers=6, dec_layers=3):
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv2d(1, dim, 3, 2), nn.ReLU(), nn.Conv2d(dim, dim, 3, 2), nn.ReLU())
        self.sub_out = nn.Linear(dim * (((n_mels - 1) // 2 - 1) // 2), dim)
        pe = torch.zeros(5000, dim)
        pos = torch.arange(0, 5000).unsqueeze(1)
        div = torch.exp(torch.arange(0, dim, 2) * -(math.log(10000.0) / dim))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)
        self.encoders = nn.ModuleList([EncoderLayer(dim, heads, ff) for _ in range(enc_layers)])
        self.enc_norm = nn.LayerNorm(dim)
        self.ctc_head = nn.Linear(dim, vocab)
        self.embed = nn.Embedding(vocab, dim)
        self.decoders = nn.ModuleList([DecoderLayer(dim, heads, ff) for _ in range(dec_layers)])
        self.dec_norm = nn.LayerNorm(dim)
        self.output_layer = nn.Linear(dim, vocab)
        self.xscale = math.sqrt(dim)

    def encode(self, feats, feat_lens):
        x = self.subsample(feats.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.sub_out(x.transpose(1, 2).reshape(b, t, c * f))
        x = x * self.xscale + self.pe[:, :t]
        lens = ((feat_lens - 1) // 2 - 1) // 2
        mask = (torch.arange(t, device=x.device)[None, :] < lens[:, None]).unsqueeze(1)
        for layer in self.encoders:
            x = layer(x, mask)
        return self.enc_norm(x), lens

    def decode(self, memory, mem_lens, ys_in):
        t = ys_in.size(1)
        tgt_mask = (ys_in != EOS_ID).unsqueeze(1) & torch.tril(torch.ones(t, t, dtype=torch.bool,
                                                                          device=ys_in.device))
        mem_mask = (torch.arange(memory.size(1), device=memory.device)[None, :] < mem_lens[:, None]).unsqueeze(1)
        x = self.embed(ys_in) * self.xscale + self.pe[:, :t]
        for layer in self.decoders:
            x = layer(x, tgt_mask, memory, mem_mask)
        logits = self.output_layer(self.dec_norm(x))
        logits[..., BLANK_ID] = -1e9  # expect: AMP007
        return logits

    def forward(self, feats, feat_lens, ys_in):
        enc, enc_lens = self.encode(feats, feat_lens)
        return self.ctc_head(enc), self.decode(enc, enc_lens, ys_in), enc_lens


class LabelSmoothingLoss(nn.Module):
    def __init__(self, size, smoothing, ignore_index=IGNORE_ID):
        super().__init__()
        self.size, self.smoothing, self.ignore_index = size, smoothing, ignore_index
        self.confidence = 1.0 - smoothing

    def forward(self, x, target):
        x, target = x.reshape(-1, self.size), target.reshape(-1)
        true_dist = torch.full_like(x, self.smoothing / (self.size - 1))
        ignore = target == self.ignore_index
        total = max(len(target) - ignore.sum().item(), 1)
        target = target.masked_fill(ignore, 0)
        true_dist.scatter_(1, target.unsqueeze(1), self.confidence)
        kl = F.kl_div(torch.log_softmax(x, dim=1), true_dist, reduction="none")
        return kl.masked_fill(ignore.unsqueeze(1), 0).sum() / total


def add_sos_eos(ys, y_lens):
    b, u = ys.shape
    ys_in = torch.full((b, u + 1), EOS_ID, dtype=ys.dtype, device=ys.device)
    ys_out = torch.full((b, u + 1), IGNORE_ID, dtype=ys.dtype, device=ys.device)
    ys_in[:, 0] = SOS_ID
    for i in range(b):
        n = int(y_lens[i])
        ys_in[i, 1:n + 1], ys_out[i, :n], ys_out[i, n] = ys[i, :n], ys[i, :n], EOS_ID
    return ys_in, ys_out


class Trainer:
    def __init__(self, model, optimizer, scheduler, args, device):
        self.model, self.optimizer, self.scheduler, self.args, self.device = model, optimizer, scheduler, args, device
        self.scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
        self.criterion_att = LabelSmoothingLoss(args.vocab, args.lsm_weight)
        self.specaug = SpecAugment()
        self.step = 0

    def train_step(self, batch, batch_idx):
        feats, feat_lens, ys, y_lens = (t.to(self.device) for t in batch)
        feats = self.specaug(feats, feat_lens)
        feats = feats.to(dtype=next(self.model.parameters()).dtype)
        ys_in, ys_out = add_sos_eos(ys, y_lens)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.args.amp):
            ctc_logits, dec_logits, enc_lens = self.model(feats, feat_lens, ys_in)
        att_loss = self.criterion_att(dec_logits, ys_out)  # expect: AMP002
        log_probs = ctc_logits.log_softmax(dim=-1).transpose(0, 1)
        ctc_loss = F.ctc_loss(log_probs, ys, enc_lens, y_lens, blank=BLANK_ID, zero_infinity=True)  # expect: AMP002
        loss = self.args.ctc_weight * ctc_loss + (1 - self.args.ctc_weight) * att_loss
        self.scaler.scale(loss / self.args.accum_grad).backward()
        if (batch_idx + 1) % self.args.accum_grad == 0:
            self._optimizer_step()
        return loss.item(), ctc_loss.item(), att_loss.item()

    def _optimizer_step(self):
        self.scaler.unscale_(self.optimizer)
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        if torch.isfinite(grad_norm):
            self.scaler.step(self.optimizer)  # expect: AMP006
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        tot, n = 0.0, 0
        for feats, feat_lens, ys, y_lens in loader:
            feats = feats.to(self.device, dtype=next(self.model.parameters()).dtype)
            ys_in, ys_out = add_sos_eos(ys.to(self.device), y_lens)
            _, dec_logits, _ = self.model(feats, feat_lens.to(self.device), ys_in)
            tot += self.criterion_att(dec_logits, ys_out).item()
            n += 1
        self.model.train()
        return tot / max(n, 1)

    def save(self, path, epoch):
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                    "epoch": epoch, "step": self.step}, path)


def export_for_serving(model, path):
    serving = copy.deepcopy(model).half().eval()
    torch.jit.save(torch.jit.script(serving), path)


def synthetic_batches(n, n_mels, vocab, bs):
    for _ in range(n):
        feat_lens = torch.randint(200, 400, (bs,))
        feats = torch.log(torch.rand(bs, int(feat_lens.max()), n_mels) + 1e-6)
        y_lens = torch.randint(5, 30, (bs,))
        ys = torch.randint(2, vocab, (bs, int(y_lens.max())))
        yield feats, feat_lens, ys, y_lens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n-mels", type=int, default=80)
    p.add_argument("--vocab", type=int, default=500)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--steps-per-epoch", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=25000)
    p.add_argument("--weight-decay", type=float, default=1e-6)
    p.add_argument("--ctc-weight", type=float, default=0.3)
    p.add_argument("--lsm-weight", type=float, default=0.1)
    p.add_argument("--accum-grad", type=int, default=4)
    p.add_argument("--grad-clip", type=float, default=5.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--pure-fp16", action="store_true")
    p.add_argument("--exp-dir", default="exp/asr")
    p.add_argument("--resume", default=None)
    args = p.parse_args()
    os.makedirs(args.exp_dir, exist_ok=True)
    device = torch.device("cuda")

    model = ASRModel(args.n_mels, args.vocab)
    if args.pure_fp16:
        model = model.half()
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) ** -0.5, (s + 1) * args.warmup ** -1.5) * args.warmup ** 0.5)
    trainer = Trainer(model, optimizer, scheduler, args, device)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        trainer.scaler.load_state_dict(ckpt["scaler"])
        start_epoch, trainer.step = ckpt["epoch"] + 1, ckpt["step"]

    best = float("inf")
    for epoch in range(start_epoch, args.epochs):
        model.train()
        for i, batch in enumerate(synthetic_batches(args.steps_per_epoch, args.n_mels, args.vocab, args.batch_size)):
            loss, ctc, att = trainer.train_step(batch, i)
            if i % 100 == 0:
                print(f"epoch {epoch} step {trainer.step} loss {loss:.3f} ctc {ctc:.3f} att {att:.3f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}")
        cv_loss = trainer.evaluate(synthetic_batches(20, args.n_mels, args.vocab, args.batch_size))
        trainer.save(os.path.join(args.exp_dir, f"{epoch}.pt"), epoch)
        if cv_loss < best:
            best = cv_loss
            export_for_serving(model, os.path.join(args.exp_dir, "final.zip"))


if __name__ == "__main__":
    main()
