"""AMP008 backward-under-autocast: backward() inside an enabled autocast region."""
import contextlib
import functools

import torch
from torch import autocast
from torch.amp import autocast as amp_autocast

scaler = torch.amp.GradScaler("cuda")
device_type = "cuda" if torch.cuda.is_available() else "cpu"
ctx = contextlib.nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type)
autocast_fp16 = functools.partial(torch.autocast, device_type="cuda")


# ---------------------------------------------------------------- positives


def backward_in_block(model, batch, optimizer):
    with torch.autocast("cuda"):
        loss = model(batch)
        loss.backward()  # AMP008
    optimizer.step()


def scaled_backward_in_block(model, batch, optimizer):
    with torch.autocast("cuda"):
        loss = model(batch)
        scaler.scale(loss).backward()  # AMP008
    scaler.step(optimizer)
    scaler.update()


def autograd_backward_in_block(model, batch):
    with torch.autocast("cuda"):
        loss = model(batch)
        torch.autograd.backward(loss)  # AMP008


def amp_namespace(model, batch):
    with torch.amp.autocast("cuda"):
        loss = model(batch)
        loss.backward()  # AMP008


def imported_autocast(model, batch):
    with autocast(device_type="cuda"):
        out = model(batch)
        out.mean().backward()  # AMP008


def renamed_autocast(model, batch):
    with amp_autocast("cuda"):
        loss = model(batch)
        (loss / 4).backward()  # AMP008


def context_variable(model, batch):
    with ctx:
        loss = model(batch)
        loss.backward()  # AMP008


def partial_autocast(model, batch):
    with autocast_fp16():
        loss = model(batch)
        loss.backward()  # AMP008


@torch.autocast("cuda")
def decorated_step(model, batch):
    loss = model(batch)
    loss.backward()  # AMP008
    return loss


def cpu_bf16_block(model, batch):
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = model(batch)
        loss.backward()  # AMP008


def benchmark_loop(model, batch, iterations):
    for _ in range(iterations):
        with torch.autocast("cuda"):
            out = model(batch)
            out.sum().backward()  # AMP008


def multiple_with_items(model, batch):
    with torch.autocast("cuda"), torch.autograd.set_detect_anomaly(True):
        loss = model(batch)
        loss.backward()  # AMP008


def nested_in_other_context(model, batch):
    with torch.autocast("cuda"):
        with torch.enable_grad():
            loss = model(batch)
            loss.backward(retain_graph=True)  # AMP008


def backward_in_conditional(model, batch, step, accum):
    with torch.autocast("cuda"):
        loss = model(batch)
        if (step + 1) % accum == 0:
            loss.backward()  # AMP008


def inner_region_of_loop(model, loader, optimizer):
    for batch in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
            scaler.scale(loss).backward()  # AMP008
        scaler.step(optimizer)
        scaler.update()


# ---------------------------------------------------------------- negatives


def backward_after_block(model, batch, optimizer):
    with torch.autocast("cuda"):
        loss = model(batch)
    loss.backward()
    optimizer.step()


def scaled_backward_after_block(model, batch, optimizer):
    with torch.autocast("cuda"):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def disabled_region(model, batch):
    with torch.autocast("cuda", enabled=False):
        loss = model(batch)
        loss.backward()


def disabled_island_inside(model, batch):
    with torch.autocast("cuda"):
        loss = model(batch)
        with torch.autocast("cuda", enabled=False):
            loss.float().backward()


def nullcontext_region(model, batch):
    with contextlib.nullcontext():
        loss = model(batch)
        loss.backward()


def no_sync_context(model, batch):
    ctx = model.no_sync
    with ctx():
        loss = model(batch)
        loss.backward()


def ddp_no_sync(model, batch):
    with model.no_sync():
        loss = model(batch)
        loss.backward()


def accelerate_accumulate(accelerator, model, batch, optimizer):
    with accelerator.accumulate(model):
        with accelerator.autocast():
            loss = model(batch)
        accelerator.backward(loss)
        optimizer.step()


def apex_scaled_loss(model, batch, optimizer, amp):
    loss = model(batch)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()


def function_defined_in_block(model, batch):
    with torch.autocast("cuda"):
        loss = model(batch)

        def closure():
            loss.backward()
            return loss

    return closure


class Scale(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        return grad * 2


@torch.autocast("cuda")
def decorated_forward_only(model, batch):
    return model(batch)


def uses_decorated_forward(model, batch):
    loss = decorated_forward_only(model, batch)
    loss.backward()


def grad_under_no_grad(model, batch):
    with torch.no_grad():
        out = model(batch)
    return out


def region_ends_before_backward_in_loop(model, loader, optimizer):
    for batch in loader:
        with torch.autocast("cuda"):
            loss = model(batch)
        loss.backward()
        optimizer.step()


def lightning_manual_backward(self, batch):
    with torch.autocast("cuda"):
        loss = self.model(batch)
    self.manual_backward(loss)


# ---- regions inherited from callers, and gradients turned off ------------------------


def _accumulate_gradients(model, batch):
    loss = model(batch)
    loss.backward()  # AMP008


def train_calls_helper_in_region(model, batch):
    with torch.autocast("cuda"):
        _accumulate_gradients(model, batch)


def _probe_sensitivity(model, batch):
    loss = model(batch).sum()
    loss.backward()


@torch.no_grad()
def evaluate_calls_probe_in_region(model, batch):
    with torch.autocast("cuda"):
        _probe_sensitivity(model, batch)


def backward_under_no_grad_and_autocast(model, batch):
    with torch.no_grad(), torch.autocast("cuda"):
        model(batch).sum().backward()


# ---- a backward run by a function of the module ------------------------------------
def accumulate(loss, grad_scaler, steps):
    grad_scaler.scale(loss / steps).backward()


def accumulate_inside_region(model, batches, optimizer, grad_scaler):
    for batch in batches:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
            accumulate(loss, grad_scaler, len(batches))  # AMP008
    grad_scaler.step(optimizer)
    grad_scaler.update()


def accumulate_after_region(model, batches, optimizer, grad_scaler):
    for batch in batches:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        accumulate(loss, grad_scaler, len(batches))
    grad_scaler.step(optimizer)
    grad_scaler.update()


def log_inside_region(model, batch, logger):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
        logger.log(loss)
        report_loss(loss)
    loss.backward()


def report_loss(loss):
    print(f"loss {loss.item():.3f}")


# ---- a backward run by an object of a class of the module ------------------------------
class ScalerWithGradNorm:
    def __init__(self):
        self._scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None):
        self._scaler.scale(loss).backward()
        self._scaler.unscale_(optimizer)
        if clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        self._scaler.step(optimizer)
        self._scaler.update()

    def scale_and_step(self, loss, optimizer):
        self._scaler.scale(loss).backward()  # AMP008
        self._scaler.step(optimizer)
        self._scaler.update()


def loss_scaler_called_inside_region(model, batch, optimizer):
    loss_scaler = ScalerWithGradNorm()
    with torch.autocast("cuda"):
        loss = model(batch)
        loss_scaler(loss, optimizer)  # AMP008


def conditional_loss_scaler_inside_region(model, batch, optimizer, use_amp):
    loss_scaler = ScalerWithGradNorm() if use_amp else None
    with torch.autocast("cuda", enabled=use_amp):
        loss = model(batch)
        if loss_scaler is not None:
            loss_scaler(loss, optimizer)  # AMP008


def passed_loss_scaler_inside_region(model, batch, optimizer, loss_scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
        loss_scaler(loss, optimizer)  # AMP008


def passed_loss_scaler_after_region(model, batch, optimizer, loss_scaler):
    with torch.autocast("cuda"):
        loss = model(batch)
    loss_scaler(loss, optimizer)


def named_method_inside_region(model, batch, optimizer):
    wrapper = ScalerWithGradNorm()
    with torch.autocast("cuda"):
        loss = model(batch)
        wrapper.scale_and_step(loss, optimizer)


def run_both_loops(model, batch, optimizer, use_amp):
    loss_scaler = ScalerWithGradNorm() if use_amp else None
    passed_loss_scaler_inside_region(model, batch, optimizer, loss_scaler)
    passed_loss_scaler_after_region(model, batch, optimizer, loss_scaler)


def loss_scaler_called_after_region(model, batch, optimizer):
    loss_scaler = ScalerWithGradNorm()
    with torch.autocast("cuda"):
        loss = model(batch)
    loss_scaler(loss, optimizer)


class DiceLoss:
    def __call__(self, logits, target):
        return 1 - (logits.sigmoid() * target).sum() / target.sum()


def loss_object_called_inside_region(model, batch, target, optimizer):
    criterion = DiceLoss()
    with torch.autocast("cuda"):
        loss = criterion(model(batch), target)
    loss.backward()
    optimizer.step()


class BackwardInItsOwnRegion:
    def __call__(self, model, batch):
        with torch.autocast("cuda"):
            model(batch).mean().backward()  # AMP008


def object_reported_inside_not_at_the_call(model, batch):
    runner = BackwardInItsOwnRegion()
    with torch.autocast("cuda"):
        runner(model, batch)


# ---- timm's loss scaler object, handed in as an optional parameter ----------------------
class NativeScalerWithClip:
    def __init__(self):
        self._scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, parameters=None):
        self._scaler.scale(loss).backward()
        self._scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        self._scaler.step(optimizer)
        self._scaler.update()


def timm_epoch(model, loader, optimizer, loss_fn, amp_autocast=contextlib.nullcontext, loss_scaler=None):
    for images, target in loader:
        with amp_autocast():
            loss = loss_fn(model(images), target)
            if loss_scaler is not None:
                loss_scaler(loss, optimizer, parameters=model.parameters())  # AMP008
            else:
                loss.backward()  # AMP008
                optimizer.step()


def timm_epoch_outside(model, loader, optimizer, loss_fn, amp_autocast=contextlib.nullcontext, loss_scaler=None):
    for images, target in loader:
        with amp_autocast():
            loss = loss_fn(model(images), target)
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, parameters=model.parameters())
        else:
            loss.backward()
            optimizer.step()


def timm_main(model, loader, optimizer, loss_fn, use_amp):
    amp_autocast = contextlib.nullcontext
    loss_scaler = None
    if use_amp:
        amp_autocast = functools.partial(torch.autocast, device_type="cuda", dtype=torch.float16)
        loss_scaler = NativeScalerWithClip()
    timm_epoch(model, loader, optimizer, loss_fn, amp_autocast=amp_autocast, loss_scaler=loss_scaler)
    timm_epoch_outside(model, loader, optimizer, loss_fn, amp_autocast=amp_autocast, loss_scaler=loss_scaler)


# ---- a context factory returned with the scaler by a builder --------------------------
def build_amp(precision):
    if precision == "amp":
        amp_ctx = functools.partial(torch.autocast, "cuda", dtype=torch.float16)
    else:
        amp_ctx = contextlib.nullcontext
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "amp")
    return amp_ctx, scaler


def scaled_backward_step(loss, scaler, accum):
    scaler.scale(loss / accum).backward()


def t5_epoch(model, loader, optimizer, opt):
    amp_ctx, scaler = build_amp(opt.precision)
    for batch in loader:
        with amp_ctx():
            loss = model(**batch)["loss"]
            scaled_backward_step(loss, scaler, opt.accum)  # AMP008
        with amp_ctx():
            loss = model(**batch)["loss"]
        scaled_backward_step(loss, scaler, opt.accum)
        scaler.step(optimizer)
        scaler.update()


# ---- a trainer's autocast method ------------------------------------------------------
class PolicyTrainer:
    def __init__(self, policy, optimizer, cfg):
        self.policy, self.optimizer, self.cfg = policy, optimizer, cfg
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg["amp"])

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg["amp"])

    def backward(self, loss):
        self.scaler.scale(loss).backward()  # AMP008

    def update(self, batch):
        with self.autocast():
            loss = self.policy(batch).mean()
            self.backward(loss)
        self.scaler.step(self.optimizer)
        self.scaler.update()


# ---- a loss scaler chosen among classes of the file -------------------------------------
class ClipNormScaler:
    def __init__(self):
        self._scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None):
        self._scaler.scale(loss).backward()
        self._scaler.unscale_(optimizer)
        if clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        self._scaler.step(optimizer)
        self._scaler.update()


class ClipValueScaler:
    def __init__(self):
        self.scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None):
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(optimizer)
        if clip_grad is not None:
            torch.nn.utils.clip_grad_value_(parameters, clip_grad)
        self.scaler.step(optimizer)
        self.scaler.update()


class StepOnlyScaler:
    """Steps what a backward elsewhere produced; runs no backward itself."""

    def __init__(self):
        self.scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None):
        self.scaler.step(optimizer)
        self.scaler.update()


def distill_epoch(model, criterion, loader, optimizer, loss_scaler, max_norm):
    for samples, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(model(samples), targets)
            loss_scaler(loss, optimizer, clip_grad=max_norm, parameters=model.parameters())  # AMP008


def run_distill(model, criterion, loader, optimizer, args):
    loss_scaler = ClipValueScaler() if args.clip_mode == "value" else ClipNormScaler()
    distill_epoch(model, criterion, loader, optimizer, loss_scaler, args.clip_grad)


def epoch_with_a_scaler_that_may_only_step(model, loader, optimizer, args):
    loss_scaler = StepOnlyScaler() if args.split_backward else ClipNormScaler()
    for samples, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(samples, targets)
            loss_scaler(loss, optimizer)
