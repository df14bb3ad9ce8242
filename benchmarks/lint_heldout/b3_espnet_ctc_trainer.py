"""Conformer-CTC ASR trainer in the style of ESPnet/WeNet recipes (fbank input, CTC plus an end-of-utterance head)."""
import argparse
import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.utils import clip_grad_norm_


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward(self, x, mask):
        n_batch = x.size(0)
        q = self.linear_q(x).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(x).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        mask = mask.unsqueeze(1).eq(0)
        min_value = torch.finfo(scores.dtype).min
        scores = scores.masked_fill(mask, min_value)
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        out = torch.matmul(self.dropout(attn), v).transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(out)


class ConformerBlock(nn.Module):
    def __init__(self, d_model=256, n_head=4, kernel_size=15, dropout=0.1):
        super().__init__()
        self.ff1 = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.SiLU(), nn.Linear(4 * d_model, d_model))
        self.norm_mha = nn.LayerNorm(d_model)
        self.mha = MultiHeadedAttention(n_head, d_model, dropout)
        self.norm_conv = nn.LayerNorm(d_model)
        self.pointwise = nn.Conv1d(d_model, 2 * d_model, 1)
        self.depthwise = nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.bn = nn.BatchNorm1d(d_model)
        self.ff2 = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.SiLU(), nn.Linear(4 * d_model, d_model))
        self.norm_final = nn.LayerNorm(d_model)

    def forward(self, x, mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.mha(self.norm_mha(x), mask)
        c = self.norm_conv(x).masked_fill(~mask.transpose(1, 2), 0.0).transpose(1, 2)
        c = F.glu(self.pointwise(c), dim=1)
        c = F.silu(self.bn(self.depthwise(c)))
        x = x + c.transpose(1, 2)
        x = x + 0.5 * self.ff2(x)
        return self.norm_final(x)


class ConformerEncoder(nn.Module):
    def __init__(self, idim=80, d_model=256, num_blocks=12):
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv2d(1, d_model, 3, 2), nn.ReLU(), nn.Conv2d(d_model, d_model, 3, 2), nn.ReLU())
        self.out = nn.Linear(d_model * (((idim - 1) // 2 - 1) // 2), d_model)
        self.blocks = nn.ModuleList([ConformerBlock(d_model) for _ in range(num_blocks)])

    def forward(self, xs, xs_lens):
        x = self.subsample(xs.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))
        lens = ((xs_lens - 1) // 2 - 1) // 2
        mask = (torch.arange(t, device=x.device)[None, :] < lens[:, None]).unsqueeze(1)
        for blk in self.blocks:
            x = blk(x, mask)
        return x, lens


class ASRModel(nn.Module):
    def __init__(self, vocab_size, idim=80, d_model=256):
        super().__init__()
        self.encoder = ConformerEncoder(idim, d_model)
        self.ctc_lo = nn.Linear(d_model, vocab_size)
        self.eos_head = nn.Linear(d_model, 1)


class Trainer:
    def __init__(self, model, optimizer, scheduler, device, accum_grad=4, grad_clip=5.0, use_amp=False):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = device
        self.accum_grad = accum_grad
        self.grad_clip = grad_clip
        self.use_amp = use_amp
        self.num_updates = 0
        self.scaler = GradScaler(enabled=use_amp)  # expect: AMP009

    def _backward(self, loss):
        self.scaler.scale(loss / self.accum_grad).backward()

    def _step(self):
        grad_norm = clip_grad_norm_(self.model.parameters(), self.grad_clip)  # expect: AMP005
        if not torch.isfinite(grad_norm):
            logging.warning("non-finite grad norm %s at update %d", grad_norm.item(), self.num_updates)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.num_updates += 1
        return grad_norm

    def train_one_epoch(self, loader, epoch):
        self.model.train()
        for batch_idx, (keys, feats, feat_lens, ys, ys_lens, eos_target) in enumerate(loader):
            feats = feats.type("torch.cuda.HalfTensor")  # expect: AMP001
            feats = (feats - feats.mean(dim=1, keepdim=True)) / torch.sqrt(feats.var(dim=1, keepdim=True) + 1e-10)  # expect: AMP004 AMP011
            feat_lens, ys, ys_lens = feat_lens.to(self.device), ys.to(self.device), ys_lens.to(self.device)
            eos_target = eos_target.to(self.device)
            with autocast(enabled=self.use_amp):  # expect: AMP009
                enc_out, enc_lens = self.model.encoder(feats, feat_lens)
                ctc_logits = self.model.ctc_lo(enc_out)
                eos_prob = torch.sigmoid(self.model.eos_head(enc_out)).squeeze(-1)
                loss_eos = F.binary_cross_entropy(eos_prob, eos_target)  # expect: AMP003
            log_probs = ctc_logits.log_softmax(dim=-1).transpose(0, 1)
            loss_ctc = F.ctc_loss(log_probs, ys, enc_lens, ys_lens, blank=0, reduction="sum", zero_infinity=True) / feats.size(0)  # expect: AMP002
            loss = loss_ctc + 0.1 * loss_eos
            self._backward(loss)
            if (batch_idx + 1) % self.accum_grad == 0:
                grad_norm = self._step()
                if self.num_updates % 100 == 0:
                    logging.info("epoch %d update %d loss_ctc %.3f loss_eos %.3f grad_norm %.2f lr %.2e",
                                 epoch, self.num_updates, loss_ctc.item(), loss_eos.item(), grad_norm,
                                 self.optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def cv(self, loader):
        self.model.eval()
        total_loss, num_utts = 0.0, 0
        for keys, feats, feat_lens, ys, ys_lens, _ in loader:
            feats = feats.to(self.device)
            feats = (feats - feats.mean(dim=1, keepdim=True)) / torch.sqrt(feats.var(dim=1, keepdim=True) + 1e-10)
            feat_lens, ys, ys_lens = feat_lens.to(self.device), ys.to(self.device), ys_lens.to(self.device)
            with torch.autocast("cuda", enabled=self.use_amp):
                enc_out, enc_lens = self.model.encoder(feats, feat_lens)
                log_probs = self.model.ctc_lo(enc_out).log_softmax(dim=-1).transpose(0, 1)
                loss = F.ctc_loss(log_probs, ys, enc_lens, ys_lens, reduction="sum", zero_infinity=True)
            total_loss += loss.item()
            num_utts += feats.size(0)
        return total_loss / max(num_utts, 1)


@torch.inference_mode()
def recognize(model, feats, feat_lens):
    model = model.half().eval()
    enc_out, enc_lens = model.encoder(feats.half(), feat_lens)
    best = model.ctc_lo(enc_out).argmax(-1)
    hyps = []
    for seq, n in zip(best, enc_lens):
        seq = torch.unique_consecutive(seq[:n])
        hyps.append([t for t in seq.tolist() if t != 0])
    return hyps


def main(train_loader, cv_loader):
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab_size", type=int, default=5000)
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup_steps", type=int, default=25000)
    parser.add_argument("--use_amp", action="store_true")
    args = parser.parse_args()

    device = torch.device("cuda")
    model = ASRModel(args.vocab_size).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) ** -0.5, (s + 1) * args.warmup_steps ** -1.5) * args.warmup_steps ** 0.5)
    trainer = Trainer(model, optimizer, scheduler, device, use_amp=args.use_amp)
    best_cv = float("inf")
    for epoch in range(args.epochs):
        trainer.train_one_epoch(train_loader, epoch)
        cv_loss = trainer.cv(cv_loader)
        logging.info("epoch %d cv loss %.4f", epoch, cv_loss)
        if cv_loss < best_cv:
            best_cv = cv_loss
            torch.save({"model": model.state_dict(), "scaler": trainer.scaler.state_dict()}, "exp/best.pt")
