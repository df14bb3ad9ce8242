"""AMP010 scaler-dtype-mismatch, first half: fp16 autocast and backward with no GradScaler.

No gradient scaler is built where it could reach other functions (at module or class
level, or handed on): the rule looks at the whole file. The cases at the end use one in
their own function only. The other half (a scaler used with bf16) is in
amp010_bf16_with_scaler.py.
"""
import contextlib
import functools

import torch
from torch import autocast

fp16_ctx = torch.autocast("cuda", dtype=torch.float16)  # AMP010
fp16_partial = functools.partial(torch.autocast, "cuda", dtype=torch.float16)  # AMP010
PTDTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ctx = contextlib.nullcontext() if PTDTYPE else torch.amp.autocast("cuda", dtype=PTDTYPE["float16"])


# ---------------------------------------------------------------- positives


def explicit_fp16(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.float16):  # AMP010
        loss = model(batch)
    loss.backward()
    optimizer.step()


def explicit_half(model, batch, optimizer):
    with torch.amp.autocast("cuda", dtype=torch.half):  # AMP010
        loss = model(batch)
    loss.backward()
    optimizer.step()


def cuda_default_dtype(model, batch, optimizer):
    with torch.autocast(device_type="cuda"):  # AMP010
        loss = model(batch)
    loss.backward()
    optimizer.step()


def cpu_fp16(model, batch, optimizer):
    with torch.autocast("cpu", dtype=torch.float16):  # AMP010
        loss = model(batch)
    loss.backward()
    optimizer.step()


def imported_autocast(model, batch, optimizer):
    with autocast("cuda", dtype=torch.float16):  # AMP010
        loss = model(batch)
    loss.backward()
    optimizer.step()


def autograd_backward(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.float16):  # AMP010
        loss = model(batch)
    torch.autograd.backward(loss)
    optimizer.step()


def in_training_loop(model, loader, optimizer, accum_steps):
    for step, batch in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16):  # AMP010
            loss = model(batch) / accum_steps
        loss.backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()


def enabled_literal(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.float16, enabled=True):  # AMP010
        loss = model(batch)
    loss.backward()
    optimizer.step()


def module_context_variable(model, batch, optimizer):
    with fp16_ctx:
        loss = model(batch)
    loss.backward()
    optimizer.step()


def partial_context(model, batch, optimizer):
    with fp16_partial():
        loss = model(batch)
    loss.backward()
    optimizer.step()


class Trainer:
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer

    def train_step(self, batch):
        self.optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):  # AMP010
            loss = self.model(batch)
        loss.backward()
        self.optimizer.step()


def divided_backward(model, batch, optimizer, accum):
    with torch.autocast("cuda", dtype=torch.float16):  # AMP010
        loss = model(batch)
    (loss / accum).backward()
    optimizer.step()


def multi_item_with(model, batch, optimizer):
    with torch.enable_grad(), torch.autocast("cuda", dtype=torch.float16):  # AMP010
        loss = model(batch)
    loss.backward()
    optimizer.step()


def two_losses(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.float16):  # AMP010
        loss_a, loss_b = model(batch)
    (loss_a + loss_b).backward()
    optimizer.step()


def backward_of_sum(model, batch, optimizer):
    with torch.autocast(device_type="cuda", dtype=torch.float16):  # AMP010
        out = model(batch)
    out.sum().backward()
    optimizer.step()


def flag_context_variable(model, batch, optimizer, args):
    ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else contextlib.nullcontext()  # AMP010
    with ctx:
        loss = model(batch)
    loss.backward()
    optimizer.step()


def flag_enabled_region(model, batch, optimizer, use_amp):
    with torch.autocast("cuda", enabled=use_amp):  # AMP010
        loss = model(batch)
    loss.backward()
    optimizer.step()


def partial_written_in_function(model, batch, optimizer):
    amp = functools.partial(torch.autocast, device_type="cuda", dtype=torch.float16)  # AMP010
    with amp():
        loss = model(batch)
    loss.backward()
    optimizer.step()


def step_with_context(model, batch, optimizer, amp_ctx):
    with amp_ctx:
        loss = model(batch)
    loss.backward()
    optimizer.step()


def run_steps(model, batches, optimizer):
    for batch in batches:
        step_with_context(model, batch, optimizer, torch.autocast("cuda", dtype=torch.float16))  # AMP010


# ---------------------------------------------------------------- negatives


def static_loss_scale_through_autograd(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    torch.autograd.backward(loss * 1024.0)
    for p in model.parameters():
        p.grad.div_(1024.0)
    optimizer.step()


def dtype_chosen_by_flag(model, batch, optimizer, fp16):
    with torch.autocast("cuda", dtype=torch.float16 if fp16 else torch.bfloat16):
        loss = model(batch)
    loss.backward()
    optimizer.step()



def bf16_without_scaler(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch)
    loss.backward()
    optimizer.step()


def cpu_default_is_bf16(model, batch, optimizer):
    with torch.autocast("cpu"):
        loss = model(batch)
    loss.backward()
    optimizer.step()


def fp16_inference(model, batch):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        return model(batch)


def fp16_forward_only(model, batch, criterion):
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(batch)
        return criterion(out, batch)


def unknown_dtype(model, batch, optimizer, amp_dtype):
    with torch.autocast("cuda", dtype=amp_dtype):
        loss = model(batch)
    loss.backward()
    optimizer.step()


def nanogpt_context(model, batch, optimizer):
    with ctx:
        loss = model(batch)
    loss.backward()
    optimizer.step()


def disabled_region(model, batch, optimizer):
    with torch.autocast("cuda", dtype=torch.float16, enabled=False):
        loss = model(batch)
    loss.backward()
    optimizer.step()


def accelerate_backward(accelerator, model, batch, optimizer):
    with accelerator.autocast():
        loss = model(batch)
    accelerator.backward(loss)
    optimizer.step()


def deepspeed_engine(model_engine, batch):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model_engine(batch)
    model_engine.backward(loss)
    model_engine.step()


def lightning_manual_backward(self, batch):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = self.model(batch)
    self.manual_backward(loss)


def timm_loss_scaler(model, batch, optimizer, loss_scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    loss_scaler(loss, optimizer, parameters=model.parameters())


def static_loss_scale(model, batch, optimizer, loss_scale):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    (loss * loss_scale).backward()
    for param in model.parameters():
        param.grad.div_(loss_scale)
    optimizer.step()


def mmengine_wrapper(model, batch, optim_wrapper):
    with optim_wrapper.optim_context(model):
        loss = model(batch)
    optim_wrapper.update_params(loss)


def fp32_training(model, batch, optimizer):
    loss = model(batch)
    loss.backward()
    optimizer.step()


def apex_amp(model, batch, optimizer, amp):
    loss = model(batch)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()


def forward_step(model, batch):
    with torch.autocast("cuda", dtype=torch.float16):  # AMP010
        return model(batch)


def train_through_forward_step(model, loader, optimizer):
    for batch in loader:
        loss = forward_step(model, batch)
        loss.backward()
        optimizer.step()


def teacher_logits(teacher, batch):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        return teacher(batch)


def train_student_in_fp32(student, teacher, loader, optimizer):
    for batch in loader:
        soft = teacher_logits(teacher, batch)
        loss = (student(batch) - soft.float()).pow(2).mean()
        loss.backward()
        optimizer.step()


def train_student_with_teacher_in_the_same_function(student, teacher, loader, optimizer):
    for batch in loader:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            soft = teacher(batch)
        loss = (student(batch) - soft.float()).pow(2).mean()
        loss.backward()
        optimizer.step()


# ---- a context chosen at run time among autocasts of different dtypes ---------------
def train_precision_by_match(model, loader, optimizer, precision):
    match precision:
        case "fp16":
            amp_ctx = torch.autocast("cuda", dtype=torch.float16)  # AMP010
        case "bf16":
            amp_ctx = torch.autocast("cuda", dtype=torch.bfloat16)
        case _:
            amp_ctx = contextlib.nullcontext()
    for batch in loader:
        with amp_ctx:
            loss = model(batch)
        loss.backward()
        optimizer.step()


def train_bf16_or_fp32_by_match(model, loader, optimizer, precision):
    match precision:
        case "bf16":
            amp_ctx = torch.autocast("cuda", dtype=torch.bfloat16)
        case "bf16-cpu":
            amp_ctx = torch.autocast("cpu", dtype=torch.bfloat16)
        case _:
            amp_ctx = contextlib.nullcontext()
    for batch in loader:
        with amp_ctx:
            loss = model(batch)
        loss.backward()
        optimizer.step()


def eval_precision_by_choice(model, loader, half):
    eval_ctx = torch.autocast("cuda", dtype=torch.float16) if half else torch.autocast("cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        return [model(batch) for batch in loader]


# ---- a function that scales one backward and runs another fp16 one plain ------------
def smoke_loop_after_the_scaled_loop(model, small_model, loader, optimizer, small_opt, dtype):
    scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            _, loss = model(batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):  # AMP010
            _, loss = small_model(batch)
        loss.backward()
        small_opt.step()


def generator_step_skips_the_scaler(gen, disc, batch, opt_g, opt_d, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        d_loss = disc(batch, gen(batch).detach())
    scaler.scale(d_loss).backward()
    scaler.step(opt_d)
    scaler.update()
    with torch.autocast("cuda", dtype=torch.float16):  # AMP010
        g_loss = -disc(gen(batch)).mean()
    torch.autograd.backward(g_loss)
    opt_g.step()


def aux_loss_backward_unscaled(model, batch, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):  # AMP010
        loss, aux_loss = model(batch)
    scaler.scale(loss).backward(retain_graph=True)
    aux_loss.backward()
    scaler.step(optimizer)
    scaler.update()


def scaled_loop_and_fp16_eval(model, loader, val_loader, optimizer, scaler):
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    losses = []
    for batch in val_loader:
        with torch.autocast("cuda", dtype=torch.float16):
            losses.append(model(batch).item())
    return losses


def scaler_or_plain_by_flag(model, batch, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()


def scaler_path_continues_early(model, loader, optimizer, scaler, use_amp):
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        if use_amp:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            continue
        loss.backward()
        optimizer.step()


def plain_backward_by_conditional_expression(model, batch, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    scaler.scale(loss).backward() if scaler.is_enabled() else loss.backward()


def fp32_probe_next_to_the_scaled_loop(model, probe, batch, optimizer, probe_opt, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    probe_loss = probe(batch.float()).mean()
    probe_loss.backward()
    probe_opt.step()


def bf16_region_with_plain_backward(model, aux_model, batch, optimizer, aux_opt, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        aux_loss = aux_model(batch)
    aux_loss.backward()
    aux_opt.step()


def loss_scaled_inside_the_region(model, batch, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = scaler.scale(model(batch))
    loss.backward()
    scaler.step(optimizer)
    scaler.update()


def scaled_alias_backward(model, batch, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    to_backprop = scaler.scale(loss)
    to_backprop.backward()
    scaler.step(optimizer)
    scaler.update()


# ---- a data normaliser named scaler is not a loss scaler --------------------------------
class MinMaxNormaliser:
    def __init__(self, low, high):
        self.low, self.high = low, high

    def transform(self, x):
        return (x - self.low) / (self.high - self.low)


class LossScalerShim:
    """Holds the run's loss scaler under another name: a name with "scaler" still counts."""

    def __init__(self, inner):
        self.inner = inner

    def scale(self, loss):
        return self.inner.scale(loss)


class ForecastTrainer:
    def __init__(self, model, optimizer, normaliser, shim):
        self.model, self.optimizer = model, optimizer
        self.scaler = normaliser
        self.loss_scaler = shim

    def train_step(self, x, y):
        with torch.autocast("cuda", dtype=torch.float16):  # AMP010
            loss = torch.nn.functional.mse_loss(self.model(x), self.scaler.transform(y))
        loss.backward()
        self.optimizer.step()

    def train_step_with_shim(self, x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.loss_scaler.scale(loss).backward()
        self.optimizer.step()


def fit_forecaster(net, optimizer, shim_inner, x, y):
    trainer = ForecastTrainer(net, optimizer, MinMaxNormaliser(0.0, 1.0),
                              LossScalerShim(shim_inner))
    trainer.train_step(x, y)
    trainer.train_step_with_shim(x, y)


# ---- a scaler parameter the function never reads (a benchmark's table of step functions) ----
def step_fp16_unscaled(model, optimizer, x, y, _scaler=None):
    with torch.autocast("cuda", dtype=torch.float16):  # AMP010
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
    loss.backward()
    optimizer.step()


def step_fp16_scaled(model, optimizer, x, y, scaler=None):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def step_fp16_scaled_by_helper(model, optimizer, x, y, scaler=None):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    backward_and_step(loss, optimizer, scaler)


def backward_and_step(loss, optimizer, scaler):
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


STEP_FUNCTIONS = {"fp16": step_fp16_unscaled, "fp16_scaled": step_fp16_scaled}


# ---- gradient caching: chunks replayed with the gradient a scaled backward left -------
def gradient_cached_step(model, images, chunk_size, optimizer, scaler, contrastive):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        reps = torch.cat([model(c) for c in images.split(chunk_size)])
    reps = reps.float().requires_grad_()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = contrastive(reps)
    scaler.scale(loss).backward()
    for chunk, grad in zip(images.split(chunk_size), reps.grad.split(chunk_size)):
        with torch.autocast("cuda", dtype=torch.float16):
            chunk_reps = model(chunk)
            surrogate = torch.dot(chunk_reps.flatten().float(), grad.flatten())
        surrogate.backward()
    scaler.step(optimizer)
    scaler.update()
