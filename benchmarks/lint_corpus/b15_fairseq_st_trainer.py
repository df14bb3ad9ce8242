# Speech-to-text trainer, written after fairseq's Trainer/task/criterion split.
import contextlib
import logging
import math
from argparse import Namespace

import torch
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=None, reduce=True):
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    if ignore_index is not None:
        pad_mask = target.eq(ignore_index)
        nll_loss.masked_fill_(pad_mask, 0.0)
        smooth_loss.masked_fill_(pad_mask, 0.0)
    else:
        nll_loss = nll_loss.squeeze(-1)
        smooth_loss = smooth_loss.squeeze(-1)
    if reduce:
        nll_loss = nll_loss.sum()
        smooth_loss = smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


class LabelSmoothedCrossEntropyCriterion(nn.Module):
    def __init__(self, padding_idx, label_smoothing=0.1, sentence_avg=False):
        super().__init__()
        self.padding_idx = padding_idx
        self.eps = label_smoothing
        self.sentence_avg = sentence_avg

    def get_lprobs_and_target(self, net_output, sample):
        lprobs = F.log_softmax(net_output[0].float(), dim=-1)
        target = sample["target"]
        return lprobs.view(-1, lprobs.size(-1)), target.view(-1)

    def compute_loss(self, net_output, sample, reduce=True):
        lprobs, target = self.get_lprobs_and_target(net_output, sample)
        return label_smoothed_nll_loss(lprobs, target, self.eps, ignore_index=self.padding_idx, reduce=reduce)

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        loss, nll_loss = self.compute_loss(net_output, sample, reduce=reduce)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {"loss": loss.data, "nll_loss": nll_loss.data, "ntokens": sample["ntokens"],
                          "nsentences": sample["target"].size(0), "sample_size": sample_size}
        return loss, sample_size, logging_output


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, self_attention=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.self_attention = self_attention
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, x, seq_len, bsz):
        return x.contiguous().view(seq_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        tgt_len, bsz, _ = query.size()
        src_len = key.size(0)
        q = self._shape(self.q_proj(query) * self.scaling, tgt_len, bsz)
        k = self._shape(self.k_proj(key), src_len, bsz)
        v = self._shape(self.v_proj(value), src_len, bsz)

        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), -1e8)  # expect: AMP007
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).type_as(attn_weights)
        attn_probs = F.dropout(attn_probs, p=self.dropout, training=self.training)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, self.embed_dim)
        return self.out_proj(attn)


class AlignmentHead(nn.Module):
    """Monotonic alignment scores used only for the attention plots."""

    def __init__(self, embed_dim):
        super().__init__()
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, dec_states, enc_states, enc_padding_mask):
        scores = torch.einsum("tbd,sbd->bts", self.proj(dec_states), enc_states)
        neg = -1e8 if scores.dtype == torch.float32 else -1e4
        scores = scores.masked_fill(enc_padding_mask.unsqueeze(1), neg)
        return scores.softmax(dim=-1)


def buffered_future_mask(tensor, dim):
    return torch.triu(torch.zeros([dim, dim], device=tensor.device).fill_(float("-inf")), 1)


class AMPOptimizer:
    """Wraps an fp32 optimizer and a dynamic loss scaler (the model stays fp32)."""

    def __init__(self, cfg, params):
        self.params = list(params)
        self.fp32_optimizer = torch.optim.Adam(self.params, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8,
                                               weight_decay=cfg.weight_decay)
        self._grad_scaler = torch.cuda.amp.GradScaler(init_scale=cfg.fp16_init_scale, growth_interval=cfg.fp16_scale_window)  # expect: AMP009
        self.min_loss_scale = cfg.min_loss_scale

    def backward(self, loss):
        self._grad_scaler.scale(loss).backward()

    def clip_grad_norm(self, max_norm):
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else float("inf"))  # expect: AMP005
        if not torch.isfinite(grad_norm).all():
            new_loss_scale = self.next_loss_scale
            if new_loss_scale <= self.min_loss_scale:
                raise FloatingPointError(f"Minimum loss scale reached ({self.min_loss_scale}).")
        return grad_norm

    def step(self):
        self._grad_scaler.step(self.fp32_optimizer)
        self._grad_scaler.update()

    def zero_grad(self):
        self.fp32_optimizer.zero_grad(set_to_none=True)

    @property
    def next_loss_scale(self):
        return self._grad_scaler.get_scale() * self._grad_scaler.get_backoff_factor()

    def get_lr(self):
        return self.fp32_optimizer.param_groups[0]["lr"]

    def set_lr(self, lr):
        for group in self.fp32_optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self):
        return {"optimizer": self.fp32_optimizer.state_dict(), "loss_scaler": self._grad_scaler.state_dict()}


class SpeechToTextTask:
    def __init__(self, cfg, blank_idx=0):
        self.cfg = cfg
        self.blank_idx = blank_idx

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        model.train()
        model.set_num_updates(update_num)
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            net_output = model(**sample["net_input"])
            loss, nll_loss = criterion.compute_loss(net_output, sample)
        if self.cfg.ctc_weight > 0.0:
            ctc_lprobs = net_output[1]["ctc_logits"].log_softmax(-1).transpose(0, 1)
            ctc_loss = F.ctc_loss(ctc_lprobs, sample["ctc_target"], net_output[1]["ctc_lengths"], sample["ctc_target_lengths"], blank=self.blank_idx, reduction="sum", zero_infinity=True)  # expect: AMP002
            loss = loss + self.cfg.ctc_weight * ctc_loss
        if ignore_grad:
            loss = loss * 0
        optimizer.backward(loss)
        logging_output = {"loss": loss.data, "nll_loss": nll_loss.data, "ntokens": sample["ntokens"],
                          "sample_size": sample["ntokens"]}
        return loss, sample["ntokens"], logging_output

    def valid_step(self, sample, model, criterion):
        model.eval()
        with torch.no_grad():
            loss, sample_size, logging_output = criterion(model, sample)
        return loss, sample_size, logging_output


class Trainer:
    def __init__(self, cfg, task, model, criterion):
        self.cfg = cfg
        self.task = task
        self.model = model.cuda()
        self.criterion = criterion.cuda()
        self.optimizer = AMPOptimizer(cfg, [p for p in self.model.parameters() if p.requires_grad])
        self._num_updates = 0

    def get_num_updates(self):
        return self._num_updates

    def lr_step_update(self):
        warmup, peak = self.cfg.warmup_updates, self.cfg.lr
        n = self._num_updates
        lr = peak * n / warmup if n < warmup else peak * math.sqrt(warmup / n)
        self.optimizer.set_lr(lr)
        return lr

    def train_step(self, samples):
        self.model.train()
        self.criterion.train()
        self.optimizer.zero_grad()
        logging_outputs, sample_size = [], 0
        for i, sample in enumerate(samples):
            sample = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in sample.items()}
            is_last = i == len(samples) - 1
            sync_ctx = self.model.no_sync() if hasattr(self.model, "no_sync") and not is_last else contextlib.nullcontext()
            with sync_ctx:
                loss, bsz, log = self.task.train_step(sample, self.model, self.criterion, self.optimizer,
                                                      self.get_num_updates())
            logging_outputs.append(log)
            sample_size += bsz

        try:
            grad_norm = self.optimizer.clip_grad_norm(self.cfg.clip_norm)
            self.optimizer.step()
        except FloatingPointError:
            logger.warning("gradient overflow at update %d, skipping", self._num_updates)
            self.optimizer.zero_grad()
            return None
        self._num_updates += 1
        lr = self.lr_step_update()
        return {"grad_norm": float(grad_norm), "lr": lr, "sample_size": sample_size,
                "loss": sum(float(lo["loss"]) for lo in logging_outputs) / max(sample_size, 1)}

    def valid_step(self, sample):
        sample = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in sample.items()}
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
            return self.task.valid_step(sample, self.model, self.criterion)

    def save_checkpoint(self, path):
        torch.save({"model": self.model.state_dict(), "last_optimizer_state": self.optimizer.state_dict(),
                    "num_updates": self._num_updates, "cfg": vars(self.cfg)}, path)


def default_cfg():
    return Namespace(lr=2e-3, weight_decay=0.0, fp16_init_scale=128, fp16_scale_window=256, min_loss_scale=1e-4,
                     amp=True, ctc_weight=0.3, clip_norm=10.0, warmup_updates=10000, update_freq=4)


def group_batches(itr, update_freq):
    bucket = []
    for sample in itr:
        bucket.append(sample)
        if len(bucket) == update_freq:
            yield bucket
            bucket = []
    if bucket:
        yield bucket


def train_epoch(trainer, train_itr, valid_itr, cfg, epoch, save_path):
    for i, samples in enumerate(group_batches(train_itr, cfg.update_freq)):
        stats = trainer.train_step(samples)
        if stats is None:
            continue
        if trainer.get_num_updates() % 100 == 0:
            logger.info("epoch %03d | update %06d | loss %.3f | gnorm %.2f | lr %.2e", epoch,
                        trainer.get_num_updates(), stats["loss"], stats["grad_norm"], stats["lr"])
    valid_losses = []
    for sample in valid_itr:
        loss, sample_size, _ = trainer.valid_step(sample)
        valid_losses.append(float(loss) / max(float(sample_size), 1.0))
    valid_loss = sum(valid_losses) / max(len(valid_losses), 1)
    trainer.save_checkpoint(save_path.format(epoch=epoch))
    return valid_loss
