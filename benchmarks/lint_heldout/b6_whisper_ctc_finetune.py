"""Fine-tune Whisper for ASR with an auxiliary CTC head on the encoder (hybrid CTC/attention).

The CTC branch regularises the encoder towards monotonic alignments, which helps on
long-form and accented speech; at inference only the seq2seq decoder is used.

    python finetune_whisper_ctc.py --model openai/whisper-small \
        --train-manifest data/train.jsonl --eval-manifest data/dev.jsonl --ctc-weight 0.3
"""
import argparse
import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import soundfile as sf
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler
from torch.utils.data import DataLoader, Dataset
from transformers import WhisperForConditionalGeneration, WhisperProcessor

BF16 = torch.bfloat16


@dataclass
class FinetuneConfig:
    model_name: str = "openai/whisper-small"
    language: str = "english"
    train_manifest: str = "data/train.jsonl"
    eval_manifest: str = "data/dev.jsonl"
    lr: float = 1e-5
    ctc_lr: float = 5e-4
    weight_decay: float = 0.0
    warmup_steps: int = 500
    max_steps: int = 20000
    batch_size: int = 16
    grad_accum: int = 2
    max_grad_norm: float = 1.0
    ctc_weight: float = 0.3
    freeze_encoder: bool = False
    eval_every: int = 1000
    output_dir: str = "checkpoints/whisper-ctc"
    device: str = "cuda"


class ManifestDataset(Dataset):
    """jsonl with {"audio": path, "text": transcript}; audio is 16 kHz mono."""

    def __init__(self, path, processor, max_seconds=30.0):
        with open(path) as f:
            rows = [json.loads(l) for l in f]
        self.rows = [r for r in rows if r.get("duration", 0.0) <= max_seconds]
        self.processor = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        audio, sr = sf.read(row["audio"], dtype="float32")
        feats = self.processor.feature_extractor(audio, sampling_rate=sr, return_tensors="pt").input_features[0]
        labels = self.processor.tokenizer(row["text"]).input_ids
        return feats, labels


def make_collate(pad_id):
    def collate(batch):
        feats = torch.stack([f for f, _ in batch])
        max_len = max(len(l) for _, l in batch)
        labels = torch.full((len(batch), max_len), -100, dtype=torch.long)
        ctc_targets, ctc_lengths = [], []
        for i, (_, l) in enumerate(batch):
            labels[i, : len(l)] = torch.tensor(l)
            core = [t for t in l[1:-1] if t != pad_id]  # drop the prefix/eot specials for CTC
            ctc_targets.extend(core)
            ctc_lengths.append(len(core))
        return {"input_features": feats, "labels": labels, "ctc_targets": torch.tensor(ctc_targets, dtype=torch.long), "ctc_lengths": torch.tensor(ctc_lengths, dtype=torch.long)}

    return collate


def word_error_rate(refs, hyps):
    errors, words = 0, 0
    for r, h in zip(refs, hyps):
        r, h = r.lower().split(), h.lower().split()
        d = list(range(len(h) + 1))
        for i in range(1, len(r) + 1):
            prev, d[0] = d[0], i
            for j in range(1, len(h) + 1):
                cur = min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
                prev, d[j] = d[j], cur
        errors += d[len(h)]
        words += len(r)
    return errors / max(words, 1)


class CTCHead(nn.Module):
    def __init__(self, d_model, vocab_size, dropout=0.1):
        super().__init__()
        self.proj = nn.Sequential(nn.Dropout(dropout), nn.Linear(d_model, vocab_size + 1))  # last index is blank

    def forward(self, enc):
        return self.proj(enc)


class WhisperCTCTrainer:
    def __init__(self, cfg, model, processor, train_loader, eval_loader):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model = model.to(self.device)
        self.processor = processor
        self.train_loader, self.eval_loader = train_loader, eval_loader
        self.blank_id = len(processor.tokenizer)
        self.ctc_head = CTCHead(model.config.d_model, len(processor.tokenizer)).to(self.device)

        if cfg.freeze_encoder:
            encoder = self.model.model.encoder
            encoder.requires_grad_(False)
            encoder.to(BF16)  # frozen: halves its activation memory, never updated

        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim < 2 or "layer_norm" in n else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
                {"params": list(self.ctc_head.parameters()), "lr": cfg.ctc_lr, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(0.9, 0.98),
            eps=1e-6,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        self.scaler = GradScaler()  # expect: AMP009 AMP010
        self.step = 0
        self.micro_step = 0

    def _lr_lambda(self, step):
        if step < self.cfg.warmup_steps:
            return (step + 1) / self.cfg.warmup_steps
        progress = (step - self.cfg.warmup_steps) / max(1, self.cfg.max_steps - self.cfg.warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    def _prepare(self, batch):
        feats = batch["input_features"].to(self.device, non_blocking=True).to(BF16)  # expect: AMP001
        labels = batch["labels"].to(self.device, non_blocking=True)
        return feats, labels, batch["ctc_targets"].to(self.device), batch["ctc_lengths"].to(self.device)

    def training_step(self, batch):
        self.model.train()
        self.ctc_head.train()
        feats, labels, ctc_targets, ctc_lengths = self._prepare(batch)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = self.model(input_features=feats, labels=labels)
            ctc_logits = self.ctc_head(out.encoder_last_hidden_state)
        att_loss = out.loss
        log_probs = ctc_logits.log_softmax(dim=-1).transpose(0, 1)  # (T, B, V+1)
        input_lengths = torch.full((log_probs.size(1),), log_probs.size(0), dtype=torch.long, device=self.device)
        ctc_loss = F.ctc_loss(log_probs, ctc_targets, input_lengths, ctc_lengths, blank=self.blank_id, zero_infinity=True)  # expect: AMP002
        loss = (1.0 - self.cfg.ctc_weight) * att_loss + self.cfg.ctc_weight * ctc_loss
        loss = loss / self.cfg.grad_accum
        self.scaler.scale(loss).backward()
        self.micro_step += 1
        if self.micro_step % self.cfg.grad_accum == 0:
            self.optimizer_step()
        return {"loss": loss.item() * self.cfg.grad_accum, "att": att_loss.item(), "ctc": ctc_loss.item()}

    def optimizer_step(self):
        if self.cfg.max_grad_norm > 0:
            params = list(self.model.parameters()) + list(self.ctc_head.parameters())
            torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)  # expect: AMP006
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    @torch.no_grad()
    def evaluate(self, max_batches=50):
        self.model.eval()
        total, n = 0.0, 0
        refs, hyps = [], []
        pad_id = self.processor.tokenizer.pad_token_id
        for i, batch in enumerate(self.eval_loader):
            if i >= max_batches:
                break
            feats, labels, _, _ = self._prepare(batch)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = self.model(input_features=feats, labels=labels)
                generated = self.model.generate(input_features=feats, max_new_tokens=225)
            total += out.loss.item()
            n += 1
            hyps += self.processor.batch_decode(generated, skip_special_tokens=True)
            refs += self.processor.batch_decode(labels.masked_fill(labels == -100, pad_id), skip_special_tokens=True)
        self.model.train()
        return total / max(n, 1), word_error_rate(refs, hyps)

    def save(self, tag):
        path = os.path.join(self.cfg.output_dir, tag)
        os.makedirs(path, exist_ok=True)
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)
        torch.save({"ctc_head": self.ctc_head.state_dict(), "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(), "step": self.step, "config": asdict(self.cfg)}, os.path.join(path, "trainer_state.pt"))

    def export_for_inference(self, path):
        serving = copy.deepcopy(self.model).half().eval()
        serving.save_pretrained(path)

    def fit(self):
        best_wer = float("inf")
        t0 = time.time()
        while self.step < self.cfg.max_steps:
            for batch in self.train_loader:
                logs = self.training_step(batch)
                if self.micro_step % self.cfg.grad_accum:
                    continue
                if self.step % 50 == 0:
                    dt = time.time() - t0
                    t0 = time.time()
                    print(f"step {self.step} loss {logs['loss']:.4f} (att {logs['att']:.4f} ctc {logs['ctc']:.4f}) lr {self.scheduler.get_last_lr()[0]:.2e} {dt:.1f}s")
                if self.step % self.cfg.eval_every == 0:
                    eval_loss, wer = self.evaluate()
                    print(f"eval step {self.step}: loss {eval_loss:.4f} WER {wer * 100:.2f}")
                    if wer < best_wer:
                        best_wer = wer
                        self.save("best")
                if self.step >= self.cfg.max_steps:
                    break
        self.save("last")
        self.export_for_inference(os.path.join(self.cfg.output_dir, "serving"))
        return best_wer


def main():
    p = argparse.ArgumentParser()
    for name, default in asdict(FinetuneConfig()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=default)
        else:
            p.add_argument(flag, type=type(default), default=default)
    cfg = FinetuneConfig(**vars(p.parse_args()))

    processor = WhisperProcessor.from_pretrained(cfg.model_name, language=cfg.language, task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(cfg.model_name)
    model.config.forced_decoder_ids = None
    collate = make_collate(processor.tokenizer.pad_token_id)
    train_loader = DataLoader(ManifestDataset(cfg.train_manifest, processor), batch_size=cfg.batch_size, shuffle=True, num_workers=4, collate_fn=collate, drop_last=True)
    eval_loader = DataLoader(ManifestDataset(cfg.eval_manifest, processor), batch_size=cfg.batch_size, num_workers=2, collate_fn=collate)

    trainer = WhisperCTCTrainer(cfg, model, processor, train_loader, eval_loader)
    best = trainer.fit()
    print(f"best WER {best * 100:.2f}")


if __name__ == "__main__":
    main()
