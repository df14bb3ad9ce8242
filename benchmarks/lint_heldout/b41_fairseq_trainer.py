"""Condensed fairseq-style training stack: registries, a criterion, a task and the Trainer."""
import contextlib
import copy
import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MODEL_REGISTRY = {}
CRITERION_REGISTRY = {}


def register_model(name):
    def wrapper(cls):
        MODEL_REGISTRY[name] = cls
        return cls
    return wrapper


def register_criterion(name):
    def wrapper(cls):
        CRITERION_REGISTRY[name] = cls
        return cls
    return wrapper


def log_softmax(x, dim):
    return F.log_softmax(x.float(), dim=dim)


def clip_grad_norm_(params, max_norm, aggregate_norm_fn=None):
    """fairseq.utils.clip_grad_norm_: returns the total norm, clips only when max_norm > 0."""
    params = [p for p in params if p.grad is not None]
    if len(params) == 0:
        return torch.tensor(0.0)
    total_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if aggregate_norm_fn is not None:
        total_norm = aggregate_norm_fn(total_norm)
    return total_norm


@register_model("transformer_lm")
class TransformerLanguageModel(nn.Module):
    def __init__(self, args, vocab_size):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, args.decoder_embed_dim, padding_idx=1)
        self.embed_positions = nn.Embedding(args.max_target_positions, args.decoder_embed_dim)
        layer = nn.TransformerEncoderLayer(args.decoder_embed_dim, args.decoder_attention_heads,
                                           args.decoder_ffn_embed_dim, dropout=args.dropout, batch_first=True,
                                           norm_first=True)
        self.layers = nn.TransformerEncoder(layer, args.decoder_layers)
        self.layer_norm = nn.LayerNorm(args.decoder_embed_dim)
        self.output_projection = nn.Linear(args.decoder_embed_dim, vocab_size, bias=False)

    @classmethod
    def build_model(cls, args, task):
        return cls(args, len(task.dictionary))

    def forward(self, src_tokens, src_lengths=None):
        T = src_tokens.size(1)
        pos = torch.arange(T, device=src_tokens.device)[None]
        x = self.embed_tokens(src_tokens) + self.embed_positions(pos)
        causal = torch.triu(torch.full((T, T), float("-inf"), device=x.device), 1)
        x = self.layers(x, mask=causal, src_key_padding_mask=src_tokens.eq(1))
        return self.output_projection(self.layer_norm(x)), {"attn": None}

    def get_normalized_probs(self, net_output, log_probs):
        logits = net_output[0]
        return log_softmax(logits, dim=-1) if log_probs else F.softmax(logits.float(), dim=-1)


class FairseqCriterion(nn.Module):
    def __init__(self, task):
        super().__init__()
        self.task = task
        self.padding_idx = task.dictionary.pad()


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
        nll_loss, smooth_loss = nll_loss.sum(), smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    return (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss, nll_loss


@register_criterion("label_smoothed_cross_entropy")
class LabelSmoothedCrossEntropyCriterion(FairseqCriterion):
    def __init__(self, task, label_smoothing=0.1):
        super().__init__(task)
        self.eps = label_smoothing

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True).view(-1, net_output[0].size(-1))
        loss, nll_loss = label_smoothed_nll_loss(lprobs, sample["target"].view(-1), self.eps,
                                                 ignore_index=self.padding_idx, reduce=reduce)
        sample_size = sample["ntokens"]
        logging_output = {"loss": loss.data, "nll_loss": nll_loss.data, "ntokens": sample["ntokens"],
                          "nsentences": sample["target"].size(0), "sample_size": sample_size}
        return loss, sample_size, logging_output


class LanguageModelingTask:
    def __init__(self, args, dictionary):
        self.args = args
        self.dictionary = dictionary

    def build_model(self, args):
        return MODEL_REGISTRY[args.arch].build_model(args, self)

    def build_criterion(self, args):
        return CRITERION_REGISTRY[args.criterion](self, args.label_smoothing)


class Trainer:
    def __init__(self, args, task, model, criterion, optimizer, teacher=None, adapter_optimizer=None):
        self.args = args
        self.task = task
        self.model = model
        self.criterion = criterion
        self.optimizer = optimizer
        self.adapter_optimizer = adapter_optimizer
        self.teacher = teacher
        self.use_amp = args.amp
        self.amp_dtype = torch.bfloat16 if args.bf16 else torch.float16
        self.scaler = torch.cuda.amp.GradScaler(  # expect: AMP009
            init_scale=args.fp16_init_scale, enabled=self.use_amp and self.amp_dtype == torch.float16
        )
        self._num_updates = 0

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def maybe_no_sync(self, i, n):
        if self.args.distributed_world_size > 1 and i < n - 1 and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _prepare_sample(self, sample):
        return {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else
                    {kk: vv.cuda(non_blocking=True) for kk, vv in v.items()} if isinstance(v, dict) else v)
                for k, v in sample.items()}

    def train_step(self, samples):
        self.model.train()
        self.criterion.train()
        self.zero_grad()
        logging_outputs, sample_size = [], 0
        for i, sample in enumerate(samples):
            sample = self._prepare_sample(sample)
            with self.maybe_no_sync(i, len(samples)):
                with torch.autocast(device_type="cuda", dtype=self.amp_dtype, enabled=self.use_amp):
                    loss, sample_size_i, logging_output = self.criterion(self.model, sample)
                self.scaler.scale(loss).backward()
            logging_outputs.append(logging_output)
            sample_size += sample_size_i
        grad_norm = clip_grad_norm_(self.model.parameters(), self.args.clip_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._num_updates += 1
        return self._reduce(logging_outputs, sample_size, grad_norm)

    def train_step_kd(self, sample, temperature=2.0):
        """Word-level distillation from a frozen teacher on top of the label-smoothed loss."""
        self.model.train()
        self.zero_grad()
        sample = self._prepare_sample(sample)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            loss, sample_size, logging_output = self.criterion(self.model, sample)
            s_logits = self.model(**sample["net_input"])[0]
            with torch.no_grad():
                t_logits = self.teacher(**sample["net_input"])[0]
            kd = F.kl_div(F.log_softmax(s_logits / temperature, dim=-1), F.softmax(t_logits / temperature, dim=-1),
                          reduction="sum") * temperature ** 2
            loss = (1 - self.args.kd_alpha) * loss + self.args.kd_alpha * kd
            self.scaler.scale(loss).backward()  # expect: AMP008
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return self._reduce([logging_output], sample_size, grad_norm)

    def train_step_adapter(self, sample):
        """Only the adapter parameters are updated (base model frozen)."""
        self.model.train()
        sample = self._prepare_sample(sample)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            loss, sample_size, logging_output = self.criterion(self.model, sample)
        loss = self.scaler.scale(loss)
        loss.backward()
        self.adapter_optimizer.step()  # expect: AMP006
        self.adapter_optimizer.zero_grad(set_to_none=True)
        return self._reduce([logging_output], sample_size, None)

    @torch.no_grad()
    def valid_step(self, sample):
        self.model.eval()
        self.criterion.eval()
        sample = self._prepare_sample(sample)
        _loss, sample_size, logging_output = self.criterion(self.model, sample)
        return self._reduce([logging_output], sample_size, None)

    def _reduce(self, logging_outputs, sample_size, grad_norm):
        loss_sum = sum(float(log.get("loss", 0)) for log in logging_outputs)
        nll_sum = sum(float(log.get("nll_loss", 0)) for log in logging_outputs)
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        stats = {"loss": loss_sum / max(sample_size, 1) / math.log(2),
                 "nll_loss": nll_sum / max(ntokens, 1) / math.log(2),
                 "loss_scale": self.scaler.get_scale() if self.scaler.is_enabled() else 1.0}
        if grad_norm is not None:
            stats["gnorm"] = float(grad_norm)
        return stats


def build_trainer(args, task):
    model = task.build_model(args)
    criterion = task.build_criterion(args)
    model.cuda()
    if args.memory_efficient_fp16:
        model = model.half()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr[0], betas=(0.9, 0.98), weight_decay=args.weight_decay)  # expect: AMP011
    teacher = None
    if args.kd_alpha > 0:
        teacher = copy.deepcopy(model).eval().requires_grad_(False)
    adapter_optimizer = None
    if args.adapter_lr > 0:
        adapters = [p for n, p in model.named_parameters() if "adapter" in n]
        adapter_optimizer = torch.optim.SGD(adapters, lr=args.adapter_lr, momentum=0.9)
    return Trainer(args, task, model, criterion, optimizer, teacher=teacher, adapter_optimizer=adapter_optimizer)


def train(args, task, epoch_itr, max_update=100000):
    trainer = build_trainer(args, task)
    for epoch in range(args.max_epoch):
        for i, samples in enumerate(epoch_itr(epoch)):
            if args.kd_alpha > 0:
                stats = trainer.train_step_kd(samples[0])
            elif args.adapter_lr > 0:
                stats = trainer.train_step_adapter(samples[0])
            else:
                stats = trainer.train_step(samples)
            if i % args.log_interval == 0:
                logger.info("epoch %d | %s", epoch, " | ".join(f"{k} {v:.3f}" for k, v in stats.items()))
            if trainer._num_updates >= max_update:
                return trainer
    return trainer
