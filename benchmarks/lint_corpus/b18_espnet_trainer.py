"""Trainer module (ESPnet2 style), with the attention layers shared by the
toy recipes of this repository."""
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import torch
import torch.nn
from packaging.version import parse as V
from typeguard import typechecked

from espnet2.iterators.abs_iter_factory import AbsIterFactory
from espnet2.schedulers.abs_scheduler import AbsBatchStepScheduler, AbsScheduler
from espnet2.torch_utils.add_gradient_noise import add_gradient_noise
from espnet2.torch_utils.device_funcs import to_device
from espnet2.torch_utils.recursive_op import recursive_average
from espnet2.train.abs_espnet_model import AbsESPnetModel
from espnet2.train.distributed_utils import DistributedOption
from espnet2.train.reporter import Reporter, SubReporter


class MultiHeadedAttention(torch.nn.Module):
    """Multi-Head Attention layer.

    Args:
        n_head (int): The number of heads.
        n_feat (int): The number of features.
        dropout_rate (float): Dropout rate.
    """

    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = torch.nn.Linear(n_feat, n_feat)
        self.linear_k = torch.nn.Linear(n_feat, n_feat)
        self.linear_v = torch.nn.Linear(n_feat, n_feat)
        self.linear_out = torch.nn.Linear(n_feat, n_feat)
        self.attn = None
        self.dropout = torch.nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            self.attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(self.attn)
        x = torch.matmul(p_attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class LocalMultiHeadedAttention(MultiHeadedAttention):
    """Attention restricted to a window of ``left`` past and ``right`` future frames."""

    def __init__(self, n_head, n_feat, dropout_rate, left=32, right=8):
        super().__init__(n_head, n_feat, dropout_rate)
        self.left = left
        self.right = right

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        t1, t2 = scores.size(-2), scores.size(-1)
        pos = torch.arange(t2, device=scores.device)[None, :] - torch.arange(t1, device=scores.device)[:, None]
        outside = (pos < -self.left) | (pos > self.right)
        scores = scores.masked_fill(outside, -1e10)  # expect: AMP007
        return self.forward_attention(v, scores, mask)


@dataclasses.dataclass
class TrainerOptions:
    ngpu: int
    resume: bool
    use_amp: bool
    train_dtype: str
    grad_noise: bool
    accum_grad: int
    grad_clip: float
    grad_clip_type: float
    log_interval: Optional[int]
    no_forward_run: bool
    max_epoch: int
    output_dir: Path


class Trainer:
    """Trainer having an optimizer.

    ``Trainer`` is a stateless class; all state lives in the objects passed
    to ``run``. Mixed precision: ``--use_amp true`` enables autocast and loss
    scaling.
    """

    def __init__(self):
        raise RuntimeError("This class can't be instantiated.")

    @classmethod
    def run(
        cls,
        model: AbsESPnetModel,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Optional[AbsScheduler]],
        train_iter_factory: AbsIterFactory,
        valid_iter_factory: AbsIterFactory,
        reporter: Reporter,
        trainer_options: TrainerOptions,
        distributed_option: DistributedOption,
    ) -> None:
        """Perform training. This method performs the main process of training."""
        output_dir = Path(trainer_options.output_dir)
        model = model.to(dtype=getattr(torch, trainer_options.train_dtype), device="cuda" if trainer_options.ngpu > 0 else "cpu")

        if trainer_options.use_amp:
            if V(torch.__version__) < V("1.6.0"):
                raise RuntimeError("Require torch>=1.6.0 for  Automatic Mixed Precision")
            scaler = torch.cuda.amp.GradScaler()  # expect: AMP009 AMP010
        else:
            scaler = None

        start_epoch = reporter.get_epoch() + 1
        for iepoch in range(start_epoch, trainer_options.max_epoch + 1):
            reporter.set_epoch(iepoch)
            with reporter.observe("train") as sub_reporter:
                all_steps_are_invalid = cls.train_one_epoch(
                    model=model,
                    optimizers=optimizers,
                    schedulers=schedulers,
                    iterator=train_iter_factory.build_iter(iepoch),
                    reporter=sub_reporter,
                    scaler=scaler,
                    options=trainer_options,
                    distributed_option=distributed_option,
                )
            with reporter.observe("valid") as sub_reporter:
                cls.validate_one_epoch(model=model, iterator=valid_iter_factory.build_iter(iepoch), reporter=sub_reporter, options=trainer_options, distributed_option=distributed_option)

            for scheduler in schedulers:
                if scheduler is not None and not isinstance(scheduler, AbsBatchStepScheduler):
                    scheduler.step()

            if all_steps_are_invalid:
                logging.warning(f"The gradients at all steps are invalid in this epoch. Something seems wrong. This training was stopped at {iepoch}epoch")
                break
            torch.save(
                {
                    "model": model.state_dict(),
                    "reporter": reporter.state_dict(),
                    "optimizers": [o.state_dict() for o in optimizers],
                    "scaler": scaler.state_dict() if scaler is not None else None,
                },
                output_dir / "checkpoint.pth",
            )

    @classmethod
    @typechecked
    def train_one_epoch(
        cls,
        model: torch.nn.Module,
        iterator: Iterable[Dict[str, torch.Tensor]],
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Optional[AbsScheduler]],
        scaler: Optional["torch.amp.GradScaler"],
        reporter: SubReporter,
        options: TrainerOptions,
        distributed_option: DistributedOption,
    ) -> bool:
        grad_noise = options.grad_noise
        accum_grad = options.accum_grad
        grad_clip = options.grad_clip
        grad_clip_type = options.grad_clip_type
        log_interval = options.log_interval or 100
        ngpu = options.ngpu
        distributed = distributed_option.distributed

        model.train()
        all_steps_are_invalid = True
        start_time = time.perf_counter()
        for iiter, (utt_id, batch) in enumerate(reporter.measure_iter_time(iterator, "iter_time"), 1):
            assert isinstance(batch, dict), type(batch)
            batch = to_device(batch, "cuda" if ngpu > 0 else "cpu")
            if options.no_forward_run:
                all_steps_are_invalid = False
                continue

            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=scaler is not None):
                with reporter.measure_time("forward_time"):
                    retval = model(**batch)
                    if isinstance(retval, dict):
                        loss, stats, weight = retval["loss"], retval["stats"], retval["weight"]
                    else:
                        loss, stats, weight = retval
                stats = {k: v for k, v in stats.items() if v is not None}
                if ngpu > 1 or distributed:
                    # Apply weight for the data-parallel gradient average
                    loss *= torch.distributed.get_world_size()
                loss /= accum_grad

            reporter.register(stats, weight)

            with reporter.measure_time("backward_time"):
                if scaler is not None:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()

            if iiter % accum_grad == 0:
                if grad_noise:
                    add_gradient_noise(model, reporter.get_total_count(), duration=100, eta=1.0, scale_factor=0.55)

                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip, norm_type=grad_clip_type)  # expect: AMP005
                if not isinstance(grad_norm, torch.Tensor):
                    grad_norm = torch.tensor(grad_norm)

                if not torch.isfinite(grad_norm):
                    logging.warning(f"The grad norm is {grad_norm}. Skipping updating the model.")
                    if scaler is not None:
                        for optimizer in optimizers:
                            scaler.step(optimizer)
                        scaler.update()
                else:
                    all_steps_are_invalid = False
                    with reporter.measure_time("optim_step_time"):
                        for optimizer, scheduler in zip(optimizers, schedulers):
                            if scaler is not None:
                                scaler.step(optimizer)
                                scaler.update()
                            optimizer.step()  # expect: AMP006
                            if isinstance(scheduler, AbsBatchStepScheduler):
                                scheduler.step()
                for optimizer in optimizers:
                    optimizer.zero_grad()

                reporter.register(
                    dict(
                        {f"optim{i}_lr{j}": pg["lr"] for i, optimizer in enumerate(optimizers) for j, pg in enumerate(optimizer.param_groups)},
                        train_time=time.perf_counter() - start_time,
                        grad_norm=grad_norm,
                    ),
                )
                start_time = time.perf_counter()

            reporter.next()
            if iiter % log_interval == 0:
                logging.info(reporter.log_message(-log_interval))
        return all_steps_are_invalid

    @classmethod
    @torch.no_grad()
    def validate_one_epoch(cls, model: torch.nn.Module, iterator: Iterable[Dict[str, torch.Tensor]], reporter: SubReporter, options: TrainerOptions, distributed_option: DistributedOption) -> None:
        ngpu = options.ngpu
        model.eval()
        for utt_id, batch in iterator:
            assert isinstance(batch, dict), type(batch)
            batch = to_device(batch, "cuda" if ngpu > 0 else "cpu")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=options.use_amp):
                retval = model(**batch)
            if isinstance(retval, dict):
                stats, weight = retval["stats"], retval["weight"]
            else:
                _, stats, weight = retval
            if ngpu > 1 or distributed_option.distributed:
                stats, weight = recursive_average(stats, weight, distributed_option.distributed)
            reporter.register(stats, weight)
            reporter.next()
