"""FastSpeech 2 with a reference (style) encoder, trained on LJSpeech/VCTK style data.

Variance adaptor predicts log-duration, pitch and energy; mel + postnet losses.
"""
import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn


def get_mask_from_lengths(lengths, max_len=None):
    max_len = max_len or int(lengths.max().item())
    ids = torch.arange(0, max_len, device=lengths.device).unsqueeze(0).expand(lengths.size(0), -1)
    return ids >= lengths.unsqueeze(1)


def sinusoid_table(n_pos, d_hid):
    pos = np.arange(n_pos)[:, None] / np.power(10000, 2 * (np.arange(d_hid)[None] // 2) / d_hid)
    pos[:, 0::2], pos[:, 1::2] = np.sin(pos[:, 0::2]), np.cos(pos[:, 1::2])
    return torch.tensor(pos, dtype=torch.float32)


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature):
        super().__init__()
        self.temperature = temperature

    def forward(self, q, k, v, mask=None):
        attn = torch.bmm(q, k.transpose(1, 2)) / self.temperature
        if mask is not None:
            attn = attn.masked_fill(mask, -1e9)  # expect: AMP007
        attn = F.softmax(attn, dim=2)
        return torch.bmm(attn, v), attn


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, dropout=0.1):
        super().__init__()
        self.n_head, self.d_k = n_head, d_model // n_head
        self.w_qs = nn.Linear(d_model, d_model)
        self.w_ks = nn.Linear(d_model, d_model)
        self.w_vs = nn.Linear(d_model, d_model)
        self.attention = ScaledDotProductAttention(self.d_k ** 0.5)
        self.layer_norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        residual = x
        q = self.w_qs(x).view(b, t, self.n_head, self.d_k).permute(2, 0, 1, 3).reshape(-1, t, self.d_k)
        k = self.w_ks(x).view(b, t, self.n_head, self.d_k).permute(2, 0, 1, 3).reshape(-1, t, self.d_k)
        v = self.w_vs(x).view(b, t, self.n_head, self.d_k).permute(2, 0, 1, 3).reshape(-1, t, self.d_k)
        mask = mask.unsqueeze(1).expand(-1, t, -1).repeat(self.n_head, 1, 1) if mask is not None else None
        out, _ = self.attention(q, k, v, mask=mask)
        out = out.view(self.n_head, b, t, self.d_k).permute(1, 2, 0, 3).reshape(b, t, -1)
        return self.layer_norm(self.dropout(self.fc(out)) + residual)


class FFTBlock(nn.Module):
    def __init__(self, d_model, n_head, d_inner, kernel=(9, 1), dropout=0.1):
        super().__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, dropout)
        self.conv1 = nn.Conv1d(d_model, d_inner, kernel[0], padding=kernel[0] // 2)
        self.conv2 = nn.Conv1d(d_inner, d_model, kernel[1], padding=kernel[1] // 2)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x, mask):
        x = self.slf_attn(x, mask).masked_fill(mask.unsqueeze(-1), 0)
        y = self.conv2(F.relu(self.conv1(x.transpose(1, 2)))).transpose(1, 2)
        return self.norm(x + y).masked_fill(mask.unsqueeze(-1), 0)


class VariancePredictor(nn.Module):
    def __init__(self, d_model, filt=256, kernel=3, dropout=0.5):
        super().__init__()
        self.conv1 = nn.Conv1d(d_model, filt, kernel, padding=1)
        self.ln1 = nn.LayerNorm(filt)
        self.conv2 = nn.Conv1d(filt, filt, kernel, padding=1)
        self.ln2 = nn.LayerNorm(filt)
        self.linear = nn.Linear(filt, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask):
        x = self.dropout(self.ln1(F.relu(self.conv1(x.transpose(1, 2))).transpose(1, 2)))
        x = self.dropout(self.ln2(F.relu(self.conv2(x.transpose(1, 2))).transpose(1, 2)))
        return self.linear(x).squeeze(-1).masked_fill(mask, 0.0)


class LengthRegulator(nn.Module):
    def forward(self, x, durations, max_len):
        out = [torch.repeat_interleave(seq, dur.long(), dim=0) for seq, dur in zip(x, durations)]
        mel_len = torch.tensor([o.size(0) for o in out], device=x.device)
        out = torch.stack([F.pad(o, (0, 0, 0, max_len - o.size(0)), value=0.0) for o in out])
        return out, mel_len


class ReferenceEncoder(nn.Module):
    """Utterance-level style vector from a reference mel (GST-like, no tokens)."""

    def __init__(self, n_mels, d_model):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv1d(n_mels, 256, 3, padding=1), nn.ReLU(), nn.Conv1d(256, 256, 3, stride=2, padding=1), nn.ReLU()
        )
        self.gru = nn.GRU(256, 128, batch_first=True)
        self.ref_proj = nn.Linear(128, d_model)

    def forward(self, mel):
        h, _ = self.gru(self.convs(mel.transpose(1, 2)).transpose(1, 2))
        h = self.ref_proj(h)
        style = h.mean(dim=1)  # expect: AMP004
        style = style / (style.abs().amax(dim=-1, keepdim=True) + 1e-8)  # expect: AMP011
        return style


class FastSpeech2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["d_model"]
        self.src_emb = nn.Embedding(cfg["n_symbols"], d, padding_idx=0)
        self.register_buffer("pos", sinusoid_table(cfg["max_seq_len"] + 1, d).unsqueeze(0), persistent=False)
        self.encoder = nn.ModuleList([FFTBlock(d, 2, 1024) for _ in range(cfg["enc_layers"])])
        self.decoder = nn.ModuleList([FFTBlock(d, 2, 1024) for _ in range(cfg["dec_layers"])])
        self.ref_enc = ReferenceEncoder(cfg["n_mels"], d)
        self.duration_predictor = VariancePredictor(d)
        self.pitch_predictor = VariancePredictor(d)
        self.energy_predictor = VariancePredictor(d)
        self.register_buffer("pitch_bins", torch.linspace(cfg["pitch_min"], cfg["pitch_max"], 255))
        self.register_buffer("energy_bins", torch.linspace(cfg["energy_min"], cfg["energy_max"], 255))
        self.pitch_emb = nn.Embedding(256, d)
        self.energy_emb = nn.Embedding(256, d)
        self.length_regulator = LengthRegulator()
        self.mel_linear = nn.Linear(d, cfg["n_mels"])
        self.postnet = nn.Sequential(
            nn.Conv1d(cfg["n_mels"], 512, 5, padding=2), nn.BatchNorm1d(512), nn.Tanh(),
            nn.Conv1d(512, 512, 5, padding=2), nn.BatchNorm1d(512), nn.Tanh(),
            nn.Conv1d(512, cfg["n_mels"], 5, padding=2),
        )

    def forward(self, texts, src_lens, max_src_len, ref_mels, mel_lens, max_mel_len, p_target, e_target, d_target):
        src_mask = get_mask_from_lengths(src_lens, max_src_len)
        mel_mask = get_mask_from_lengths(mel_lens, max_mel_len)
        x = self.src_emb(texts) + self.pos[:, : texts.size(1)]
        for layer in self.encoder:
            x = layer(x, src_mask)
        x = x + self.ref_enc(ref_mels).unsqueeze(1)
        log_d = self.duration_predictor(x, src_mask)
        p_pred = self.pitch_predictor(x, src_mask)
        e_pred = self.energy_predictor(x, src_mask)
        x = x + self.pitch_emb(torch.bucketize(p_target, self.pitch_bins))
        x = x + self.energy_emb(torch.bucketize(e_target, self.energy_bins))
        x, _ = self.length_regulator(x, d_target, max_mel_len)
        x = x + self.pos[:, : x.size(1)]
        for layer in self.decoder:
            x = layer(x, mel_mask)
        mel = self.mel_linear(x)
        post = mel + self.postnet(mel.transpose(1, 2)).transpose(1, 2)
        return {"mel": mel, "postnet_mel": post, "pitch": p_pred, "energy": e_pred, "log_duration": log_d, "src_mask": src_mask, "mel_mask": mel_mask}


class FastSpeech2Loss(nn.Module):
    def forward(self, out, mel_target, p_target, e_target):
        src_keep, mel_keep = ~out["src_mask"], ~out["mel_mask"]
        mel_target = mel_target[:, : out["mel"].size(1)]
        mel_loss = F.l1_loss(out["mel"].masked_select(mel_keep.unsqueeze(-1)), mel_target.masked_select(mel_keep.unsqueeze(-1)))
        post_loss = F.l1_loss(out["postnet_mel"].masked_select(mel_keep.unsqueeze(-1)), mel_target.masked_select(mel_keep.unsqueeze(-1)))
        pitch_loss = F.mse_loss(out["pitch"].masked_select(src_keep), p_target.masked_select(src_keep))
        energy_loss = F.mse_loss(out["energy"].masked_select(src_keep), e_target.masked_select(src_keep))
        total = mel_loss + post_loss + pitch_loss + energy_loss
        return {"total": total, "mel": mel_loss, "postnet": post_loss, "pitch": pitch_loss, "energy": energy_loss}


def to_device(batch, device):
    texts = batch["texts"].to(device, non_blocking=True)
    src_lens = batch["src_lens"].to(device)
    mels = batch["mels"].to(device, non_blocking=True).type(torch.cuda.HalfTensor)  # expect: AMP001
    mel_lens = batch["mel_lens"].to(device)
    pitches = batch["pitches"].to(device)
    energies = batch["energies"].to(device)
    durations = batch["durations"].to(device)
    return texts, src_lens, int(src_lens.max()), mels, mel_lens, int(mel_lens.max()), pitches, energies, durations


@torch.no_grad()
def evaluate(model, criterion, loader, device):
    model.eval()
    totals = []
    for batch in loader:
        texts, src_lens, max_src, mels, mel_lens, max_mel, pitches, energies, durations = to_device(batch, device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(texts, src_lens, max_src, mels, mel_lens, max_mel, pitches, energies, durations)
            losses = criterion(out, mels, pitches, energies)
            log_dur = torch.log(durations.float() + 1.0)
            dur_loss = F.mse_loss(out["log_duration"].masked_select(~out["src_mask"]), log_dur.masked_select(~out["src_mask"]))
        totals.append((losses["total"] + dur_loss).item())
    model.train()
    return sum(totals) / max(len(totals), 1)


@torch.inference_mode()
def synthesize(model, texts, ref_mel, device):
    model = model.half().eval()
    src_lens = torch.tensor([texts.size(1)], device=device)
    return model.ref_enc(ref_mel.to(device).half()), src_lens


def train(cfg, model, train_loader, val_loader, device):
    criterion = FastSpeech2Loss()
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0)
    warmup = cfg["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) ** -0.5, (s + 1) * warmup ** -1.5) * warmup ** 0.5)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg["amp"])
    step = 0
    while step < cfg["total_steps"]:
        for batch in train_loader:
            texts, src_lens, max_src, mels, mel_lens, max_mel, pitches, energies, durations = to_device(batch, device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg["amp"]):
                out = model(texts, src_lens, max_src, mels, mel_lens, max_mel, pitches, energies, durations)
                losses = criterion(out, mels, pitches, energies)
            log_dur_target = torch.log(durations.float() + 1.0)
            src_keep = ~out["src_mask"]
            dur_loss = F.mse_loss(out["log_duration"].masked_select(src_keep), log_dur_target.masked_select(src_keep))  # expect: AMP002
            total = losses["total"] + cfg["dur_weight"] * dur_loss
            optimizer.zero_grad(set_to_none=True)
            scaled = scaler.scale(total)
            scaled.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip_thresh"])  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % cfg["log_step"] == 0:
                print(f"step {step} total {total.item():.4f} mel {losses['mel'].item():.4f} dur {dur_loss.item():.4f}")
            if step % cfg["val_step"] == 0:
                print(f"val loss {evaluate(model, criterion, val_loader, device):.4f}")
            if step % cfg["save_step"] == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, os.path.join(cfg["ckpt_dir"], f"{step}.pth.tar"))
            if step >= cfg["total_steps"]:
                break


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="config/LJSpeech/train.yaml")
    parser.add_argument("--restore_step", type=int, default=0)
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    device = torch.device("cuda")
    model = FastSpeech2(cfg).to(device)
    if args.restore_step:
        ckpt = torch.load(os.path.join(cfg["ckpt_dir"], f"{args.restore_step}.pth.tar"), map_location=device)
        model.load_state_dict(ckpt["model"])
    from dataset import build_loaders  # project-local

    train_loader, val_loader = build_loaders(cfg)
    os.makedirs(cfg["ckpt_dir"], exist_ok=True)
    train(cfg, model, train_loader, val_loader, device)


if __name__ == "__main__":
    main()
