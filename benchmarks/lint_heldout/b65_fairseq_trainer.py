# Copyright (c) Facebook, Inc. and its affiliates.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""
Train a network across multiple GPUs: a label-smoothed cross-entropy criterion,
the trainer that drives it with torch.amp, and a word-level knowledge
distillation trainer (Kim & Rush, 2016) for compressing transformer_big teachers.
"""

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils, metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass
from fairseq.distributed import utils as distributed_utils

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


@dataclass
class LabelSmoothedCrossEntropyCriterionConfig(FairseqDataclass):
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "epsilon for label smoothing, 0 means no label smoothing"},
    )
    report_accuracy: bool = field(default=False, metadata={"help": "report accuracy metric"})
    ignore_prefix_size: int = field(default=0, metadata={"help": "Ignore first N tokens"})
    sentence_avg: bool = field(default=False, metadata={"help": "normalize by sentences"})


@register_criterion("ls_cross_entropy_amp", dataclass=LabelSmoothedCrossEntropyCriterionConfig)
class LabelSmoothedCrossEntropyCriterion(FairseqCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False):
        super().__init__(task)
        self.sentence_avg = sentence_avg
        self.eps = label_smoothing
        self.ignore_prefix_size = ignore_prefix_size
        self.report_accuracy = report_accuracy

    def forward(self, model, sample, reduce=True):
        """Compute the loss for the given sample.

        Returns a tuple with three elements:
        1) the loss
        2) the sample size, which is used as the denominator for the gradient
        3) logging outputs to display while training
        """
        net_output = model(**sample["net_input"])
        loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=reduce)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"] = utils.item(n_correct.data)
            logging_output["total"] = utils.item(total.data)
        return loss, sample_size, logging_output

    def get_lprobs_and_target(self, model, net_output, sample):
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        target = model.get_targets(sample, net_output)
        if self.ignore_prefix_size > 0:
            lprobs = lprobs[:, self.ignore_prefix_size :, :].contiguous()
            target = target[:, self.ignore_prefix_size :].contiguous()
        return lprobs.view(-1, lprobs.size(-1)), target.view(-1)

    def compute_loss(self, model, net_output, sample, reduce=True):
        lprobs, target = self.get_lprobs_and_target(model, net_output, sample)
        return label_smoothed_nll_loss(lprobs, target, self.eps, ignore_index=self.padding_idx, reduce=reduce)

    def compute_accuracy(self, model, net_output, sample):
        lprobs, target = self.get_lprobs_and_target(model, net_output, sample)
        mask = target.ne(self.padding_idx)
        n_correct = torch.sum(lprobs.argmax(1).masked_select(mask).eq(target.masked_select(mask)))
        total = torch.sum(mask)
        return n_correct, total

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        loss_sum = sum(log.get("loss", 0) for log in logging_outputs)
        nll_loss_sum = sum(log.get("nll_loss", 0) for log in logging_outputs)
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        metrics.log_scalar("loss", loss_sum / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", nll_loss_sum / ntokens / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))


class Trainer(object):
    """Main class for data parallel training with native mixed precision."""

    def __init__(self, cfg, task, model, criterion):
        self.cfg = cfg
        self.task = task
        self.device = torch.device("cuda")
        self._model = model.to(device=self.device)
        self._criterion = criterion.to(device=self.device)
        self.use_amp = cfg.common.amp
        self.amp_dtype = torch.bfloat16 if cfg.common.bf16 else torch.float16
        self.scaler = torch.amp.GradScaler(
            "cuda",
            init_scale=cfg.common.fp16_init_scale,
            growth_interval=cfg.common.fp16_scale_window,
            enabled=self.use_amp and self.amp_dtype == torch.float16,
        )
        params = [p for p in chain(self.model.parameters(), self.criterion.parameters()) if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=cfg.optimization.lr[0],
            betas=(0.9, 0.98),
            eps=1e-8,
            weight_decay=cfg.optimization.weight_decay,
        )
        self.padding_idx = task.target_dictionary.pad()
        self._num_updates = 0
        self._best_valid_loss = math.inf
        self._start_time = time.time()

    @property
    def model(self):
        return self._model

    @property
    def criterion(self):
        return self._criterion

    @property
    def data_parallel_world_size(self):
        return distributed_utils.get_data_parallel_world_size()

    def get_num_updates(self):
        return self._num_updates

    def set_num_updates(self, num_updates):
        self._num_updates = num_updates
        metrics.log_scalar("num_updates", self._num_updates, weight=0, priority=200)

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def _prepare_sample(self, sample):
        if sample is None or len(sample) == 0:
            return None, True
        sample = utils.move_to_cuda(sample)
        return sample, False

    def _multiply_grads(self, c):
        for p in chain(self.model.parameters(), self.criterion.parameters()):
            if p.grad is not None:
                p.grad.mul_(c)

    def clip_grad_norm(self, clip_norm):
        params = [p for p in chain(self.model.parameters(), self.criterion.parameters()) if p.grad is not None]
        # clip_norm == 0 only measures the norm
        return torch.nn.utils.clip_grad_norm_(params, clip_norm if clip_norm > 0 else float("inf"))

    @metrics.aggregate("train")
    def train_step(self, samples, raise_oom=False):
        """Do forward, backward and parameter update."""
        self.model.train()
        self.criterion.train()
        self.zero_grad()
        metrics.log_start_time("train_wall", priority=800, round=0)

        logging_outputs, sample_size, ooms = [], 0, 0
        for i, sample in enumerate(samples):
            sample, is_dummy_batch = self._prepare_sample(sample)

            def maybe_no_sync():
                if self.data_parallel_world_size > 1 and hasattr(self.model, "no_sync") and i < len(samples) - 1:
                    return self.model.no_sync()
                return contextlib.ExitStack()

            try:
                with maybe_no_sync():
                    with torch.autocast("cuda", dtype=self.amp_dtype, enabled=self.use_amp):
                        loss, sample_size_i, logging_output = self.criterion(self.model, sample)
                    if is_dummy_batch:
                        loss = loss * 0.0
                    self.scaler.scale(loss).backward()
                logging_outputs.append(logging_output)
                sample_size += sample_size_i
            except RuntimeError as e:
                if "out of memory" not in str(e):
                    raise
                logger.warning("attempting to recover from OOM in forward/backward pass")
                ooms += 1
                self.zero_grad()
                if raise_oom:
                    raise

        if ooms == len(samples):
            logger.warning("OOM in all workers, skipping update")
            self.zero_grad()
            return None

        # gradients are summed over the batch; normalise by the number of tokens
        self.scaler.unscale_(self.optimizer)
        self._multiply_grads(self.data_parallel_world_size / max(sample_size, 1))
        grad_norm = self.clip_grad_norm(self.cfg.optimization.clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.set_num_updates(self.get_num_updates() + 1)

        metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
        metrics.log_scalar("loss_scale", self.scaler.get_scale(), priority=700, round=4, weight=0)
        self.task.reduce_metrics(logging_outputs, self.criterion)
        return logging_outputs

    @metrics.aggregate("valid")
    def valid_step(self, sample):
        with torch.no_grad():
            self.model.eval()
            self.criterion.eval()
            sample, _ = self._prepare_sample(sample)
            with torch.autocast("cuda", dtype=self.amp_dtype, enabled=self.use_amp):
                _loss, sample_size, logging_output = self.criterion(self.model, sample)
        self.task.reduce_metrics([logging_output], self.criterion)
        return logging_output

    def save_checkpoint(self, filename, extra_state):
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "num_updates": self.get_num_updates(),
            "best_valid_loss": self._best_valid_loss,
            "extra_state": extra_state,
        }
        checkpoint_utils.torch_persistent_save(state, filename)
        logger.info(f"Finished saving checkpoint to {filename}")

    def load_checkpoint(self, filename, reset_optimizer=False):
        state = checkpoint_utils.load_checkpoint_to_cpu(filename)
        self.model.load_state_dict(state["model"], strict=True)
        if not reset_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
            if "scaler" in state:
                self.scaler.load_state_dict(state["scaler"])
        self.set_num_updates(state.get("num_updates", 0))
        self._best_valid_loss = state.get("best_valid_loss", math.inf)
        return state.get("extra_state")


class DistillationTrainer(Trainer):
    """Word-level distillation from a frozen teacher on the same batches."""

    def __init__(self, cfg, task, model, criterion, teacher):
        super().__init__(cfg, task, model, criterion)
        self.teacher = teacher.to(device=self.device).eval()
        self.teacher.requires_grad_(False)
        self.kd_alpha = cfg.distillation.alpha
        self.kd_temperature = cfg.distillation.temperature

    @metrics.aggregate("train")
    def train_step(self, samples, raise_oom=False):
        self.model.train()
        self.zero_grad()
        T = self.kd_temperature
        logging_outputs, sample_size = [], 0
        for sample in samples:
            sample, is_dummy_batch = self._prepare_sample(sample)
            if is_dummy_batch:
                continue
            target = sample["target"].view(-1)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                teacher_logits = self.teacher(**sample["net_input"])[0]
            with torch.autocast("cuda", dtype=torch.float16):
                student_logits = self.model(**sample["net_input"])[0]

            teacher_lprobs = F.log_softmax(teacher_logits.float() / T, dim=-1).view(-1, teacher_logits.size(-1))
            student_lprobs = F.log_softmax(student_logits / T, dim=-1).view(-1, student_logits.size(-1))
            kd_loss = F.kl_div(student_lprobs, teacher_lprobs, reduction="sum", log_target=True)  # expect: AMP002
            nll_loss = F.cross_entropy(input=student_logits.view(-1, student_logits.size(-1)), target=target, ignore_index=self.padding_idx, reduction="sum")  # expect: AMP002
            loss = self.kd_alpha * (T * T) * kd_loss + (1.0 - self.kd_alpha) * nll_loss

            logging_outputs.append(
                {
                    "loss": utils.item(loss.detach()),
                    "kd_loss": utils.item(kd_loss.detach()),
                    "nll_loss": utils.item(nll_loss.detach()),
                    "ntokens": sample["ntokens"],
                    "sample_size": sample["ntokens"],
                }
            )
            sample_size += sample["ntokens"]
            loss = self.scaler.scale(loss)
            loss.backward()

        self._multiply_grads(1.0 / max(sample_size, 1))
        grad_norm = self.clip_grad_norm(self.cfg.optimization.clip_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.set_num_updates(self.get_num_updates() + 1)
        metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
        return logging_outputs
