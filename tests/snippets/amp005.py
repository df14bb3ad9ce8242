"""AMP005 clip-before-unscale: clipping gradients that GradScaler scaled but did not unscale."""
import functools

import torch
import torch.nn as nn
import torch.nn.utils as nn_utils
from accelerate import Accelerator
from apex import amp as apex_amp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.utils import clip_grad_norm_, clip_grad_value_
from torch.nn.utils import clip_grad_norm_ as clip_norm

# ---------------------------------------------------------------- positives


def clip_without_unscale(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # AMP005
    scaler.step(optimizer)
    scaler.update()


def clip_value_without_unscale(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    clip_grad_value_(model.parameters(), 0.5)  # AMP005
    scaler.step(optimizer)
    scaler.update()


def clip_through_from_import(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    clip_grad_norm_(model.parameters(), max_norm=1.0)  # AMP005
    scaler.step(optimizer)
    scaler.update()


def clip_through_renamed_import(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    clip_norm(model.parameters(), 1.0)  # AMP005
    scaler.step(optimizer)
    scaler.update()


def clip_through_module_alias(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    nn_utils.clip_grad_norm_(model.parameters(), 1.0)  # AMP005
    scaler.step(optimizer)
    scaler.update()


def clip_through_nn(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # AMP005
    scaler.step(optimizer)
    scaler.update()


def local_scaler(model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for batch in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda"):
            loss = model(batch)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # AMP005
        scaler.step(optimizer)
        scaler.update()


def scaled_loss_alias(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    loss = scaler.scale(loss)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # AMP005
    scaler.step(optimizer)
    scaler.update()


def unscale_after_clip(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # AMP005
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def clip_under_accumulation(model, loader, optimizer, scaler, accum_steps, max_norm):
    for step, batch in enumerate(loader):
        with torch.autocast("cuda"):
            loss = model(batch) / accum_steps
        scaler.scale(loss).backward()
        if (step + 1) % accum_steps == 0:
            if max_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


class Trainer:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def train_step(self, batch):
        with torch.autocast("cuda"):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)  # AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()


class BackwardAndStepInSeparateMethods:
    def __init__(self, model, optimizer, max_norm):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def optimizer_step(self):
        if self.max_norm:
            clip_grad_norm_(self.model.parameters(), self.max_norm)  # AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()


class ClipAndPlainStepInAnotherMethod:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def training_step(self, batch):
        with torch.autocast("cuda"):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()

    def after_accumulation(self):
        clip_grad_norm_(self.model.parameters(), 1.0)  # AMP005
        self.scaler.update()


def scaled_branch_then_shared_clip(model, batch, optimizer, scaler, use_amp):
    with torch.autocast("cuda", enabled=use_amp):
        loss = model(batch)
    if use_amp:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # AMP005
    if use_amp:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


def clip_inside_scaler_branch(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    if scaler is not None:
        scaler.scale(loss).backward()
        clip_grad_norm_(model.parameters(), 1.0)  # AMP005
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def second_optimizer_not_unscaled(gen, disc, batch, opt_g, opt_d, scaler):
    with torch.autocast("cuda"):
        d_loss = disc(batch)
    scaler.scale(d_loss).backward()
    scaler.unscale_(opt_d)
    clip_grad_norm_(disc.parameters(), 1.0)
    scaler.step(opt_d)
    with torch.autocast("cuda"):
        g_loss = gen(batch)
    scaler.scale(g_loss).backward()
    clip_grad_norm_(gen.parameters(), 1.0)  # AMP005
    scaler.step(opt_g)
    scaler.update()


def scaler_enabled_by_flag(model, batch, optimizer, use_amp):
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    with torch.autocast("cuda", enabled=use_amp):
        loss = model(batch)
    scaler.scale(loss).backward()
    clip_grad_value_(model.parameters(), 1.0)  # AMP005
    scaler.step(optimizer)
    scaler.update()


def multiline_clip(model, batch, optimizer, scaler, args):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(  # AMP005
        model.parameters(),
        args.max_grad_norm,
    )
    scaler.step(optimizer)
    scaler.update()
    return grad_norm


def scaled_division_backward(model, batch, optimizer, scaler, accum):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss / accum).backward()
    clip_grad_norm_(model.parameters(), 5.0)  # AMP005
    scaler.step(optimizer)
    scaler.update()


def clip_with_precomputed_norm(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    total_norm = nn_utils.get_total_norm([p.grad for p in params])
    nn_utils.clip_grads_with_norm_(params, 1.0, total_norm)  # AMP005
    scaler.step(optimizer)
    scaler.update()


# ---------------------------------------------------------------- negatives


def unscaled_precomputed_norm(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    params = list(model.parameters())
    nn_utils.clip_grads_with_norm_(params, 1.0, nn_utils.get_total_norm(params))
    scaler.step(optimizer)
    scaler.update()


def unscale_then_clip(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()


def unscale_in_enclosing_block(model, batch, optimizer, scaler, clip_grad, clip_mode):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    if clip_grad is not None:
        scaler.unscale_(optimizer)
        if clip_mode == "norm":
            clip_grad_norm_(model.parameters(), clip_grad)
        else:
            clip_grad_value_(model.parameters(), clip_grad)
    scaler.step(optimizer)
    scaler.update()


def unscale_in_separate_guard(model, batch, optimizer, scaler, max_norm):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    if max_norm:
        scaler.unscale_(optimizer)
    if max_norm:
        clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def no_scaler_branch(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def use_amp_else_branch(model, batch, optimizer, scaler, use_amp):
    if use_amp:
        with torch.autocast("cuda"):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        return loss
    loss = model(batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def disabled_scaler(model, batch, optimizer):
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    loss = model(batch)
    scaler.scale(loss).backward()
    clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()


def plain_fp32_training(model, batch, optimizer):
    loss = model(batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def bf16_without_scaler(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    loss.backward()
    clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def accelerate_clip(model, loader, optimizer):
    accelerator = Accelerator(mixed_precision="fp16")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.autocast():
            loss = model(batch)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


class NativeScaler:
    """timm-style wrapper: unscales before clipping internally."""

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if clip_grad is not None:
            self._scaler.unscale_(optimizer)
            clip_grad_norm_(parameters, clip_grad)
        self._scaler.step(optimizer)
        self._scaler.update()


def timm_loss_scaler(model, batch, optimizer, loss_scaler, clip_grad):
    with torch.autocast("cuda"):
        loss = model(batch)
    loss_scaler(loss, optimizer, clip_grad=clip_grad, parameters=model.parameters())


def apex_scale_loss(model, batch, optimizer):
    loss = model(batch)
    with apex_amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    clip_grad_norm_(apex_amp.master_params(optimizer), 1.0)
    optimizer.step()


class ClipInAttribute:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")
        self.clip_fn = functools.partial(clip_grad_norm_, max_norm=1.0)

    def step(self, batch):
        with torch.autocast("cuda"):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        self.clip_fn(self.model.parameters())
        self.scaler.step(self.optimizer)
        self.scaler.update()


class ClippingOptimizer(torch.optim.SGD):
    """Clipping inside step(): GradScaler.step unscales before calling it."""

    def step(self, closure=None):
        for group in self.param_groups:
            clip_grad_norm_(group["params"], 1.0)
        return super().step(closure)


def helper_takes_scaler(model, batch, optimizer, scaler, unscale_grads):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    unscale_grads(scaler, optimizer)
    clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()


def clip_in_separate_function(model, max_norm):
    return clip_grad_norm_(model.parameters(), max_norm)


def lightning_manual_backward(self, batch):
    opt = self.optimizers()
    loss = self.model(batch)
    self.manual_backward(loss)
    self.clip_gradients(opt, gradient_clip_val=1.0)
    clip_grad_norm_(self.parameters(), 1.0)
    opt.step()


def both_optimizers_unscaled(model, batch, opt_a, opt_b, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.unscale_(opt_a)
    scaler.unscale_(opt_b)
    clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()


def early_return_amp_path(model, batch, optimizer, scaler):
    if scaler is None:
        loss = model(batch)
        loss.backward()
        clip_grad_value_(model.parameters(), 1.0)
        optimizer.step()
        return
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    clip_grad_value_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()


def fairseq_style_optimizer(model, batch, optimizer):
    loss = model(batch)
    optimizer.backward(loss)
    optimizer.clip_grad_norm(1.0)
    optimizer.step()


class UnscaleInHelperMethod:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def _unscale_grads(self):
        self.scaler.unscale_(self.optimizer)

    def train_step(self, batch):
        with torch.autocast("cuda"):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()
        self._unscale_grads()
        clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()


class UnscaledInTheBackwardMethod:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)

    def optimizer_step(self):
        clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()


class BaseFromAnotherModule(Accelerator):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def optimizer_step(self):
        clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()


class ScalerHandedToAHelper:
    def __init__(self, model, optimizer, unscale_all):
        self.model = model
        self.optimizer = optimizer
        self.unscale_all = unscale_all
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()
        self.unscale_all(self.scaler, self.optimizer)

    def optimizer_step(self):
        clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()


# ---- clips known by the model's class, and helpers that clip ---------------------


class FsdpTrainer:
    def __init__(self, model, optimizer):
        self.optimizer = optimizer
        self.scaler = ShardedGradScaler()
        self.model = FSDP(model)

    def step(self, batch):
        loss = self.model(batch)
        self.scaler.scale(loss).backward()
        self.model.clip_grad_norm_(1.0)  # AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()


def fsdp_model_clip(model, batch, optimizer):
    model = FSDP(model)
    scaler = ShardedGradScaler()
    scaler.scale(model(batch)).backward()
    model.clip_grad_norm_(1.0)  # AMP005
    scaler.step(optimizer)
    scaler.update()


def fsdp_model_clip_after_unscale(model, batch, optimizer):
    model = FSDP(model)
    scaler = ShardedGradScaler()
    scaler.scale(model(batch)).backward()
    scaler.unscale_(optimizer)
    model.clip_grad_norm_(1.0)
    scaler.step(optimizer)
    scaler.update()


def engine_clips_after_unscaling_itself(engine, batch, scaler):
    scaler.scale(engine(batch)).backward()
    engine.clip_grad_norm_(1.0)
    scaler.step(engine.optimizer)
    scaler.update()


class ClipsThroughAHelper:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def _clip(self):
        return clip_grad_norm_(self.model.parameters(), 1.0)

    def _unscale_and_clip(self):
        self.scaler.unscale_(self.optimizer)
        return clip_grad_norm_(self.model.parameters(), 1.0)

    def step(self, batch):
        self.scaler.scale(self.model(batch)).backward()
        self._clip()  # AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def step_with_unscaling_helper(self, batch):
        self.scaler.scale(self.model(batch)).backward()
        self._unscale_and_clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def step_after_unscale(self, batch):
        self.scaler.scale(self.model(batch)).backward()
        self.scaler.unscale_(self.optimizer)
        self._clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()


# ---- methods found in base classes of this module (mixins) ------------------------


class ClipMixin:
    max_norm = 1.0

    def clip(self):
        return nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)


class MixinClipsScaledGrads(ClipMixin):
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        torch.autograd.backward(self.scaler.scale(loss))

    def optimizer_step(self):
        grad_norm = self.clip()  # AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return grad_norm


class OverrideUnscalesFirst(MixinClipsScaledGrads):
    def optimizer_step(self):
        self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return grad_norm


class LoggingMixin:
    def log_grad_norm(self):
        norms = [p.grad.norm() for p in self.model.parameters() if p.grad is not None]
        return torch.stack(norms).norm()


class GrandparentClipsThroughTwoMixins(LoggingMixin, MixinClipsScaledGrads):
    def train_step(self, batch):
        self.scaler.scale(self.model(batch)).backward()
        self.log_grad_norm()
        self.clip()  # AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()


class UnscaleAndClipMixin:
    def clip(self):
        self.scaler.unscale_(self.optimizer)
        return nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)


class MixinUnscalesBeforeClipping(UnscaleAndClipMixin):
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def train_step(self, batch):
        self.scaler.scale(self.model(batch)).backward()
        self.clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()


class MixinMethodDoesNotClip(LoggingMixin):
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def train_step(self, batch):
        self.scaler.scale(self.model(batch)).backward()
        self.log_grad_norm()
        self.scaler.step(self.optimizer)
        self.scaler.update()


class HookBase:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def before_clip(self):
        pass

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def optimizer_step(self):
        self.before_clip()
        clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()


class SubclassHookUnscales(HookBase):
    def before_clip(self):
        self.scaler.unscale_(self.optimizer)


class MixinNextToABaseFromElsewhere(ClipMixin, Accelerator):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def optimizer_step(self):
        self.clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()


def clip_then_step(model, optimizer, step_scaler):
    """Steps and updates the scaler it is passed but never unscales it, and is called right
    after a scaled backward: its clip is the line to change (the scaler is at hand)."""
    clip_grad_norm_(model.parameters(), 1.0)  # AMP005
    step_scaler.step(optimizer)
    step_scaler.update()


def train_through_clip_then_step(model, loader, optimizer):
    grad_scaler = torch.amp.GradScaler("cuda")
    for batch in loader:
        grad_scaler.scale(model(batch)).backward()
        clip_then_step(model, optimizer, grad_scaler)


def unscale_clip_then_step(model, optimizer, step_scaler):
    step_scaler.unscale_(optimizer)
    clip_grad_norm_(model.parameters(), 1.0)
    step_scaler.step(optimizer)
    step_scaler.update()


def train_through_unscale_clip_then_step(model, loader, optimizer):
    grad_scaler = torch.amp.GradScaler("cuda")
    for batch in loader:
        grad_scaler.scale(model(batch)).backward()
        unscale_clip_then_step(model, optimizer, grad_scaler)


def train_epoch_with_its_own_scaler(model, loader, optimizer):
    scaler = torch.amp.GradScaler("cuda")
    for x in loader:
        with torch.autocast("cuda"):
            loss = model(x).mean()
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)  # AMP005
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def fit_calls_the_epoch_with_its_own_scaler(model, loader, optimizer, epochs):
    for _ in range(epochs):
        train_loss = train_epoch_with_its_own_scaler(model, loader, optimizer)
        print(train_loss)


def clip_helper(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def scaled_backward_then_clip_helper(model, batch, optimizer, scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    clip_helper(model)  # AMP005
    scaler.step(optimizer)
    scaler.update()


class BackwardClipsItself:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)  # AMP005

    def train_step(self, batch):
        with torch.autocast("cuda"):
            loss = self.model(batch)
        self.backward(loss)
        self.scaler.step(self.optimizer)
        self.scaler.update()


# ---- an FSDP model rebound from the model it wraps, handed to a loop called in a loop -----
def rebound_fsdp_epoch(model, loader, optimizer, scaler, max_norm):
    for tokens, labels in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(tokens), labels)
        scaler.scale(loss).backward()
        model.clip_grad_norm_(max_norm)  # AMP005
        scaler.step(optimizer)
        scaler.update()


def rebound_fsdp_main(args, build, loader):
    model = build(args)
    if args.low_memory_init:
        model = model.to(torch.bfloat16)
    model = FSDP(model, use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(args.epochs):
        rebound_fsdp_epoch(model, loader, optimizer, scaler, args.max_norm)


# ---- the scaled backward in a helper of this module; an FSDP model handed in ----------
def backward(total_loss, scaler):
    if scaler is not None:
        scaler.scale(total_loss).backward()
    else:
        total_loss.backward()


def train_through_a_backward_helper(model, loader, optimizer, scaler, max_norm):
    for images, texts in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(images, texts)
        backward(loss, scaler)
        if scaler is not None:
            clip_grad_norm_(model.parameters(), max_norm)  # AMP005
            scaler.step(optimizer)
            scaler.update()
        else:
            clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()


def train_through_a_backward_helper_then_unscale(model, loader, optimizer, scaler, max_norm):
    for images, texts in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(images, texts)
        backward(loss, scaler)
        scaler.unscale_(optimizer)
        clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()


def backward_and_step(loss, optimizer, scaler, max_norm, params):
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    clip_grad_norm_(params, max_norm)
    scaler.step(optimizer)
    scaler.update()


def train_through_a_helper_that_steps(model, loader, optimizer, scaler):
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        backward_and_step(loss, optimizer, scaler, 1.0, model.parameters())
        clip_grad_norm_(model.parameters(), 1.0)


def fsdp_epoch(model, loader, optimizer, scaler):
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        scaler.scale(loss).backward()
        model.clip_grad_norm_(1.0)  # AMP005
        scaler.step(optimizer)
        scaler.update()


def fsdp_main(module, loader, optimizer):
    model = FSDP(module)
    fsdp_epoch(model, loader, optimizer, torch.amp.GradScaler("cuda"))


def make_grad_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(enabled=enabled)


def optimizer_step(model, optimizer, scheduler, scaler, clip):
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # AMP005
    scaler.step(optimizer)
    scheduler.step()
    scaler.update()


def optimizer_step_then_plain(model, optimizer, scaler):
    scaler.step(optimizer)
    scaler.update()
    optimizer.step()  # AMP006


def train_raft(model, loader, optimizer, scheduler, args):
    scaler = make_grad_scaler(args.mixed_precision)
    for image1, image2, flow in loader:
        optimizer.zero_grad()
        loss = (model(image1, image2) - flow).abs().mean()
        scaler.scale(loss).backward()
        optimizer_step(model, optimizer, scheduler, scaler, args.clip)
        scaler.scale(loss).backward()
        optimizer_step_then_plain(model, optimizer, scaler)


def optimizer_step_called_unscaled(model, optimizer, scaler, clip):
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()


def train_unscaling_first(model, loader, optimizer, args):
    scaler = make_grad_scaler(args.mixed_precision)
    for batch in loader:
        scaler.scale(model(batch).mean()).backward()
        scaler.unscale_(optimizer)
        optimizer_step_called_unscaled(model, optimizer, scaler, args.clip)


# ---- an if on the clipping mode, not on the scaler: one arm unscales, the other does not --
def slowfast_epoch(model, loader, optimizer, scaler, cfg):
    for inputs, labels in loader:
        with torch.autocast("cuda", enabled=cfg.mixed_precision):
            loss = model(inputs, labels)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if cfg.clip_grad_val:
            torch.nn.utils.clip_grad_value_(model.parameters(), cfg.clip_grad_val)  # AMP005
        elif cfg.clip_grad_l2norm:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_l2norm)
        scaler.step(optimizer)
        scaler.update()


def slowfast_main(model, loader, optimizer, cfg):
    slowfast_epoch(model, loader, optimizer, torch.amp.GradScaler("cuda"), cfg)


# ---- an optimizer wrapper whose clip method runs before the method that steps the scaler --
class AMPOptimizerWrapper:
    def __init__(self, params, lr):
        self.params = list(params)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def clip_grad_norm(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)  # AMP005

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


class WrapperTrainer:
    def __init__(self, model, lr):
        self.model = model
        self.optimizer = AMPOptimizerWrapper(model.parameters(), lr)

    def train_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        self.optimizer.backward(loss)
        grad_norm = self.optimizer.clip_grad_norm(1.0)
        self.optimizer.step()
        return grad_norm


class UnscalingWrapper:
    def __init__(self, params, lr):
        self.params = list(params)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def clip_grad_norm(self, max_norm):
        self.scaler.unscale_(self.optimizer)
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()


class UnscalingTrainer:
    def __init__(self, model, lr):
        self.model = model
        self.optimizer = UnscalingWrapper(model.parameters(), lr)

    def train_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        self.optimizer.backward(loss)
        self.optimizer.clip_grad_norm(1.0)
        self.optimizer.step()


class NormAfterStepWrapper:
    def __init__(self, params, lr):
        self.params = list(params)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def clip_grad_norm(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()


def train_logging_norm_after_step(model, loader, lr):
    optimizer = NormAfterStepWrapper(model.parameters(), lr)
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.clip_grad_norm(float("inf"))  # unscaled by scaler.step by now


# ---- the wrapper chosen by a flag between a plain and a scaling one (fairseq) -------------
class PlainOptimizerWrapper:
    def __init__(self, params, lr):
        self.params = list(params)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)

    def backward(self, loss):
        loss.backward()

    def clip_grad_norm(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def step(self):
        self.optimizer.step()


class ScalingOptimizerWrapper(PlainOptimizerWrapper):
    def __init__(self, params, lr):
        super().__init__(params, lr)
        self.scaler = torch.amp.GradScaler("cuda")

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def clip_grad_norm(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)  # AMP005

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()


class FlagChosenWrapperTrainer:
    def __init__(self, model, lr, amp):
        self.model = model
        params = list(model.parameters())
        self.optimizer = ScalingOptimizerWrapper(params, lr) if amp else PlainOptimizerWrapper(params, lr)

    def train_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        self.optimizer.backward(loss)
        grad_norm = self.optimizer.clip_grad_norm(1.0)
        self.optimizer.step()
        return grad_norm


# ---- a clipping mixin whose callers each scale their own backward: reported at the calls ----


class ClipGradMixin:
    clip_grad = None

    def clip_gradients(self):
        if not self.clip_grad:
            return None
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)


class EngineSteppingPlainly(ClipGradMixin):
    def __init__(self, model, optimizer, clip_grad):
        self.model, self.optimizer, self.clip_grad = model, optimizer, clip_grad
        self.scaler = torch.amp.GradScaler("cuda")

    def run_iter(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        self.scaler.scale(loss).backward()
        grad_norm = self.clip_gradients()  # AMP005
        self.optimizer.step()  # AMP006
        return grad_norm


class SubEngineSteppingPlainly(EngineSteppingPlainly):
    def run_iter(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch) * 2
        self.scaler.scale(loss).backward()
        stats = {"grad_norm": self.clip_gradients()}  # AMP005
        self.optimizer.step()  # AMP006
        return stats
