#!/usr/bin/env/python3
"""Recipe for training a joint CTC/attention ASR system with an auxiliary
frame-level voice-activity objective on LibriSpeech.

The encoder is shared between the three objectives. A trimmed copy of the
``Brain`` training loop is vendored at the top of this file so the recipe can
be run against older toolkit versions whose ``Brain`` lacks the AMP hooks.

To run this recipe, do the following:
> python train_asr_vad.py hparams/conformer_vad.yaml --auto_mix_prec

Authors
 * adapted from the LibriSpeech transformer recipe
"""

import copy
import logging
import math
import sys
from enum import Enum, auto
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import speechbrain as sb
from hyperpyyaml import load_hyperpyyaml

logger = logging.getLogger(__name__)


class Stage(Enum):
    TRAIN = auto()
    VALID = auto()
    TEST = auto()


class Brain:
    """Vendored subset of ``speechbrain.core.Brain``.

    Only the pieces this recipe needs: optimizer handling, gradient checks and
    the evaluation step. Older releases created the scaler with
    ``torch.cuda.amp.GradScaler``; we keep the same attribute name.
    """

    def __init__(self, modules=None, opt_class=None, hparams=None, run_opts=None, checkpointer=None):
        run_opts = run_opts or {}
        self.device = run_opts.get("device", "cuda:0")
        self.auto_mix_prec = run_opts.get("auto_mix_prec", False)
        self.max_grad_norm = run_opts.get("max_grad_norm", 5.0)
        self.grad_accumulation_factor = run_opts.get("grad_accumulation_factor", 1)
        self.nonfinite_patience = run_opts.get("nonfinite_patience", 3)
        self.hparams = SimpleNamespace(**hparams) if hparams is not None else None
        self.opt_class = opt_class
        self.checkpointer = checkpointer
        self.modules = nn.ModuleDict(modules).to(self.device)
        self.step = 0
        self.optimizer_step = 0
        self.nonfinite_count = 0
        self.avg_train_loss = 0.0
        self.scaler = torch.cuda.amp.GradScaler(enabled=self.auto_mix_prec)  # expect: AMP009

    def init_optimizers(self):
        if self.opt_class is not None:
            self.optimizer = self.opt_class(self.modules.parameters())
            if self.checkpointer is not None:
                self.checkpointer.add_recoverable("optimizer", self.optimizer)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)

    def check_gradients(self, loss):
        """Returns False (skip the update) when the loss is not finite,
        otherwise clips the gradients and returns True."""
        if not torch.isfinite(loss):
            self.nonfinite_count += 1
            logger.warning(f"Loss is {loss}.")
            if self.nonfinite_count > self.nonfinite_patience:
                raise ValueError("Loss is not finite and patience is exhausted.")
            return False
        if self.max_grad_norm > 0.0:
            torch.nn.utils.clip_grad_norm_((p for p in self.modules.parameters()), self.max_grad_norm)
        return True

    @torch.no_grad()
    def evaluate_batch(self, batch, stage):
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.auto_mix_prec):
            out = self.compute_forward(batch, stage=stage)
            loss = self.compute_objectives(out, batch, stage=stage)
        return loss.detach().cpu()

    def update_average(self, loss, avg_loss):
        if torch.isfinite(loss):
            avg_loss -= avg_loss / self.step
            avg_loss += float(loss) / self.step
        return avg_loss


class ContentAttention(nn.Module):
    """Additive attention used by the auxiliary alignment decoder."""

    def __init__(self, enc_dim, dec_dim, attn_dim):
        super().__init__()
        self.mlp_enc = nn.Linear(enc_dim, attn_dim)
        self.mlp_dec = nn.Linear(dec_dim, attn_dim)
        self.mlp_attn = nn.Linear(attn_dim, 1, bias=False)
        self.mask = None

    def reset(self):
        self.mask = None

    def forward(self, enc_states, enc_len, dec_states):
        if self.mask is None:
            b, t, _ = enc_states.shape
            self.mask = torch.arange(t, device=enc_states.device)[None, :] < enc_len[:, None]
        attn = self.mlp_attn(torch.tanh(self.mlp_enc(enc_states) + self.mlp_dec(dec_states).unsqueeze(1))).squeeze(-1)
        attn = attn.masked_fill(~self.mask, -1e9)  # expect: AMP007
        attn = F.softmax(attn, dim=-1)
        context = torch.bmm(attn.unsqueeze(1), enc_states).squeeze(1)
        return context, attn


def mel_filterbank(n_mels, n_fft, sample_rate, f_min=0.0, f_max=None):
    """Triangular mel filters as an (n_fft // 2 + 1, n_mels) matrix."""
    f_max = f_max or sample_rate / 2
    to_mel = lambda f: 2595.0 * math.log10(1.0 + f / 700.0)
    mel_pts = torch.linspace(to_mel(f_min), to_mel(f_max), n_mels + 2)
    hz_pts = 700.0 * (10 ** (mel_pts / 2595.0) - 1.0)
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    lower = (freqs[:, None] - hz_pts[None, :-2]) / (hz_pts[1:-1] - hz_pts[:-2])[None, :]
    upper = (hz_pts[None, 2:] - freqs[:, None]) / (hz_pts[2:] - hz_pts[1:-1])[None, :]
    return torch.clamp(torch.minimum(lower, upper), min=0.0)


class ASR(Brain):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vad_cost = nn.BCELoss()
        self.mel_fbanks = mel_filterbank(self.hparams.n_mels, self.hparams.n_fft, self.hparams.sample_rate).to(self.device)
        self.window = torch.hann_window(self.hparams.win_length, device=self.device)

    def compute_features(self, wavs):
        """Log-mel features, plus energy-based pseudo labels for the VAD head."""
        spec = torch.stft(wavs, n_fft=self.hparams.n_fft, hop_length=self.hparams.hop_length, win_length=self.hparams.win_length, window=self.window, return_complex=True)
        power = spec.abs().pow(2).transpose(1, 2)
        mel = torch.matmul(power, self.mel_fbanks)
        energy = mel.mean(dim=-1)  # expect: AMP004
        vad_targets = (energy > 0.05 * energy.amax(dim=1, keepdim=True)).float()
        return torch.log(mel + 1e-10), vad_targets  # expect: AMP011

    def compute_forward(self, batch, stage):
        """Forward computations from the waveform batches to the output probabilities."""
        batch = batch.to(self.device)
        wavs, wav_lens = batch.sig
        tokens_bos, _ = batch.tokens_bos

        feats, vad_targets = self.compute_features(wavs)
        feats = self.modules.normalize(feats, wav_lens, epoch=getattr(self.hparams, "epoch", 0))
        if stage == Stage.TRAIN and hasattr(self.hparams, "fea_augment"):
            feats, _ = self.hparams.fea_augment(feats, wav_lens)

        src = self.modules.CNN(feats)
        enc_out, pred = self.modules.Transformer(src, tokens_bos, wav_lens, pad_idx=self.hparams.pad_index)

        logits = self.modules.ctc_lin(enc_out)
        p_ctc = F.log_softmax(logits, dim=-1)
        p_seq = F.log_softmax(self.modules.seq_lin(pred), dim=-1)

        stride = self.hparams.subsampling
        vad_targets = vad_targets[:, ::stride][:, : enc_out.size(1)]
        vad_prob = torch.sigmoid(self.modules.vad_lin(enc_out)).squeeze(-1)
        return p_ctc, p_seq, wav_lens, vad_prob, vad_targets

    def compute_objectives(self, predictions, batch, stage):
        """Computes the weighted CTC + seq2seq + VAD loss."""
        p_ctc, p_seq, wav_lens, vad_prob, vad_targets = predictions
        tokens_eos, tokens_eos_lens = batch.tokens_eos
        tokens, tokens_lens = batch.tokens

        loss_seq = self.hparams.seq_cost(p_seq, tokens_eos, length=tokens_eos_lens)
        with torch.autocast(device_type="cuda", enabled=False):
            loss_ctc = self.hparams.ctc_cost(p_ctc.float(), tokens, wav_lens, tokens_lens)
        loss_vad = self.vad_cost(vad_prob, vad_targets)  # expect: AMP003

        ctc_w = self.hparams.ctc_weight
        loss = ctc_w * loss_ctc + (1 - ctc_w) * loss_seq + self.hparams.vad_weight * loss_vad

        if stage != Stage.TRAIN:
            self.acc_metric.append(p_seq, tokens_eos, tokens_eos_lens)
        return loss

    def fit_batch(self, batch):
        """Train the parameters given a single batch in input."""
        should_step = self.step % self.grad_accumulation_factor == 0
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=self.auto_mix_prec):
            outputs = self.compute_forward(batch, Stage.TRAIN)
            loss = self.compute_objectives(outputs, batch, Stage.TRAIN)
            self.scaler.scale(loss / self.grad_accumulation_factor).backward()  # expect: AMP008
        if should_step:
            if self.check_gradients(loss):  # expect: AMP005
                self.scaler.step(self.optimizer)
            self.scaler.update()
            self.zero_grad()
            self.optimizer_step += 1
            self.hparams.noam_annealing(self.optimizer)
        return loss.detach().cpu()

    def on_stage_start(self, stage, epoch):
        if hasattr(self.modules, "attn"):
            self.modules.attn.reset()
        if stage != Stage.TRAIN:
            self.acc_metric = self.hparams.acc_computer()

    def on_stage_end(self, stage, stage_loss, epoch):
        stage_stats = {"loss": stage_loss}
        if stage == Stage.TRAIN:
            self.train_stats = stage_stats
            return
        stage_stats["ACC"] = self.acc_metric.summarize()
        if stage == Stage.VALID:
            lr = self.hparams.noam_annealing.current_lr
            self.hparams.train_logger.log_stats(
                stats_meta={"epoch": epoch, "lr": lr, "steps": self.optimizer_step},
                train_stats=self.train_stats,
                valid_stats=stage_stats,
            )
            if self.checkpointer is not None:
                self.checkpointer.save_and_keep_only(meta={"ACC": stage_stats["ACC"], "epoch": epoch}, max_keys=["ACC"], num_to_keep=5)

    def fit(self, epoch_counter, train_loader, valid_loader):
        self.init_optimizers()
        best_loss = float("inf")
        for epoch in epoch_counter:
            self.modules.train()
            self.on_stage_start(Stage.TRAIN, epoch)
            self.avg_train_loss = 0.0
            for batch in train_loader:
                self.step += 1
                loss = self.fit_batch(batch)
                self.avg_train_loss = self.update_average(loss, self.avg_train_loss)
            self.on_stage_end(Stage.TRAIN, self.avg_train_loss, epoch)
            self.step = 0

            self.modules.eval()
            self.on_stage_start(Stage.VALID, epoch)
            avg_valid_loss = 0.0
            for batch in valid_loader:
                self.step += 1
                loss = self.evaluate_batch(batch, stage=Stage.VALID)
                avg_valid_loss = self.update_average(loss, avg_valid_loss)
            self.step = 0
            best_loss = min(best_loss, avg_valid_loss)
            self.on_stage_end(Stage.VALID, avg_valid_loss, epoch)
        return best_loss

    def export_for_inference(self, path):
        """Writes a compact fp16 copy of the acoustic model for the streaming server."""
        export_modules = copy.deepcopy(self.modules).half().eval()
        torch.save(export_modules.state_dict(), path)


if __name__ == "__main__":
    hparams_file, run_opts, overrides = sb.parse_arguments(sys.argv[1:])
    with open(hparams_file) as fin:
        hparams = load_hyperpyyaml(fin, overrides)

    modules = dict(hparams["modules"])
    modules["vad_lin"] = nn.Linear(hparams["d_model"], 1)
    modules["attn"] = ContentAttention(hparams["d_model"], hparams["d_model"], 256)

    asr_brain = ASR(
        modules=modules,
        opt_class=hparams["Adam"],
        hparams=hparams,
        run_opts=run_opts,
        checkpointer=hparams["checkpointer"],
    )
    train_loader, valid_loader = hparams["train_loader"], hparams["valid_loader"]
    asr_brain.fit(hparams["epoch_counter"], train_loader, valid_loader)
    asr_brain.export_for_inference(hparams["save_folder"] + "/asr_fp16.ckpt")
