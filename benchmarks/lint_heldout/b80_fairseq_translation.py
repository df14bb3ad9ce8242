#!/usr/bin/env python3
"""Small translation trainer in the fairseq layout: criterion, task and trainer.

Usage: python b80_fairseq_translation.py data-bin/iwslt14.de-en --amp --update-freq 2 --clip-norm 0.1
"""
import argparse
import contextlib
import logging
import math
import os
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from seq2seq_lite.data import Dictionary, LanguagePairDataset, iterate_batches
from seq2seq_lite.meters import AverageMeter
from seq2seq_lite.utils import move_to_device

logger = logging.getLogger("seq2seq_lite.train")

CRITERION_REGISTRY = {}


def register_criterion(name):
    def wrapper(cls):
        CRITERION_REGISTRY[name] = cls
        return cls

    return wrapper


def fill_with_neg_inf(t):
    """FP16-compatible function that fills a tensor with -inf."""
    return t.float().fill_(float("-inf")).type_as(t)


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=None, reduce=True):
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    if ignore_index is not None:
        pad_mask = target.eq(ignore_index)
        nll_loss.masked_fill_(pad_mask, 0.0)
        smooth_loss.masked_fill_(pad_mask, 0.0)
    if reduce:
        nll_loss = nll_loss.sum()
        smooth_loss = smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


@register_criterion("label_smoothed_cross_entropy")
class LabelSmoothedCrossEntropyCriterion(nn.Module):
    def __init__(self, padding_idx, label_smoothing=0.1):
        super().__init__()
        self.padding_idx = padding_idx
        self.eps = label_smoothing

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        target = sample["target"]
        loss, nll_loss = label_smoothed_nll_loss(
            lprobs.view(-1, lprobs.size(-1)), target.view(-1), self.eps,
            ignore_index=self.padding_idx, reduce=reduce,
        )
        sample_size = sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = dropout

    def forward(self, query, key_padding_mask=None, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q, k, v = self.in_proj(query).chunk(3, dim=-1)
        q = (q * self.scaling).contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, -1)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf")
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, -1)
        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_probs = F.dropout(attn_weights_float.type_as(attn_weights), p=self.dropout, training=self.training)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class AlignmentAttention(nn.Module):
    """Single-head encoder attention whose weights double as word alignments."""

    def __init__(self, embed_dim, dropout=0.0):
        super().__init__()
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.scaling = embed_dim ** -0.5
        self.dropout = dropout

    def forward(self, query, key, key_padding_mask=None):
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(key)
        attn_weights = torch.einsum("tbc,sbc->bts", q, k)
        if key_padding_mask is not None:
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1), -1e9)  # expect: AMP007
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.einsum("bts,sbc->tbc", F.dropout(attn_probs, p=self.dropout, training=self.training), v)
        return self.out_proj(attn), attn_probs


class TransformerEncoderLayer(nn.Module):
    def __init__(self, embed_dim, num_heads, ffn_dim, dropout=0.1):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, num_heads, dropout=dropout)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)
        self.dropout = dropout

    def forward(self, x, encoder_padding_mask, attn_mask: Optional[torch.Tensor] = None):
        if attn_mask is not None:
            # anything in original attn_mask = 1 becomes -1e8, anything 0 becomes 0
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4)
        residual = x
        x = self.self_attn(x, key_padding_mask=encoder_padding_mask, attn_mask=attn_mask)
        x = self.self_attn_layer_norm(residual + F.dropout(x, p=self.dropout, training=self.training))
        residual = x
        x = self.fc2(F.relu(self.fc1(x)))
        return self.final_layer_norm(residual + F.dropout(x, p=self.dropout, training=self.training))


class TransformerDecoderLayer(nn.Module):
    def __init__(self, embed_dim, num_heads, ffn_dim, dropout=0.1):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, num_heads, dropout=dropout)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.encoder_attn = AlignmentAttention(embed_dim, dropout=dropout)
        self.encoder_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)
        self.dropout = dropout

    def forward(self, x, encoder_out, encoder_padding_mask, self_attn_mask):
        residual = x
        x = self.self_attn(x, attn_mask=self_attn_mask)
        x = self.self_attn_layer_norm(residual + F.dropout(x, p=self.dropout, training=self.training))
        residual = x
        x, attn = self.encoder_attn(x, encoder_out, key_padding_mask=encoder_padding_mask)
        x = self.encoder_attn_layer_norm(residual + F.dropout(x, p=self.dropout, training=self.training))
        residual = x
        x = self.fc2(F.relu(self.fc1(x)))
        return self.final_layer_norm(residual + F.dropout(x, p=self.dropout, training=self.training)), attn


class TransformerModel(nn.Module):
    def __init__(self, src_dict, tgt_dict, embed_dim=512, layers=6, heads=8, ffn_dim=2048, dropout=0.1):
        super().__init__()
        self.embed_scale = math.sqrt(embed_dim)
        self.src_embed = nn.Embedding(len(src_dict), embed_dim, padding_idx=src_dict.pad())
        self.tgt_embed = nn.Embedding(len(tgt_dict), embed_dim, padding_idx=tgt_dict.pad())
        self.encoder_layers = nn.ModuleList([TransformerEncoderLayer(embed_dim, heads, ffn_dim, dropout) for _ in range(layers)])
        self.decoder_layers = nn.ModuleList([TransformerDecoderLayer(embed_dim, heads, ffn_dim, dropout) for _ in range(layers)])
        self.output_projection = nn.Linear(embed_dim, len(tgt_dict), bias=False)
        self._future_mask = torch.empty(0)

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        if self._future_mask.size(0) < dim or self._future_mask.device != tensor.device:
            self._future_mask = torch.triu(fill_with_neg_inf(torch.zeros([dim, dim])), 1).to(tensor.device)
        return self._future_mask[:dim, :dim].to(tensor)

    def forward(self, src_tokens, src_lengths, prev_output_tokens):
        encoder_padding_mask = src_tokens.eq(self.src_embed.padding_idx)
        x = (self.embed_scale * self.src_embed(src_tokens)).transpose(0, 1)
        for layer in self.encoder_layers:
            x = layer(x, encoder_padding_mask)
        encoder_out = x
        y = (self.embed_scale * self.tgt_embed(prev_output_tokens)).transpose(0, 1)
        self_attn_mask = self.buffered_future_mask(y)
        attn = None
        for layer in self.decoder_layers:
            y, attn = layer(y, encoder_out, encoder_padding_mask, self_attn_mask)
        return self.output_projection(y.transpose(0, 1)), {"attn": [attn]}

    def get_normalized_probs(self, net_output, log_probs):
        logits = net_output[0].float()
        if log_probs:
            return F.log_softmax(logits, dim=-1)
        return F.softmax(logits, dim=-1)


class TranslationTask:
    def __init__(self, args, src_dict, tgt_dict):
        self.args = args
        self.src_dict = src_dict
        self.tgt_dict = tgt_dict

    @classmethod
    def setup_task(cls, args):
        src_dict = Dictionary.load(os.path.join(args.data, f"dict.{args.source_lang}.txt"))
        tgt_dict = Dictionary.load(os.path.join(args.data, f"dict.{args.target_lang}.txt"))
        return cls(args, src_dict, tgt_dict)

    def build_model(self, args):
        return TransformerModel(self.src_dict, self.tgt_dict, embed_dim=args.encoder_embed_dim, dropout=args.dropout)

    def build_criterion(self, args):
        return CRITERION_REGISTRY[args.criterion](self.tgt_dict.pad(), label_smoothing=args.label_smoothing)

    def train_step(self, sample, model, criterion, update_num, amp_enabled=False):
        model.train()
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=amp_enabled):
            loss, sample_size, logging_output = criterion(model, sample)
        return loss, sample_size, logging_output

    def valid_step(self, sample, model, criterion):
        model.eval()
        with torch.no_grad():
            loss, sample_size, logging_output = criterion(model, sample)
        return loss, sample_size, logging_output


class Trainer:
    def __init__(self, args, task, model, criterion):
        self.args = args
        self.task = task
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device)
        self.criterion = criterion.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=args.weight_decay
        )
        self.scaler = torch.amp.GradScaler(
            "cuda", init_scale=args.amp_init_scale, growth_interval=args.amp_scale_window, enabled=args.amp
        )
        self.num_updates = 0

    def _maybe_no_sync(self, i, n):
        if hasattr(self.model, "no_sync") and i < n - 1:
            return self.model.no_sync()
        return contextlib.ExitStack()

    def multiply_grads(self, c):
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(c)

    def clip_grad_norm(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else float("inf"))

    def train_step(self, samples: List[Dict]):
        self.model.train()
        self.criterion.train()
        self.optimizer.zero_grad(set_to_none=True)
        logging_outputs, sample_size = [], 0
        for i, sample in enumerate(samples):
            sample = move_to_device(sample, self.device)
            with self._maybe_no_sync(i, len(samples)):
                loss, sample_size_i, logging_output = self.task.train_step(
                    sample, self.model, self.criterion, self.num_updates, amp_enabled=self.args.amp
                )
                self.scaler.scale(loss).backward()
            logging_outputs.append(logging_output)
            sample_size += sample_size_i

        # gradients are summed over tokens; normalise by the number of target tokens
        self.multiply_grads(1.0 / float(max(sample_size, 1)))
        grad_norm = self.clip_grad_norm(self.args.clip_norm)  # expect: AMP005
        if not torch.isfinite(grad_norm):
            logger.info("non-finite grad norm (%s), this update will be skipped", grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.num_updates += 1
        logging_outputs[-1]["gnorm"] = grad_norm.item()
        logging_outputs[-1]["loss_scale"] = self.scaler.get_scale()
        return logging_outputs

    def valid_step(self, sample):
        sample = move_to_device(sample, self.device)
        _loss, _sample_size, logging_output = self.task.valid_step(sample, self.model, self.criterion)
        return logging_output

    def save_checkpoint(self, filename, extra_state):
        state = {
            "args": vars(self.args),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "num_updates": self.num_updates,
            "extra_state": extra_state,
        }
        if self.args.save_fp16_weights:
            state["model"] = {k: v.half() if v.is_floating_point() else v for k, v in state["model"].items()}
        torch.save(state, filename)


def load_models_for_inference(filenames, args, task):
    models = []
    for filename in filenames:
        state = torch.load(filename, map_location="cpu")
        model = task.build_model(args)
        model.load_state_dict({k: v.float() for k, v in state["model"].items()})
        model.eval()
        if args.fp16:
            model.half()
        if torch.cuda.is_available():
            model.cuda()
        models.append(model)
    return models


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--source-lang", default="de")
    parser.add_argument("--target-lang", default="en")
    parser.add_argument("--criterion", default="label_smoothed_cross_entropy")
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--encoder-embed-dim", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--clip-norm", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--update-freq", type=int, default=1)
    parser.add_argument("--max-epoch", type=int, default=50)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--amp-init-scale", type=float, default=2.0 ** 7)
    parser.add_argument("--amp-scale-window", type=int, default=2000)
    parser.add_argument("--fp16", action="store_true", help="fp16 inference")
    parser.add_argument("--save-fp16-weights", action="store_true")
    parser.add_argument("--save-dir", default="checkpoints")
    parser.add_argument("--log-interval", type=int, default=100)
    return parser


def main():
    args = get_parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    os.makedirs(args.save_dir, exist_ok=True)
    task = TranslationTask.setup_task(args)
    model = task.build_model(args)
    criterion = task.build_criterion(args)
    trainer = Trainer(args, task, model, criterion)

    train_data = LanguagePairDataset.load(args.data, "train", args.source_lang, args.target_lang)
    valid_data = LanguagePairDataset.load(args.data, "valid", args.source_lang, args.target_lang)
    best_loss = 1e9
    for epoch in range(1, args.max_epoch + 1):
        loss_meter = AverageMeter()
        batches = list(iterate_batches(train_data, max_tokens=args.max_tokens, shuffle=True, seed=epoch))
        for step in range(0, len(batches), args.update_freq):
            logs = trainer.train_step(batches[step:step + args.update_freq])
            ntok = sum(log["ntokens"] for log in logs)
            loss_meter.update(sum(float(log["loss"]) for log in logs) / ntok / math.log(2), ntok)
            if trainer.num_updates % args.log_interval == 0:
                logger.info("epoch %03d | update %06d | loss %.3f | gnorm %.3f | scale %.1f",
                            epoch, trainer.num_updates, loss_meter.avg, logs[-1]["gnorm"], logs[-1]["loss_scale"])

        valid_logs = [trainer.valid_step(s) for s in iterate_batches(valid_data, max_tokens=args.max_tokens)]
        valid_loss = sum(float(log["loss"]) for log in valid_logs) / max(sum(log["ntokens"] for log in valid_logs), 1) / math.log(2)
        logger.info("epoch %03d | valid loss %.3f", epoch, valid_loss)
        trainer.save_checkpoint(os.path.join(args.save_dir, "checkpoint_last.pt"), {"epoch": epoch, "best": best_loss})
        if valid_loss < best_loss:
            best_loss = valid_loss
            trainer.save_checkpoint(os.path.join(args.save_dir, "checkpoint_best.pt"), {"epoch": epoch, "best": best_loss})
    logger.info("done training, best valid loss %.3f", best_loss)


if __name__ == "__main__":
    main()
