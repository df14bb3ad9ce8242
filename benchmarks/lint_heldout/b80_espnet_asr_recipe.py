#!/usr/bin/env python3
"""Conformer-CTC recipe with language-ID and VAD auxiliary heads.

Stages (ESPnet-style, driven by the YAML config):
    3: train           python b80_espnet_asr_recipe.py --config conf/train_conformer_ctc.yaml --stage 3
    4: adapt CTC head  python b80_espnet_asr_recipe.py --config conf/train_conformer_ctc.yaml --stage 4
    5: decode          python b80_espnet_asr_recipe.py --config conf/train_conformer_ctc.yaml --stage 5
"""
import argparse
import logging
import math
import os
import random
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from asr_lite.data import build_dataloader
from asr_lite.frontend import LogMelFrontend, SpecAugment
from asr_lite.text import CharTokenizer, ctc_greedy_decode, word_error_rate

DEFAULT_CONFIG = """
model:
  d_model: 256
  num_blocks: 12
  num_heads: 4
  ffn_dim: 1024
  kernel_size: 31
  dropout: 0.1
  num_langs: 8
train:
  use_amp: true          # fp16 autocast + GradScaler
  max_epoch: 60
  accum_grad: 4
  grad_clip: 5.0
  lr: 0.002
  warmup_steps: 25000
  lid_weight: 0.1
  vad_weight: 0.05
adapt:
  precision: bf16        # fp16 | bf16 | 32
  lr: 0.0005
  max_steps: 2000
"""


def load_config(path, overrides=()):
    cfg = yaml.safe_load(DEFAULT_CONFIG)
    if path is not None:
        with open(path) as f:
            user = yaml.safe_load(f) or {}
        for section, values in user.items():
            cfg.setdefault(section, {}).update(values)
    for item in overrides:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        cfg[section][name] = yaml.safe_load(value)
    return cfg


def make_pad_mask(lengths, max_len=None):
    seq = torch.arange(max_len or int(lengths.max()), device=lengths.device)
    return seq.unsqueeze(0) >= lengths.unsqueeze(1)


class Conv2dSubsampling(nn.Module):
    """Conv2d subsampling to 1/4 length."""

    def __init__(self, idim, odim, dropout):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, x_len):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))
        x_len = ((x_len - 1) // 2 - 1) // 2
        return self.dropout(x), x_len


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=5000):
        super().__init__()
        self.xscale = math.sqrt(d_model)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)

    def forward(self, x):
        return x * self.xscale + self.pe[:, : x.size(1)]


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        b = x.size(0)
        q = self.linear_q(x).view(b, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(x).view(b, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        mask = pad_mask.unsqueeze(1).unsqueeze(2)  # (batch, 1, 1, time)
        min_value = torch.finfo(scores.dtype).min
        scores = scores.masked_fill(mask, min_value)
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        out = torch.matmul(self.dropout(attn), v).transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k)
        return self.linear_out(out)


class ConvolutionModule(nn.Module):
    def __init__(self, channels, kernel_size):
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(channels, 2 * channels, 1)
        self.depthwise_conv = nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2, groups=channels)
        self.norm = nn.BatchNorm1d(channels)
        self.pointwise_conv2 = nn.Conv1d(channels, channels, 1)

    def forward(self, x, pad_mask):
        x = x.masked_fill(pad_mask.unsqueeze(-1), 0.0).transpose(1, 2)
        x = F.glu(self.pointwise_conv1(x), dim=1)
        x = F.silu(self.norm(self.depthwise_conv(x)))
        return self.pointwise_conv2(x).transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, d_model, num_heads, ffn_dim, kernel_size, dropout):
        super().__init__()
        self.ffn1 = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, ffn_dim), nn.SiLU(), nn.Dropout(dropout), nn.Linear(ffn_dim, d_model))
        self.ffn2 = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, ffn_dim), nn.SiLU(), nn.Dropout(dropout), nn.Linear(ffn_dim, d_model))
        self.norm_mha = nn.LayerNorm(d_model)
        self.mha = MultiHeadedAttention(num_heads, d_model, dropout)
        self.norm_conv = nn.LayerNorm(d_model)
        self.conv = ConvolutionModule(d_model, kernel_size)
        self.norm_final = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        x = x + 0.5 * self.dropout(self.ffn1(x))
        x = x + self.dropout(self.mha(self.norm_mha(x), pad_mask))
        x = x + self.dropout(self.conv(self.norm_conv(x), pad_mask))
        x = x + 0.5 * self.dropout(self.ffn2(x))
        return self.norm_final(x)


class ConformerEncoder(nn.Module):
    def __init__(self, input_dim, d_model, num_blocks, num_heads, ffn_dim, kernel_size, dropout):
        super().__init__()
        self.embed = Conv2dSubsampling(input_dim, d_model, dropout)
        self.pos_enc = PositionalEncoding(d_model)
        self.blocks = nn.ModuleList([ConformerBlock(d_model, num_heads, ffn_dim, kernel_size, dropout) for _ in range(num_blocks)])

    def forward(self, feats, feat_len):
        x, enc_len = self.embed(feats, feat_len)
        x = self.pos_enc(x)
        pad_mask = make_pad_mask(enc_len, x.size(1))
        for block in self.blocks:
            x = block(x, pad_mask)
        return x, enc_len, pad_mask


class LanguageIDHead(nn.Module):
    """x-vector style statistics pooling over encoder frames, then a linear classifier."""

    def __init__(self, d_model, num_langs, bottleneck=256):
        super().__init__()
        self.proj = nn.Linear(d_model, bottleneck)
        self.classifier = nn.Linear(2 * bottleneck, num_langs)

    def forward(self, enc):
        h = self.proj(enc)
        mean = h.mean(dim=1)  # expect: AMP004
        std = torch.sqrt(h.var(dim=1) + 1e-8)  # expect: AMP004 AMP011
        return self.classifier(torch.cat([mean, std], dim=-1))


class ConformerCTCModel(nn.Module):
    def __init__(self, input_dim, vocab_size, num_langs, d_model=256, num_blocks=12, num_heads=4,
                 ffn_dim=1024, kernel_size=31, dropout=0.1):
        super().__init__()
        self.encoder = ConformerEncoder(input_dim, d_model, num_blocks, num_heads, ffn_dim, kernel_size, dropout)
        self.ctc_head = nn.Linear(d_model, vocab_size)
        self.lid_head = LanguageIDHead(d_model, num_langs)
        self.vad_head = nn.Linear(d_model, 1)

    def forward(self, feats, feat_len):
        enc, enc_len, _ = self.encoder(feats, feat_len)
        return self.ctc_head(enc), enc_len, self.lid_head(enc), self.vad_head(enc).squeeze(-1)


def build_model(conf):
    return ConformerCTCModel(**conf)


def frame_labels_to_enc_rate(vad, num_frames):
    return F.interpolate(vad[:, None].float(), size=num_frames, mode="nearest")[:, 0]


def train_one_epoch(model, loader, frontend, spec_aug, optimizer, scheduler, scaler, cfg, epoch, device):
    tcfg = cfg["train"]
    accum_grad = tcfg["accum_grad"]
    use_amp = scaler is not None
    ctc_loss = nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)
    model.train()
    total, n_batches = 0.0, 0
    for it, batch in enumerate(loader):
        audio, audio_len = batch["audio"].to(device), batch["audio_len"].to(device)
        tokens, token_len = batch["tokens"].to(device), batch["token_len"].to(device)
        lang_ids = batch["lang_id"].to(device)

        # feature extraction stays in fp32
        with torch.autocast("cuda", enabled=False):
            feats, feat_len = frontend(audio.float(), audio_len)
            feats = spec_aug(feats, feat_len)

        with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
            logits, enc_len, lid_logits, vad_logits = model(feats, feat_len)
            log_probs = logits.float().log_softmax(dim=-1).transpose(0, 1)
            ctc = ctc_loss(log_probs, tokens, enc_len, token_len) / audio.size(0)
            vad_target = frame_labels_to_enc_rate(batch["vad"].to(device), vad_logits.size(1))
            vad_loss = F.binary_cross_entropy(torch.sigmoid(vad_logits), vad_target)  # expect: AMP003
        lid_loss = F.cross_entropy(lid_logits, lang_ids, label_smoothing=0.1)  # expect: AMP002
        loss = ctc + tcfg["lid_weight"] * lid_loss + tcfg["vad_weight"] * vad_loss
        loss = loss / accum_grad

        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        total += loss.item() * accum_grad
        n_batches += 1
        if (it + 1) % accum_grad != 0:
            continue

        if scaler is not None:
            # Unscales the gradients of optimizer's assigned params in-place
            scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg["grad_clip"])
        if not torch.isfinite(grad_norm):
            logging.warning(f"The grad norm is {grad_norm}. Skipping updating the model.")
            if scaler is not None:
                # the scaler skips the step itself; update() still has to run
                scaler.step(optimizer)
                scaler.update()
        elif scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if (it + 1) % (100 * accum_grad) == 0:
            logging.info(f"epoch {epoch} iter {it + 1}: loss={total / n_batches:.3f} grad_norm={grad_norm:.2f}")
    return total / max(n_batches, 1)


def evaluate(model, loader, frontend, tokenizer, device, use_amp):
    model.eval()
    errs, words, lid_correct, utts = 0, 0, 0, 0
    with torch.inference_mode():
        for batch in loader:
            audio, audio_len = batch["audio"].to(device), batch["audio_len"].to(device)
            feats, feat_len = frontend(audio.float(), audio_len)
            with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
                logits, enc_len, lid_logits, _ = model(feats, feat_len)
            hyps = ctc_greedy_decode(logits.argmax(dim=-1), enc_len, tokenizer)
            e, n = word_error_rate(hyps, batch["text"])
            errs, words = errs + e, words + n
            lid_correct += (lid_logits.argmax(dim=-1).cpu() == batch["lang_id"]).sum().item()
            utts += audio.size(0)
    model.train()
    return errs / max(words, 1), lid_correct / max(utts, 1)


def adapt_ctc_head(model, loader, frontend, cfg, device):
    """Re-fit only the CTC output layer on in-domain data; the encoder stays frozen."""
    acfg = cfg["adapt"]
    base = model.module if isinstance(model, DDP) else model
    base.encoder.requires_grad_(False)
    base.encoder.eval()
    optimizer = torch.optim.AdamW(base.ctc_head.parameters(), lr=acfg["lr"], weight_decay=0.0)

    precision = str(acfg.get("precision", "32"))
    if precision in ("16", "fp16", "16-mixed"):
        amp_ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
    elif precision in ("bf16", "bf16-mixed"):
        amp_ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        amp_ctx = nullcontext()

    ctc_loss = nn.CTCLoss(blank=0, zero_infinity=True)
    step = 0
    while step < acfg["max_steps"]:
        for batch in loader:
            audio, audio_len = batch["audio"].to(device), batch["audio_len"].to(device)
            tokens, token_len = batch["tokens"].to(device), batch["token_len"].to(device)
            with torch.no_grad():
                feats, feat_len = frontend(audio.float(), audio_len)
            with amp_ctx:
                with torch.no_grad():
                    enc, enc_len, _ = base.encoder(feats, feat_len)
                logits = base.ctc_head(enc)
                log_probs = logits.float().log_softmax(dim=-1).transpose(0, 1)
                loss = ctc_loss(log_probs, tokens, enc_len, token_len)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(base.ctc_head.parameters(), acfg.get("grad_clip", 5.0))
            optimizer.step()
            step += 1
            if step >= acfg["max_steps"]:
                break
    base.encoder.requires_grad_(True)
    return base


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, default=None)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--exp-dir", type=Path, default=Path("exp/conformer_ctc"))
    parser.add_argument("--seed", type=int, default=777)
    parser.add_argument("override", nargs="*", help="section.key=value")
    args = parser.parse_args()
    cfg = load_config(args.config, args.override)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s (%(module)s:%(lineno)d) %(levelname)s: %(message)s")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if distributed:
        dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)

    tokenizer = CharTokenizer.from_file(args.exp_dir / "tokens.txt")
    frontend = LogMelFrontend(n_mels=80).to(device)
    spec_aug = SpecAugment(freq_mask=27, time_mask_ratio=0.05, num_time_masks=10)
    model = build_model(dict(cfg["model"], input_dim=80, vocab_size=len(tokenizer))).to(device)
    if distributed:
        model = DDP(model, device_ids=[local_rank])
    train_loader = build_dataloader(args.exp_dir / "dump/train", tokenizer, shuffle=True, distributed=distributed)
    dev_loader = build_dataloader(args.exp_dir / "dump/dev", tokenizer, shuffle=False)

    tcfg = cfg["train"]
    optimizer = torch.optim.Adam(model.parameters(), lr=tcfg["lr"], betas=(0.9, 0.98), eps=1e-9)
    warmup = tcfg["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, (warmup / (s + 1)) ** 0.5))
    scaler = torch.amp.GradScaler("cuda") if tcfg["use_amp"] else None

    best_wer = float("inf")
    if args.stage <= 3:
        for epoch in range(1, tcfg["max_epoch"] + 1):
            if distributed:
                train_loader.sampler.set_epoch(epoch)
            loss = train_one_epoch(model, train_loader, frontend, spec_aug, optimizer, scheduler, scaler, cfg, epoch, device)
            wer, lid_acc = evaluate(model, dev_loader, frontend, tokenizer, device, tcfg["use_amp"])
            logging.info(f"epoch {epoch}: train_loss={loss:.3f} dev_wer={wer:.4f} lid_acc={lid_acc:.3f}")
            if local_rank == 0:
                state = {
                    "model": (model.module if distributed else model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "epoch": epoch,
                }
                torch.save(state, args.exp_dir / "checkpoint.pth")
                if wer < best_wer:
                    best_wer = wer
                    torch.save(state["model"], args.exp_dir / "valid.wer.best.pth")
    if args.stage <= 4:
        adapt_ctc_head(model, build_dataloader(args.exp_dir / "dump/adapt", tokenizer, shuffle=True), frontend, cfg, device)
        torch.save((model.module if distributed else model).state_dict(), args.exp_dir / "adapted.pth")
    if args.stage <= 5:
        wer, lid_acc = evaluate(model, dev_loader, frontend, tokenizer, device, tcfg["use_amp"])
        logging.info(f"final dev WER {wer:.4f}, LID accuracy {lid_acc:.3f}")


if __name__ == "__main__":
    main()
