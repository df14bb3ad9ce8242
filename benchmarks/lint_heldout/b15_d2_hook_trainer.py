"""Hook-based training engine (detectron2-style) for the detection project.

SimpleTrainer / AMPTrainer follow detectron2's engine; BF16Trainer is used on
A100/H100 nodes and MeanTeacherTrainer for the semi-supervised runs.
"""
import copy
import logging
import time
import weakref

import torch
import torch.nn.functional as F
from torch.amp import GradScaler, autocast

logger = logging.getLogger(__name__)


class HookBase:
    trainer = None

    def before_train(self):
        pass

    def after_train(self):
        pass

    def before_step(self):
        pass

    def after_step(self):
        pass


class TrainerBase:
    def __init__(self):
        self._hooks = []
        self.iter = 0
        self.start_iter = 0
        self.max_iter = 0
        self.metrics = {}

    def register_hooks(self, hooks):
        for h in hooks:
            if h is None:
                continue
            h.trainer = weakref.proxy(self)
            self._hooks.append(h)

    def train(self, start_iter, max_iter):
        logger.info("Starting training from iteration %d", start_iter)
        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter
        for h in self._hooks:
            h.before_train()
        try:
            for self.iter in range(start_iter, max_iter):
                for h in self._hooks:
                    h.before_step()
                self.run_step()
                for h in self._hooks:
                    h.after_step()
            self.iter += 1
        finally:
            for h in self._hooks:
                h.after_train()

    def run_step(self):
        raise NotImplementedError


class SimpleTrainer(TrainerBase):
    def __init__(self, model, data_loader, optimizer, max_grad_norm=0.0):
        super().__init__()
        model.train()
        self.model = model
        self.data_loader = data_loader
        self._data_loader_iter = iter(data_loader)
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm

    def clip_gradients(self):
        if self.max_grad_norm <= 0:
            return None
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)

    def run_step(self):
        assert self.model.training, "[SimpleTrainer] model was changed to eval mode!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        loss_dict = self.model(data)
        losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        losses.backward()
        self.clip_gradients()
        self.optimizer.step()
        self._write_metrics(loss_dict, data_time)

    def _write_metrics(self, loss_dict, data_time, prefix=""):
        metrics = {prefix + k: v.detach().item() for k, v in loss_dict.items()}
        metrics[prefix + "data_time"] = data_time
        metrics[prefix + "total_loss"] = sum(v for k, v in metrics.items() if "loss" in k)
        self.metrics = metrics


class AMPTrainer(SimpleTrainer):
    def __init__(self, model, data_loader, optimizer, grad_scaler=None, precision=torch.float16, max_grad_norm=0.0):
        super().__init__(model, data_loader, optimizer, max_grad_norm=max_grad_norm)
        if grad_scaler is None:
            grad_scaler = GradScaler("cuda")
        self.grad_scaler = grad_scaler
        self.precision = precision

    def run_step(self):
        assert self.model.training, "[AMPTrainer] model was changed to eval mode!"
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        with autocast("cuda", dtype=self.precision):
            loss_dict = self.model(data)
            if isinstance(loss_dict, torch.Tensor):
                losses = loss_dict
                loss_dict = {"total_loss": loss_dict}
            else:
                losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        grad_norm = self.clip_gradients()  # expect: AMP005
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self._write_metrics(loss_dict, data_time)
        if grad_norm is not None:
            self.metrics["grad_norm"] = float(grad_norm)


class BF16Trainer(SimpleTrainer):
    def __init__(self, model, data_loader, optimizer, max_grad_norm=0.0):
        super().__init__(model, data_loader, optimizer, max_grad_norm=max_grad_norm)
        self.grad_scaler = GradScaler("cuda", init_scale=2.0 ** 10)  # expect: AMP010

    def run_step(self):
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        with autocast("cuda", dtype=torch.bfloat16):
            loss_dict = self.model(data)
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        self.grad_scaler.unscale_(self.optimizer)
        self.clip_gradients()
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self._write_metrics(loss_dict, data_time)


class MeanTeacherTrainer(SimpleTrainer):
    def __init__(self, model, data_loader, optimizer, grad_scaler=None, ema_momentum=0.9996,
                 unsup_weight=2.0, score_thresh=0.7, max_grad_norm=0.0):
        super().__init__(model, data_loader, optimizer, max_grad_norm=max_grad_norm)
        self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
        # build_trainer() passes a GradScaler when cfg.SOLVER.AMP.ENABLED
        self.grad_scaler = grad_scaler
        self.ema_momentum = ema_momentum
        self.unsup_weight = unsup_weight
        self.score_thresh = score_thresh

    def _make_pseudo_labels(self, teacher_out):
        scores = teacher_out["objectness"].float().sigmoid()
        keep = scores > self.score_thresh
        return {"objectness": keep.float(), "boxes": teacher_out["boxes"].float(), "keep": keep}

    def _backward(self, losses):
        self.optimizer.zero_grad()
        if self.grad_scaler is not None:
            self.grad_scaler.scale(losses).backward()  # expect: AMP008
        else:
            losses.backward()  # expect: AMP008

    @torch.no_grad()
    def _update_teacher(self):
        m = self.ema_momentum
        student = self.model.state_dict()
        for k, v in self.teacher.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(m).add_(student[k].detach(), alpha=1 - m)

    def run_step(self):
        start = time.perf_counter()
        data = next(self._data_loader_iter)
        data_time = time.perf_counter() - start
        labeled, weak, strong = data["labeled"], data["unlabeled_weak"], data["unlabeled_strong"]

        with torch.no_grad():
            with autocast("cuda", dtype=torch.float16):
                teacher_out = self.teacher(weak, return_raw=True)
            pseudo = self._make_pseudo_labels(teacher_out)

        with autocast("cuda", dtype=torch.float16):
            sup_losses = self.model(labeled)
            student_out = self.model(strong, return_raw=True)
            unsup_obj = F.binary_cross_entropy(student_out["objectness"].sigmoid(), pseudo["objectness"])  # expect: AMP003
            losses = sum(sup_losses.values()) + self.unsup_weight * unsup_obj
            self._backward(losses)

        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        self.optimizer.step()  # expect: AMP006
        self._update_teacher()
        sup_losses["loss_unsup_obj"] = unsup_obj
        self._write_metrics(sup_losses, data_time)


class IterationTimer(HookBase):
    def __init__(self):
        self._start = None

    def before_step(self):
        self._start = time.perf_counter()

    def after_step(self):
        self.trainer.metrics["time"] = time.perf_counter() - self._start


class LRScheduler(HookBase):
    def __init__(self, scheduler):
        self._scheduler = scheduler

    def after_step(self):
        self.trainer.metrics["lr"] = self._scheduler.get_last_lr()[0]
        self._scheduler.step()


class LossScaleLogger(HookBase):
    def after_step(self):
        scaler = getattr(self.trainer, "grad_scaler", None)
        if scaler is not None and scaler.is_enabled():
            self.trainer.metrics["loss_scale"] = scaler.get_scale()


class PeriodicCheckpointer(HookBase):
    def __init__(self, period, path_fmt):
        self.period = period
        self.path_fmt = path_fmt

    def after_step(self):
        it = self.trainer.iter + 1
        if it % self.period == 0 or it == self.trainer.max_iter:
            state = {"model": self.trainer.model.state_dict(), "optimizer": self.trainer.optimizer.state_dict(),
                     "iteration": it}
            scaler = getattr(self.trainer, "grad_scaler", None)
            if scaler is not None:
                state["grad_scaler"] = scaler.state_dict()
            torch.save(state, self.path_fmt.format(it))


class EvalHook(HookBase):
    def __init__(self, period, eval_function):
        self.period = period
        self.eval_function = eval_function

    def after_step(self):
        it = self.trainer.iter + 1
        if it % self.period == 0:
            was_training = self.trainer.model.training
            self.trainer.model.eval()
            with torch.no_grad():
                results = self.eval_function(self.trainer.model)
            self.trainer.model.train(was_training)
            self.trainer.metrics.update({f"eval/{k}": v for k, v in results.items()})


def build_trainer(cfg, model, data_loader, optimizer, scheduler, eval_function):
    amp_on = cfg.SOLVER.AMP.ENABLED
    clip = cfg.SOLVER.CLIP_GRADIENTS.CLIP_VALUE if cfg.SOLVER.CLIP_GRADIENTS.ENABLED else 0.0
    if cfg.SEMI.ENABLED:
        trainer = MeanTeacherTrainer(model, data_loader, optimizer,
                                     grad_scaler=GradScaler("cuda") if amp_on else None,
                                     unsup_weight=cfg.SEMI.UNSUP_WEIGHT, max_grad_norm=clip)
    elif amp_on and cfg.SOLVER.AMP.PRECISION == "bfloat16":
        trainer = BF16Trainer(model, data_loader, optimizer, max_grad_norm=clip)
    elif amp_on:
        trainer = AMPTrainer(model, data_loader, optimizer, max_grad_norm=clip)
    else:
        trainer = SimpleTrainer(model, data_loader, optimizer, max_grad_norm=clip)
    trainer.register_hooks([
        IterationTimer(),
        LRScheduler(scheduler),
        LossScaleLogger(),
        PeriodicCheckpointer(cfg.SOLVER.CHECKPOINT_PERIOD, cfg.OUTPUT_DIR + "/model_{:07d}.pth"),
        EvalHook(cfg.TEST.EVAL_PERIOD, eval_function),
    ])
    return trainer
