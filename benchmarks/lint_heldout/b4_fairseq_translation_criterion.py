"""fairseq-style translation task: multihead attention, label-smoothed criterion, and a trimmed native-AMP trainer."""
import math
from argparse import Namespace

import torch
import torch.nn as nn
import torch.nn.functional as F


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


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, local_window=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.local_window = local_window
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = dropout

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False):
        tgt_len, bsz, embed_dim = query.size()
        src_len = key.size(0)
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf")
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        if self.local_window is not None:
            pos = torch.arange(src_len, device=query.device)
            far = (pos[None, :] - pos[:tgt_len, None]).abs() > self.local_window
            attn_weights = attn_weights.masked_fill(far.unsqueeze(0), -1e8)  # expect: AMP007

        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = F.dropout(attn_weights, p=self.dropout, training=self.training)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        if need_weights:
            attn_weights = attn_weights_float.view(bsz, self.num_heads, tgt_len, src_len)
            return attn, attn_weights.mean(dim=1)
        return attn, None


class LabelSmoothedCrossEntropyCriterion(nn.Module):
    def __init__(self, padding_idx, label_smoothing=0.1):
        super().__init__()
        self.padding_idx = padding_idx
        self.eps = label_smoothing

    def forward(self, net_output, target):
        lprobs = F.log_softmax(net_output[0], dim=-1, dtype=torch.float32)
        lprobs = lprobs.view(-1, lprobs.size(-1))
        return label_smoothed_nll_loss(lprobs, target.view(-1), self.eps, ignore_index=self.padding_idx)


class TranslationTask:
    def __init__(self, args: Namespace, src_dict, tgt_dict):
        self.args = args
        self.src_dict = src_dict
        self.tgt_dict = tgt_dict

    def build_criterion(self):
        return LabelSmoothedCrossEntropyCriterion(self.tgt_dict.pad(), self.args.label_smoothing)

    def train_step(self, sample, model, criterion, optimizer, scaler, update_num):
        model.train()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.args.amp):
            net_output = model(**sample["net_input"])
            loss, nll_loss = criterion(net_output, sample["target"])
        scaler.scale(loss).backward()
        return loss, nll_loss, sample["ntokens"]

    @torch.no_grad()
    def valid_step(self, sample, model, criterion):
        model.eval()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.args.amp):
            net_output = model(**sample["net_input"])
            loss, nll_loss = criterion(net_output, sample["target"])
        return loss.item(), nll_loss.item(), sample["ntokens"]


class Trainer:
    def __init__(self, args, task, model):
        self.args = args
        self.task = task
        self.model = model.cuda()
        self.criterion = task.build_criterion()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
        self.scaler = torch.amp.GradScaler("cuda", init_scale=128.0, enabled=args.amp)
        self.num_updates = 0

    def train_step(self, samples):
        self.optimizer.zero_grad()
        logging_outputs = []
        for sample in samples:
            loss, nll_loss, ntokens = self.task.train_step(
                sample, self.model, self.criterion, self.optimizer, self.scaler, self.num_updates
            )
            logging_outputs.append({"loss": loss.item(), "nll_loss": nll_loss.item(), "ntokens": ntokens})
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_norm)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.num_updates += 1
        return logging_outputs, grad_norm

    def legacy_train_step(self, sample):
        """Old code path kept for a reproduction of the 2021 baseline numbers."""
        self.model.train()
        self.optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.args.amp):
            net_output = self.model(**sample["net_input"])
        logits = net_output[0]
        loss = F.cross_entropy(  # expect: AMP002
            logits.view(-1, logits.size(-1)),
            sample["target"].view(-1),
            ignore_index=self.criterion.padding_idx,
            label_smoothing=self.args.label_smoothing,
            reduction="sum",
        )
        torch.autograd.backward(self.scaler.scale(loss))
        self.optimizer.step()  # expect: AMP006
        self.num_updates += 1
        return loss.item() / max(sample["ntokens"], 1)
