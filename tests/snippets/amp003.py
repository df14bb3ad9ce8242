# AMP003 bce-under-autocast: binary_cross_entropy / nn.BCELoss inside an autocast region.
import contextlib
import functools
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import autocast, nn as tnn
from torch.nn import BCELoss
from torch.nn.functional import binary_cross_entropy as bce

scaler = torch.amp.GradScaler("cuda")
device_type = "cuda"
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=torch.bfloat16)


# ---- positives --------------------------------------------------------------------


def functional_in_autocast(model, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        p = torch.sigmoid(model(x))
        return F.binary_cross_entropy(p, y)  # AMP003


def amp_autocast_spelling(model, x, y):
    with torch.amp.autocast(device_type="cuda"):
        return F.binary_cross_entropy(model(x).sigmoid(), y)  # AMP003


def imported_autocast(model, x, y):
    with autocast("cpu", dtype=torch.bfloat16):
        return F.binary_cross_entropy(model(x), y)  # AMP003


def aliased_function(model, x, y):
    with torch.autocast("cuda"):
        return bce(model(x), y)  # AMP003


def torch_level_function(model, x, y):
    with torch.autocast("cuda"):
        return torch.binary_cross_entropy(model(x), y)  # AMP003


def local_module_instance(model, x, y):
    criterion = nn.BCELoss()
    with torch.autocast("cuda"):
        return criterion(model(x), y)  # AMP003


def imported_module_instance(model, x, y):
    loss_fn = BCELoss(reduction="sum")
    with torch.autocast("cuda"):
        return loss_fn(model(x), y)  # AMP003


def inline_module_instance(model, x, y):
    with torch.autocast("cuda"):
        return tnn.BCELoss()(model(x), y)  # AMP003


class SelfCriterion:
    def __init__(self, model):
        self.model = model
        self.criterion = nn.BCELoss()

    def training_step(self, x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            return self.criterion(self.model(x), y)  # AMP003


def decorated_region(model, x, y):
    @torch.autocast("cuda")
    def step():
        return F.binary_cross_entropy(model(x), y)  # AMP003

    return step()


def nanogpt_context_variable(model, x, y):
    with ctx:
        return F.binary_cross_entropy(model(x), y)  # AMP003


def timm_partial_alias(model, x, y):
    amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)
    with amp_autocast():
        return F.binary_cross_entropy(model(x), y)  # AMP003


def nested_in_other_blocks(model, loader):
    for x, y in loader:
        with torch.autocast("cuda"):
            if x.numel():
                loss = F.binary_cross_entropy(model(x), y)  # AMP003
        scaler.scale(loss).backward()


def flag_enabled_region(model, x, y, use_amp):
    with torch.autocast("cuda", enabled=use_amp):
        return F.binary_cross_entropy(model(x), y)  # AMP003


def accelerator_region(accelerator, model, x, y):
    with accelerator.autocast():
        return F.binary_cross_entropy(model(x), y)  # AMP003


def _bce_helper(p, y):
    return F.binary_cross_entropy(p, y)  # AMP003


def helper_called_only_in_region(model, x, y):
    with torch.autocast("cuda"):
        return _bce_helper(model(x).sigmoid(), y)


def deprecated_cuda_region(model, x, y):
    with torch.cuda.amp.autocast():
        return F.binary_cross_entropy(model(x), y)  # AMP003


def timm_suppress_or_partial(model, x, y, use_amp):
    amp_ctx = contextlib.suppress
    if use_amp:
        amp_ctx = functools.partial(torch.autocast, device_type="cuda", dtype=torch.float16)
    with amp_ctx():
        return F.binary_cross_entropy(model(x), y)  # AMP003


def conditional_factory(model, x, y, use_amp):
    maker = torch.autocast if use_amp else contextlib.nullcontext
    with maker("cuda"):
        return F.binary_cross_entropy(model(x), y)  # AMP003


def get_ctx(device):
    if device == "cpu":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


def context_from_factory_function(model, x, y):
    with get_ctx("cuda"):
        return F.binary_cross_entropy(model(x), y)  # AMP003


def module_moved_to_device(model, x, y):
    criterion = nn.BCELoss().cuda()
    with torch.autocast("cuda"):
        return criterion(model(x), y)  # AMP003


class BceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.loss = nn.BCELoss()

    def forward(self, x, y):
        return self.loss(torch.sigmoid(self.fc(x)), y)  # AMP003


def model_forward_runs_in_region(x, y):
    model = BceNet()
    with torch.autocast("cuda"):
        return model(x, y)



class DiceBceLoss(nn.Module):
    def forward(self, probs, targets):
        return F.binary_cross_entropy(probs, targets)  # AMP003


class SegmentationTrainer:
    def __init__(self, model):
        self.model = model
        self.criterion = DiceBceLoss()

    def train_step(self, images, masks):
        with torch.autocast("cuda"):
            return self.criterion(torch.sigmoid(self.model(images)), masks)


# ---- negatives --------------------------------------------------------------------


def with_logits_in_autocast(model, x, y):
    with torch.autocast("cuda"):
        return F.binary_cross_entropy_with_logits(model(x), y)


def bce_with_logits_module(model, x, y):
    criterion = nn.BCEWithLogitsLoss()
    with torch.autocast("cuda"):
        return criterion(model(x), y)


def bce_outside_autocast(model, x, y):
    with torch.autocast("cuda"):
        p = torch.sigmoid(model(x))
    return F.binary_cross_entropy(p.float(), y)


def bce_in_disabled_island(model, x, y):
    with torch.autocast("cuda"):
        logits = model(x)
        with torch.autocast("cuda", enabled=False):
            return F.binary_cross_entropy(torch.sigmoid(logits.float()), y)


@torch.autocast("cuda", enabled=False)
def bce_in_disabled_decorated(p, y):
    return F.binary_cross_entropy(p.float(), y)


def plain_fp32_training(model, x, y):
    return F.binary_cross_entropy(torch.sigmoid(model(x)), y)


def variable_named_ctx_is_not_autocast(model, x, y):
    ctx = model.no_sync
    with ctx():
        return F.binary_cross_entropy(model(x), y)


def no_grad_is_not_autocast(model, x, y):
    with torch.no_grad():
        return F.binary_cross_entropy(model(x), y)


def nullcontext_only(model, x, y):
    with contextlib.nullcontext():
        return F.binary_cross_entropy(model(x), y)


def suppress_alias_only(model, x, y):
    amp_ctx = contextlib.suppress
    with amp_ctx():
        return F.binary_cross_entropy(model(x), y)


def partial_of_something_else(model, x, y):
    run = functools.partial(print, end="")
    with open("log.txt") as handle:
        run(handle)
    return F.binary_cross_entropy(model(x), y)


def user_function_named_like_bce(model, x, y):
    def binary_cross_entropy(p, t):
        return (p - t).abs().mean()

    with torch.autocast("cuda"):
        return binary_cross_entropy(model(x), y)


def other_loss_in_autocast(model, x, y):
    with torch.autocast("cuda"):
        return F.mse_loss(model(x), y) + nn.CrossEntropyLoss()(model(x), y)


def bce_defined_in_region_called_later(model, x, y):
    with torch.autocast("cuda"):
        p = model(x)
    criterion = nn.BCELoss()
    return criterion(p.float(), y)


def _bce_helper_mixed(p, y):
    return F.binary_cross_entropy(p, y)


def helper_called_inside_and_outside(model, x, y):
    with torch.autocast("cuda"):
        a = _bce_helper_mixed(model(x), y)
    return a + _bce_helper_mixed(model(x), y)


def other_library_bce(keras_losses, x, y):
    with torch.autocast("cuda"):
        return keras_losses.binary_cross_entropy(x, y)


def string_mentions_only(model, x, y):
    """Don't call F.binary_cross_entropy under torch.autocast; use the logits form."""
    return F.binary_cross_entropy_with_logits(model(x), y)


def get_lock():
    return contextlib.nullcontext()


def factory_function_without_autocast(model, x, y):
    with get_lock():
        return F.binary_cross_entropy(model(x), y)


def null_factory_variable(model, x, y):
    maker = contextlib.nullcontext
    with maker():
        return F.binary_cross_entropy(model(x), y)


class BceNetUsedInFp32(nn.Module):
    def forward(self, x, y):
        return F.binary_cross_entropy(torch.sigmoid(x), y)


def model_forward_outside_region(x, y):
    model = BceNetUsedInFp32()
    with torch.autocast("cuda"):
        features = x * 2
    return model(features.float(), y)


def project_wrapper_turning_autocast_off(model, x, y, disable_autocast):
    with torch.autocast("cuda"):
        logits = model(x)
        with disable_autocast():
            return F.binary_cross_entropy(torch.sigmoid(logits.float()), y)


# ---- contexts passed as arguments: the region is what the call sites pass -----------


def train_step_with_context(model, x, y, amp_ctx):
    with amp_ctx:
        probs = torch.sigmoid(model(x))
        return F.binary_cross_entropy(probs, y)  # AMP003


@torch.no_grad()
def evaluate_with_context(model, x, y, amp_ctx):
    with amp_ctx:
        return F.binary_cross_entropy(torch.sigmoid(model(x)), y)  # AMP003


def run_with_contexts(model, x, y, use_amp):
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if use_amp else nullcontext()
    train_step_with_context(model, x, y, amp_ctx)
    evaluate_with_context(model, x, y, amp_ctx=amp_ctx)


def step_with_any_context(model, x, y, context):
    with context:
        return F.binary_cross_entropy(torch.sigmoid(model(x)), y)


def run_with_lock(model, x, y, lock):
    step_with_any_context(model, x, y, lock)


class BceHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.loss = nn.BCELoss()

    def forward(self, probs, targets):
        return self.loss(probs, targets)  # AMP003


def head_moved_to_device_called_under_autocast(probs, targets, device):
    head = BceHead().to(device)
    with torch.autocast("cuda"):
        return head(probs, targets)


# ---- found in public projects: autocast that a parameter turns on, off by default ---
class MaskedBCELoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.loss_f = nn.BCELoss(reduction="none")

    def forward(self, probs, labels, enable_autocast=False):
        with torch.cuda.amp.autocast(enabled=enable_autocast):
            return self.loss_f(probs, labels).mean()


def bce_with_switch(probs, labels, use_amp=False):
    with torch.autocast("cuda", enabled=use_amp):
        return F.binary_cross_entropy(probs, labels)  # AMP003


def caller_turns_it_on(probs, labels):
    return bce_with_switch(probs, labels, use_amp=True)


# ---- BCE two wrappers deep, built by a method; training under autocast, validation after -----
class DiceAndBCELoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.ce = nn.BCELoss()

    def forward(self, net_output, target):
        return self.ce(torch.sigmoid(net_output), target.float())  # AMP003


class DeepSupervision(nn.Module):
    def __init__(self, loss, weights):
        super().__init__()
        self.loss, self.weights = loss, weights

    def forward(self, *args):
        return sum([self.weights[i] * self.loss(*inputs) for i, inputs in enumerate(zip(*args))])


class SegTrainer:
    def __init__(self, network, optimizer):
        self.network, self.optimizer = network, optimizer
        self.loss = None

    def initialize(self):
        self.loss = self._build_loss()

    def _build_loss(self):
        return DeepSupervision(DiceAndBCELoss(), [1.0, 0.5])

    def train_step(self, data, target):
        with torch.autocast("cuda", dtype=torch.float16):
            output = self.network(data)
            loss = self.loss(output, target)
        loss.backward()
        self.optimizer.step()

    @torch.no_grad()
    def validation_step(self, data, target):
        with torch.autocast("cuda", dtype=torch.float16):
            output = self.network(data)
        return self.loss([o.float() for o in output], target)


# ---- a loss object whose __call__ runs under its callers' autocast ------------------------
class ComputeObjectnessLoss:
    def __init__(self):
        self.bce_obj = nn.BCELoss()

    def __call__(self, preds, targets):
        return self.bce_obj(preds[..., 4].sigmoid(), targets)  # AMP003


class ComputeObjectnessLogitLoss:
    def __init__(self):
        self.bce_obj = nn.BCEWithLogitsLoss()

    def __call__(self, preds, targets):
        return self.bce_obj(preds[..., 4], targets)


def train_detector(model, loader, optimizer):
    compute_loss = ComputeObjectnessLoss()
    compute_logit_loss = ComputeObjectnessLogitLoss()
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            preds = model(images)
            loss = compute_loss(preds, targets) + compute_logit_loss(preds, targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
