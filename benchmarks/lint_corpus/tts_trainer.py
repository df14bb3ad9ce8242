"""Text-to-speech acoustic model trainer (Tacotron-style) with guided attention loss."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def guided_attention_weights(n, t, g=0.2):
    grid_n = torch.arange(n).float()[:, None] / n
    grid_t = torch.arange(t).float()[None, :] / t
    return 1.0 - torch.exp(-((grid_n - grid_t) ** 2) / (2 * g * g))


class Tacotron2Loss(nn.Module):
    def forward(self, mel_out, mel_out_postnet, gate_out, mel_target, gate_target):
        mel_loss = F.mse_loss(mel_out, mel_target) + F.mse_loss(mel_out_postnet, mel_target)
        gate_loss = F.binary_cross_entropy_with_logits(gate_out.view(-1, 1), gate_target.view(-1, 1))
        return mel_loss + gate_loss


class LocationAttention(nn.Module):
    def __init__(self, attn_dim, enc_dim, dec_dim, n_filters=32, kernel=31):
        super().__init__()
        self.query = nn.Linear(dec_dim, attn_dim, bias=False)
        self.memory = nn.Linear(enc_dim, attn_dim, bias=False)
        self.location_conv = nn.Conv1d(2, n_filters, kernel, padding=kernel // 2, bias=False)
        self.location_dense = nn.Linear(n_filters, attn_dim, bias=False)
        self.v = nn.Linear(attn_dim, 1, bias=False)
        self.score_mask_value = -float("inf")

    def forward(self, query, memory, processed_memory, attention_weights_cat, mask):
        processed_query = self.query(query.unsqueeze(1))
        processed_loc = self.location_dense(self.location_conv(attention_weights_cat).transpose(1, 2))
        energies = self.v(torch.tanh(processed_query + processed_loc + processed_memory)).squeeze(-1)
        if mask is not None:
            energies = energies.masked_fill(mask, self.score_mask_value)
        weights = F.softmax(energies, dim=1)
        return torch.bmm(weights.unsqueeze(1), memory).squeeze(1), weights


class Trainer:
    def __init__(self, model, hparams):
        self.model = model.cuda()
        self.hparams = hparams
        self.criterion = Tacotron2Loss()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=hparams.lr, weight_decay=1e-6, eps=1e-6)
        self.scaler = torch.amp.GradScaler("cuda", enabled=hparams.fp16_run)
        self.iteration = 0

    def train_step(self, batch):
        text, text_lens, mel, gate, mel_lens = [t.cuda(non_blocking=True) for t in batch]
        self.model.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.hparams.fp16_run):
            mel_out, mel_post, gate_out, alignments = self.model(text, text_lens, mel, mel_lens)
        loss = self.criterion(mel_out, mel_post, gate_out, mel, gate)  # expect: AMP002
        W = guided_attention_weights(alignments.size(1), alignments.size(2)).to(alignments.device)
        attn_loss = (alignments * W).mean()
        total = loss + self.hparams.guided_weight * attn_loss
        self.scaler.scale(total).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hparams.grad_clip_thresh)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.iteration += 1
        return total.item(), grad_norm, not math.isfinite(grad_norm)

    def learning_rate_decay(self):
        if self.iteration > self.hparams.decay_start:
            lr = self.hparams.lr * math.exp(-(self.iteration - self.hparams.decay_start) / self.hparams.decay_rate)
            for g in self.optimizer.param_groups:
                g["lr"] = max(lr, 1e-5)

    @torch.no_grad()
    def validate(self, loader):
        self.model.eval()
        total = 0.0
        for batch in loader:
            text, text_lens, mel, gate, mel_lens = [t.cuda() for t in batch]
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.hparams.fp16_run):
                mel_out, mel_post, gate_out, _ = self.model(text, text_lens, mel, mel_lens)
                total += self.criterion(mel_out, mel_post, gate_out, mel, gate).item()
        self.model.train()
        return total / len(loader)
