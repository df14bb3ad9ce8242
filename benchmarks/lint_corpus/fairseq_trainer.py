"""A trainer with its own fp16 optimizer and dynamic loss scaler (fairseq style)."""
import logging
import math

import torch

logger = logging.getLogger(__name__)


class DynamicLossScaler:
    def __init__(self, init_scale=2.0 ** 15, scale_factor=2.0, scale_window=2000, min_loss_scale=1e-4):
        self.loss_scale = init_scale
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_loss_scale = min_loss_scale
        self._iter = 0
        self._last_overflow_iter = -1

    def scale(self, outputs):
        return self.loss_scale * outputs

    def update(self):
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
        self._iter += 1

    def check_overflow(self, grad_norm):
        if grad_norm == float("inf") or grad_norm != grad_norm:
            self.loss_scale /= self.scale_factor
            self._last_overflow_iter = self._iter
            if self.loss_scale <= self.min_loss_scale:
                raise FloatingPointError("Minimum loss scale reached.")
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))


class FP16Optimizer:
    """Keeps fp32 master copies of fp16 parameters and steps those."""

    def __init__(self, params, fp32_optimizer, scaler):
        self.fp16_params = params
        self.fp32_params = [p.detach().clone().float().requires_grad_() for p in params]
        self.fp32_optimizer = fp32_optimizer
        self.scaler = scaler
        self._needs_sync = False

    def backward(self, loss):
        loss = self.scaler.scale(loss)
        loss.backward()
        self._needs_sync = True

    def _sync_fp16_grads_to_fp32(self):
        if self._needs_sync:
            for p, p32 in zip(self.fp16_params, self.fp32_params):
                if p.grad is not None:
                    p32.grad = p.grad.detach().float() / self.scaler.loss_scale
            self._needs_sync = False

    def clip_grad_norm(self, max_norm):
        self._sync_fp16_grads_to_fp32()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.fp32_params, max_norm)
        self.scaler.check_overflow(grad_norm)
        return grad_norm

    def step(self):
        self._sync_fp16_grads_to_fp32()
        self.fp32_optimizer.step()
        for p, p32 in zip(self.fp16_params, self.fp32_params):
            p.data.copy_(p32.data)
        self.scaler.update()

    def zero_grad(self):
        for p in self.fp16_params:
            p.grad = None
        for p32 in self.fp32_params:
            p32.grad = None


class Trainer:
    def __init__(self, cfg, task, model, criterion):
        self.cfg = cfg
        self.task = task
        self._criterion = criterion
        self._model = model
        if cfg.fp16 and not cfg.memory_efficient_fp16:
            self._criterion = self._criterion.half()
            self._model = self._model.half()
        elif cfg.bf16:
            self._criterion = self._criterion.to(dtype=torch.bfloat16)
            self._model = self._model.to(dtype=torch.bfloat16)
        self._model = self._model.to(device=cfg.device)
        self._optimizer = None
        self._num_updates = 0

    @property
    def optimizer(self):
        if self._optimizer is None:
            params = [p for p in self._model.parameters() if p.requires_grad]
            fp32_opt = torch.optim.Adam(params, lr=self.cfg.lr, eps=1e-8)
            if self.cfg.fp16:
                scaler = DynamicLossScaler(init_scale=self.cfg.fp16_init_scale)
                self._optimizer = FP16Optimizer(params, fp32_opt, scaler)
            else:
                self._optimizer = fp32_opt
        return self._optimizer

    def train_step(self, samples):
        self._model.train()
        self._criterion.train()
        self.optimizer.zero_grad()
        logging_outputs, sample_size = [], 0
        for sample in samples:
            loss, size, logging_output = self._criterion(self._model, sample)
            self.optimizer.backward(loss)
            logging_outputs.append(logging_output)
            sample_size += size
        try:
            grad_norm = self.optimizer.clip_grad_norm(self.cfg.clip_norm)
            if not math.isfinite(grad_norm):
                raise FloatingPointError("gradients are Nan/Inf")
            self.optimizer.step()
            self._num_updates += 1
        except OverflowError as e:
            logger.info(f"NOTE: gradient overflow detected, ignoring gradient, {str(e)}")
            self.optimizer.zero_grad()
        return logging_outputs

    @torch.no_grad()
    def valid_step(self, sample):
        self._model.eval()
        self._criterion.eval()
        loss, sample_size, logging_output = self._criterion(self._model, sample)
        return logging_output
