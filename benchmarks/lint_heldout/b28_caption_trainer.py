"""Show, Attend and Tell image captioning with a small callback-driven Trainer.

The Trainer owns the optimisation loop (mixed precision, gradient accumulation,
optional encoder fine-tuning) and exposes hooks that callbacks use for logging,
checkpointing and early stopping.
"""
import copy
import os
from dataclasses import dataclass, field
from typing import List, Optional

import h5py
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from nltk.translate.bleu_score import corpus_bleu
from torch.utils.data import DataLoader, Dataset


# --------------------------------------------------------------------------- model
class Encoder(nn.Module):
    def __init__(self, encoded_image_size=14, fine_tune=False):
        super().__init__()
        resnet = torchvision.models.resnet101(weights="IMAGENET1K_V2")
        self.resnet = nn.Sequential(*list(resnet.children())[:-2])
        self.adaptive_pool = nn.AdaptiveAvgPool2d((encoded_image_size, encoded_image_size))
        for p in self.resnet.parameters():
            p.requires_grad = False
        for c in list(self.resnet.children())[5:]:
            for p in c.parameters():
                p.requires_grad = fine_tune

    def forward(self, images):
        out = self.adaptive_pool(self.resnet(images))
        return out.permute(0, 2, 3, 1)


class Attention(nn.Module):
    def __init__(self, encoder_dim, decoder_dim, attention_dim):
        super().__init__()
        self.encoder_att = nn.Linear(encoder_dim, attention_dim)
        self.decoder_att = nn.Linear(decoder_dim, attention_dim)
        self.full_att = nn.Linear(attention_dim, 1)
        self.relu = nn.ReLU()
        self.softmax = nn.Softmax(dim=1)

    def forward(self, encoder_out, decoder_hidden):
        att1 = self.encoder_att(encoder_out)
        att2 = self.decoder_att(decoder_hidden)
        att = self.full_att(self.relu(att1 + att2.unsqueeze(1))).squeeze(2)
        alpha = self.softmax(att)
        awe = (encoder_out * alpha.unsqueeze(2)).sum(dim=1)
        return awe, alpha


class DecoderWithAttention(nn.Module):
    def __init__(self, attention_dim, embed_dim, decoder_dim, vocab_size, banned_ids=(), encoder_dim=2048, dropout=0.5):
        super().__init__()
        self.vocab_size = vocab_size
        self.attention = Attention(encoder_dim, decoder_dim, attention_dim)
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.dropout = nn.Dropout(p=dropout)
        self.decode_step = nn.LSTMCell(embed_dim + encoder_dim, decoder_dim, bias=True)
        self.init_h = nn.Linear(encoder_dim, decoder_dim)
        self.init_c = nn.Linear(encoder_dim, decoder_dim)
        self.f_beta = nn.Linear(decoder_dim, encoder_dim)
        self.fc = nn.Linear(decoder_dim, vocab_size)
        banned = torch.zeros(vocab_size, dtype=torch.bool)
        banned[list(banned_ids)] = True
        self.register_buffer("banned", banned, persistent=False)
        self.fc.bias.data.fill_(0)

    def init_hidden_state(self, encoder_out):
        mean_encoder_out = encoder_out.float().mean(dim=1)
        return self.init_h(mean_encoder_out), self.init_c(mean_encoder_out)

    def forward(self, encoder_out, captions, caption_lengths):
        bsz = encoder_out.size(0)
        encoder_out = encoder_out.reshape(bsz, -1, encoder_out.size(-1))
        embeddings = self.embedding(captions)
        h, c = self.init_hidden_state(encoder_out)
        steps = int(caption_lengths.max().item()) - 1
        logits, alphas = [], []
        for t in range(steps):
            awe, alpha = self.attention(encoder_out, h)
            gate = torch.sigmoid(self.f_beta(h))
            h, c = self.decode_step(torch.cat([embeddings[:, t], gate * awe], dim=1), (h, c))
            preds = self.fc(self.dropout(h))
            preds = preds.masked_fill(self.banned, -1e9)  # expect: AMP007
            logits.append(preds)
            alphas.append(alpha)
        return torch.stack(logits, dim=1), torch.stack(alphas, dim=1)

    @torch.no_grad()
    def greedy_decode(self, encoder_out, start_idx, max_len=50):
        bsz = encoder_out.size(0)
        encoder_out = encoder_out.reshape(bsz, -1, encoder_out.size(-1))
        h, c = self.init_hidden_state(encoder_out)
        word = torch.full((bsz,), start_idx, dtype=torch.long, device=encoder_out.device)
        out = []
        for _ in range(max_len):
            awe, _ = self.attention(encoder_out, h)
            gate = torch.sigmoid(self.f_beta(h))
            h, c = self.decode_step(torch.cat([self.embedding(word), gate * awe], dim=1), (h, c))
            logp = F.log_softmax(self.fc(h), dim=1)
            logp[:, self.banned] = -1e9
            word = logp.argmax(dim=1)
            out.append(word)
        return torch.stack(out, dim=1)


class CaptionModel(nn.Module):
    def __init__(self, vocab_size, banned_ids, fine_tune_encoder=False, attention_dim=512, embed_dim=512, decoder_dim=512):
        super().__init__()
        self.encoder = Encoder(fine_tune=fine_tune_encoder)
        self.decoder = DecoderWithAttention(attention_dim, embed_dim, decoder_dim, vocab_size, banned_ids)

    def forward(self, images, captions, caption_lengths):
        return self.decoder(self.encoder(images), captions, caption_lengths)


# --------------------------------------------------------------------------- callbacks
class Callback:
    def on_train_start(self, trainer): ...
    def on_after_backward(self, trainer): ...
    def on_batch_end(self, trainer, logs): ...
    def on_validation_end(self, trainer, metrics): ...
    def on_train_end(self, trainer): ...


class GradNormLogger(Callback):
    every = 100

    def on_after_backward(self, trainer):
        if trainer.global_step % self.every:
            return
        norms = [p.grad.detach().float().norm() for p in trainer.model.parameters() if p.grad is not None]
        if norms:
            total = torch.stack(norms).norm().item() / trainer.scaler.get_scale()
            print(f"[step {trainer.global_step}] grad-norm {total:.3f}")


class EarlyStopping(Callback):
    def __init__(self, monitor="bleu4", mode="max", patience=20):
        self.monitor, self.mode, self.patience = monitor, mode, patience
        self.best = -1e9 if mode == "max" else 1e9
        self.bad_epochs = 0

    def on_validation_end(self, trainer, metrics):
        value = metrics[self.monitor]
        improved = value > self.best if self.mode == "max" else value < self.best
        if improved:
            self.best, self.bad_epochs = value, 0
        else:
            self.bad_epochs += 1
            trainer.should_stop = self.bad_epochs >= self.patience


class ModelCheckpoint(Callback):
    def __init__(self, dirpath, monitor="bleu4", save_half=True):
        self.dirpath, self.monitor, self.save_half, self.best = dirpath, monitor, save_half, -float("inf")
        os.makedirs(dirpath, exist_ok=True)

    def on_validation_end(self, trainer, metrics):
        if metrics[self.monitor] <= self.best:
            return
        self.best = metrics[self.monitor]
        to_save = copy.deepcopy(trainer.model)
        if self.save_half:
            to_save = to_save.half()
        torch.save({"model": to_save.state_dict(), "epoch": trainer.epoch, "metrics": metrics},
                   os.path.join(self.dirpath, "BEST_checkpoint.pth.tar"))


# --------------------------------------------------------------------------- trainer
def _make_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(enabled=enabled)


@dataclass
class TrainerConfig:
    epochs: int = 20
    precision: str = "fp16"
    grad_clip: Optional[float] = 5.0
    alpha_c: float = 1.0
    accum_steps: int = 1
    fine_tune_encoder: bool = False
    encoder_lr: float = 1e-4
    decoder_lr: float = 4e-4
    log_every: int = 100
    special_tokens: List[str] = field(default_factory=lambda: ["<start>", "<end>", "<pad>"])


class CaptionTrainer:
    def __init__(self, model, train_loader, val_loader, word_map, cfg: TrainerConfig, callbacks=None, device="cuda"):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.train_loader, self.val_loader = train_loader, val_loader
        self.word_map, self.cfg = word_map, cfg
        self.pad_idx, self.start_idx = word_map["<pad>"], word_map["<start>"]
        self.callbacks = callbacks or []
        self.use_amp = cfg.precision in ("fp16", "bf16")
        self.amp_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
        self.scaler = _make_scaler(self.use_amp and self.amp_dtype == torch.float16)
        dec_params = [p for p in model.decoder.parameters() if p.requires_grad]
        self.decoder_optimizer = torch.optim.Adam(dec_params, lr=cfg.decoder_lr)
        self.encoder_optimizer = None
        if cfg.fine_tune_encoder:
            enc_params = [p for p in model.encoder.parameters() if p.requires_grad]
            self.encoder_optimizer = torch.optim.Adam(enc_params, lr=cfg.encoder_lr)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
        self.global_step, self.micro_step, self.epoch, self.should_stop = 0, 0, 0, False

    def call_hook(self, name, *args):
        for cb in self.callbacks:
            getattr(cb, name)(self, *args)

    def _to_device(self, batch):
        return [t.to(self.device, non_blocking=True) for t in batch[:3]]

    def autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype, enabled=self.use_amp)

    def train_step(self, batch):
        imgs, caps, caplens = self._to_device(batch)
        with torch.autocast(device_type=self.device.type, dtype=self.amp_dtype, enabled=self.use_amp):
            logits, alphas = self.model(imgs, caps, caplens)
            targets = caps[:, 1: logits.size(1) + 1]
            mask = targets != self.pad_idx
        loss = self.criterion(logits[mask], targets[mask])  # expect: AMP002
        loss = loss + self.cfg.alpha_c * ((1.0 - alphas.sum(dim=1)) ** 2).mean()
        self.scaler.scale(loss / self.cfg.accum_steps).backward()
        self.call_hook("on_after_backward")
        self.micro_step += 1
        if self.micro_step % self.cfg.accum_steps == 0:
            if self.cfg.grad_clip is not None:
                self.scaler.unscale_(self.decoder_optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.decoder.parameters(), self.cfg.grad_clip)
            self.scaler.step(self.decoder_optimizer)
            if self.encoder_optimizer is not None:
                self.encoder_optimizer.step()  # expect: AMP006
            self.scaler.update()
            self.decoder_optimizer.zero_grad(set_to_none=True)
            if self.encoder_optimizer is not None:
                self.encoder_optimizer.zero_grad(set_to_none=True)
            self.global_step += 1
        return loss.detach()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        total, n = 0.0, 0
        references, hypotheses = [], []
        for imgs, caps, caplens, allcaps in self.val_loader:
            imgs, caps, caplens = imgs.to(self.device), caps.to(self.device), caplens.to(self.device)
            with self.autocast():
                logits, _ = self.model(imgs, caps, caplens)
                targets = caps[:, 1: logits.size(1) + 1]
                mask = targets != self.pad_idx
                loss = self.criterion(logits[mask], targets[mask])
                seqs = self.model.decoder.greedy_decode(self.model.encoder(imgs), self.start_idx)
            total, n = total + loss.item(), n + 1
            skip = {self.word_map[t] for t in self.cfg.special_tokens}
            for refs in allcaps.tolist():
                references.append([[w for w in ref if w not in skip] for ref in refs])
            for seq in seqs.tolist():
                hypotheses.append([w for w in seq if w not in skip])
        self.model.train()
        return {"val_loss": total / max(n, 1), "bleu4": corpus_bleu(references, hypotheses)}

    def fit(self):
        self.call_hook("on_train_start")
        for epoch in range(self.cfg.epochs):
            self.epoch = epoch
            self.model.train()
            for i, batch in enumerate(self.train_loader):
                loss = self.train_step(batch)
                self.call_hook("on_batch_end", {"loss": loss.item(), "step": self.global_step})
                if i % self.cfg.log_every == 0:
                    print(f"epoch {epoch} [{i}/{len(self.train_loader)}] loss {loss.item():.4f}")
            metrics = self.validate()
            print(f"epoch {epoch}: val loss {metrics['val_loss']:.4f} BLEU-4 {metrics['bleu4']:.4f}")
            self.call_hook("on_validation_end", metrics)
            if self.should_stop:
                break
        self.call_hook("on_train_end")


class AcceleratedCaptionTrainer(CaptionTrainer):
    """Same loop driven by accelerate (multi-GPU, mixed precision from the launcher config)."""

    def __init__(self, *args, accelerator=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.accelerator = accelerator
        self.model, self.decoder_optimizer, self.train_loader = accelerator.prepare(
            self.model, self.decoder_optimizer, self.train_loader)

    def train_step(self, batch):
        imgs, caps, caplens = batch[:3]
        with self.accelerator.autocast():
            logits, alphas = self.model(imgs, caps, caplens)
            targets = caps[:, 1: logits.size(1) + 1]
            mask = targets != self.pad_idx
            loss = self.criterion(logits[mask], targets[mask])
            loss = loss + self.cfg.alpha_c * ((1.0 - alphas.sum(dim=1)) ** 2).mean()
        self.accelerator.backward(loss)
        if self.accelerator.sync_gradients and self.cfg.grad_clip is not None:
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.decoder_optimizer.step()
        self.decoder_optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return loss.detach()


class CaptionDataset(Dataset):
    def __init__(self, data_folder, split, captions_per_image=5):
        self.imgs = h5py.File(os.path.join(data_folder, f"{split}_IMAGES.hdf5"), "r")["images"]
        self.captions = np.load(os.path.join(data_folder, f"{split}_CAPTIONS.npy"))
        self.caplens = np.load(os.path.join(data_folder, f"{split}_CAPLENS.npy"))
        self.cpi = captions_per_image
        self.mean, self.std = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __len__(self):
        return len(self.captions)

    def __getitem__(self, i):
        img = (torch.from_numpy(self.imgs[i // self.cpi]).float().div(255.0) - self.mean) / self.std
        start = (i // self.cpi) * self.cpi
        return (img, torch.as_tensor(self.captions[i], dtype=torch.long), torch.as_tensor(self.caplens[i], dtype=torch.long),
                torch.as_tensor(self.captions[start: start + self.cpi], dtype=torch.long))


def main(data_folder="data/coco_5_cap_per_img_5_min_word_freq", precision="fp16"):
    word_map = torch.load(os.path.join(data_folder, "WORDMAP.pt"))
    banned = [word_map["<pad>"], word_map["<start>"]]
    model = CaptionModel(len(word_map), banned, fine_tune_encoder=True)
    train_loader = DataLoader(CaptionDataset(data_folder, "TRAIN"), batch_size=32, shuffle=True, num_workers=4, pin_memory=True)
    val_loader = DataLoader(CaptionDataset(data_folder, "VAL"), batch_size=32, num_workers=4, pin_memory=True)
    cfg = TrainerConfig(precision=precision, fine_tune_encoder=True)
    callbacks = [GradNormLogger(), EarlyStopping(patience=20), ModelCheckpoint("checkpoints/sat")]
    CaptionTrainer(model, train_loader, val_loader, word_map, cfg, callbacks).fit()


if __name__ == "__main__":
    main()
