"""Onsets and Frames piano transcription (Hawthorne et al., 2018), MAESTRO recipe.

Older releases of this script used ``torch.cuda.amp.autocast`` for evaluation
only; training now runs the acoustic stacks in float16 as well.
"""
import argparse
from itertools import cycle

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

N_KEYS = 88


class FreqNorm(nn.Module):
    """Per-channel, per-frequency normalisation over time (small-batch friendly)."""

    def __init__(self, channels):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1, 1))

    def forward(self, x):
        mu = x.mean(dim=2, keepdim=True)  # expect: AMP004
        sd = x.std(dim=2, keepdim=True)  # expect: AMP004
        return (x - mu) / (sd + 1e-5) * self.gamma + self.beta


class ConvStack(nn.Module):
    def __init__(self, n_mels, d_out, c=48):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), FreqNorm(c), nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1), FreqNorm(c), nn.ReLU(),
            nn.MaxPool2d((1, 2)), nn.Dropout(0.25),
            nn.Conv2d(c, 2 * c, 3, padding=1), FreqNorm(2 * c), nn.ReLU(),
            nn.MaxPool2d((1, 2)), nn.Dropout(0.25),
        )
        self.fc = nn.Linear(2 * c * (n_mels // 4), d_out)
        self.drop = nn.Dropout(0.5)

    def _variance_scale(self, h):
        var = h.var(dim=-1, keepdim=True)  # expect: AMP004
        return h * torch.rsqrt(var + 1e-12)  # expect: AMP011

    def forward(self, mel):
        x = self.cnn(mel.unsqueeze(1))
        x = x.transpose(1, 2).flatten(2)
        return self.drop(self._variance_scale(self.fc(x)))


class BiLSTM(nn.Module):
    def __init__(self, d_in, d_hidden):
        super().__init__()
        self.rnn = nn.LSTM(d_in, d_hidden, batch_first=True, bidirectional=True)

    def forward(self, x):
        return self.rnn(x)[0]


class OnsetsAndFrames(nn.Module):
    def __init__(self, n_mels=229, d_model=768):
        super().__init__()
        d_half = d_model // 2
        self.onset_stack = nn.Sequential(ConvStack(n_mels, d_model), BiLSTM(d_model, d_half), nn.Linear(d_model, N_KEYS))
        self.offset_stack = nn.Sequential(ConvStack(n_mels, d_model), BiLSTM(d_model, d_half), nn.Linear(d_model, N_KEYS))
        self.frame_stack = nn.Sequential(ConvStack(n_mels, d_model), nn.Linear(d_model, N_KEYS))
        self.combined_stack = nn.Sequential(BiLSTM(3 * N_KEYS, d_half), nn.Linear(d_model, N_KEYS))
        self.velocity_stack = nn.Sequential(ConvStack(n_mels, d_model), nn.Linear(d_model, N_KEYS))

    def forward(self, mel):
        onset = self.onset_stack(mel)
        offset = self.offset_stack(mel)
        activation = self.frame_stack(mel)
        combined = torch.cat([torch.sigmoid(onset).detach(), torch.sigmoid(offset).detach(), activation], dim=-1)
        frame = self.combined_stack(combined)
        velocity = self.velocity_stack(mel)
        return {"onset": onset, "offset": offset, "frame": frame, "velocity": velocity}


def transcription_losses(preds, batch):
    losses = {
        f"loss/{k}": F.binary_cross_entropy_with_logits(preds[k], batch[k]) for k in ("onset", "offset", "frame")
    }
    onset_label = batch["onset"]
    err = onset_label * (batch["velocity"] - torch.sigmoid(preds["velocity"])) ** 2
    losses["loss/velocity"] = err.sum() / onset_label.sum().clamp(min=1.0)
    return losses


def make_eval_autocast():
    try:
        return torch.amp.autocast("cuda", dtype=torch.float16)
    except (AttributeError, TypeError):
        return torch.cuda.amp.autocast(dtype=torch.float16)


@torch.no_grad()
def evaluate(model, loader, threshold=0.5):
    model.eval()
    f1s = []
    for batch in loader:
        with make_eval_autocast():
            preds = model(batch["mel"].cuda())
        frame_pred = (torch.sigmoid(preds["frame"].float()) > threshold).cpu().numpy()
        frame_ref = batch["frame"].numpy() > 0.5
        tp = np.logical_and(frame_pred, frame_ref).sum()
        precision = tp / max(frame_pred.sum(), 1)
        recall = tp / max(frame_ref.sum(), 1)
        f1s.append(2 * precision * recall / max(precision + recall, 1e-8))
    model.train()
    return float(np.mean(f1s))


def train(args, train_loader, val_loader):
    model = OnsetsAndFrames(n_mels=args.n_mels, d_model=args.model_complexity * 16).cuda()
    optimizer = torch.optim.Adam(model.parameters(), args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.decay_steps, gamma=0.98)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)  # expect: AMP009
    batches = cycle(train_loader)
    for it in range(1, args.iterations + 1):
        batch = {k: v.cuda(non_blocking=True) for k, v in next(batches).items()}
        with torch.cuda.amp.autocast(enabled=args.amp, dtype=torch.float16):  # expect: AMP009
            preds = model(batch["mel"])
            losses = transcription_losses(preds, batch)
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if it % args.validation_interval == 0:
            print(f"it {it}: loss {loss.item():.4f} frame-F1 {evaluate(model, val_loader):.4f}")
            torch.save({"model": model.state_dict(), "scaler": scaler.state_dict()}, f"{args.logdir}/model-{it}.pt")
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-mels", dest="n_mels", type=int, default=229)
    parser.add_argument("--model-complexity", dest="model_complexity", type=int, default=48)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--decay-steps", dest="decay_steps", type=int, default=10000)
    parser.add_argument("--iterations", type=int, default=500000)
    parser.add_argument("--clip-norm", dest="clip_norm", type=float, default=3.0)
    parser.add_argument("--validation-interval", dest="validation_interval", type=int, default=1000)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--logdir", default="runs/transcriber")
    args = parser.parse_args()
    from maestro import build_loaders  # project-local MAESTRO reader

    train(args, *build_loaders(args))


if __name__ == "__main__":
    main()
