# AMP004 low-precision-reduce: a reduction over a tensor known to be fp16/bf16.
import math
import statistics
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ctx = nullcontext() if torch.cuda.is_available() else torch.amp.autocast(device_type="cuda", dtype=torch.float16)


# ---- positives --------------------------------------------------------------------


def mean_of_half_cast(x):
    x = x.half()
    return x.mean()  # AMP004


def sum_of_fp16_factory(n):
    h = torch.randn(n, n, dtype=torch.float16)
    return torch.sum(h)  # AMP004


def cuda_autocast_mean_of_matmul(x, w):
    with torch.autocast("cuda", dtype=torch.float16):
        h = x @ w
        return h.mean()  # AMP004


def cuda_autocast_var_and_std(x, w):
    with torch.autocast("cuda"):
        h = torch.matmul(x, w)
        return h.var(dim=-1) + h.std(dim=-1)  # AMP004


def cpu_fp16_autocast_sum(x, w):
    with torch.autocast("cpu", dtype=torch.float16):
        h = F.linear(x, w)
        return h.sum()  # AMP004


def cpu_bf16_autocast_cumsum(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.mm(x, w)
        return h.cumsum(0)  # AMP004


def bf16_cast_then_norm(x):
    """bf16 chosen here: fp32's range, reductions accumulated in fp32."""
    y = x.to(torch.bfloat16)
    return y.norm()


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        with torch.autocast("cuda"):
            y = self.proj(x)
            return y.var()  # AMP004


def arithmetic_keeps_low(x, w):
    with torch.autocast("cuda"):
        h = x @ w
        return (h * 2 + 1).mean()  # AMP004


def torch_mean_function(x, w):
    with torch.autocast("cuda"):
        h = torch.bmm(x, w)
        return torch.mean(h)  # AMP004


def view_preserves_dtype(x, w):
    with torch.autocast("cuda"):
        h = x @ w
        return h.view(-1).std()  # AMP004


def chained_half_sum(x):
    return x.half().sum()  # AMP004


def bf16_zeros_cumsum(n):
    return torch.zeros(n, dtype=torch.bfloat16).cumsum(0)  # AMP004


def half_tensor_type_prod(x):
    return x.type(torch.HalfTensor).prod()  # AMP004


def unknown_device_region(x, w, device):
    with torch.autocast(device_type=device):
        h = x @ w
        return h.mean()  # AMP004


def bfloat16_method_mean(x):
    return x.bfloat16().mean(dim=-1)


def float16_method_mean(x):
    return x.half().mean(dim=-1)  # AMP004


def used_after_region(x, w):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = x @ w
    return h.mean()  # AMP004


def conditional_context_counts_as_on(x, w):
    with ctx:
        h = x @ w
        return h.mean()  # AMP004


def flag_enabled_region(x, w, use_amp):
    with torch.autocast("cuda", enabled=use_amp):
        h = x @ w
        return h.var(dim=-1)  # AMP004


# ---- negatives --------------------------------------------------------------------


def cuda_autocast_sum_is_fp32(x, w):
    with torch.autocast("cuda"):
        h = x @ w
        return h.sum()


def cuda_autocast_norm_cumsum_prod(x, w):
    with torch.autocast("cuda"):
        h = x @ w
        return h.norm(), h.cumsum(0), h.prod()


def exp_runs_in_fp32(x, w):
    with torch.autocast("cuda"):
        h = x @ w
        return torch.exp(h).mean()


def pow_runs_in_fp32(x, w):
    with torch.autocast("cuda"):
        h = x @ w
        return h.pow(2).mean()


def upcast_before_reduce(x):
    h = x.half()
    return h.float().mean()


def explicit_accumulator_dtype(x):
    h = x.half()
    return h.mean(dtype=torch.float32) + h.sum(dtype=torch.float32)


def rmsnorm_idiom(x, weight, eps=1e-6):
    norm = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(norm + eps)).to(x.dtype) * weight


def model_output_is_unknown(model, x):
    logits = model(x)
    return logits.mean()


def fp32_tensors(n):
    return torch.randn(n).mean() + torch.ones(n).sum()


def numpy_reductions(arr):
    return np.sum(arr) + arr.astype(np.float16).sum()


def builtin_sum(losses):
    return sum(losses) / len(losses)


def cpu_autocast_prod_is_fp32(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ w
        return h.prod()


def disabled_island_fp32(x, w):
    with torch.autocast("cuda"):
        with torch.autocast("cuda", enabled=False):
            h = x.float() @ w.float()
            return h.mean()


def upcast_after_region(x, w):
    with torch.autocast("cuda"):
        h = x @ w
    return h.float().mean()


def integer_tensors(x):
    return x.long().sum() + x.half().long().sum()


def round_trip_then_mean(x):
    return x.half().float().mean()


def loss_is_fp32_under_cuda_autocast(model, x, y):
    with torch.autocast("cuda"):
        loss = F.cross_entropy(x @ model.weight, y, reduction="none")
        return loss.mean()


def stdlib_reductions(values):
    return math.prod(values) + statistics.mean(values)


def reassigned_to_fp32(x):
    h = x.half()
    h = h.float()
    return h.mean()


@torch.no_grad()
def evaluate_in_half(model, x):
    scores = x.half() @ model.weight.half().t()
    return scores.mean()


def predict_probabilities(x):
    h = x.half()
    return h.softmax(-1).sum(-1)


# ---- found in public projects: bf16 chosen on purpose --------------------------------
def newton_schulz(grad, steps=5, eps=1e-7):
    """Orthogonalises an update in bf16 by design (the Muon optimizer)."""
    x = grad.reshape(-1, grad.size(-1)).bfloat16()
    x /= x.norm(dim=(-2, -1), keepdim=True) + eps
    for _ in range(steps):
        a = x @ x.transpose(-2, -1)
        x = 3.4445 * x - 4.7750 * a @ x
    return x


def zeropower_via_newton_schulz(grad, eps=1e-7):
    """torch.optim's Muon: the bf16 cast is transposed before it is normalised."""
    ortho = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    return ortho


def fp16_cast_transposed_norm(grad):
    ortho = grad.half()
    if grad.size(0) > grad.size(1):
        ortho = ortho.mT
    return grad / ortho.norm()  # AMP004


def autocast_bf16_mean(x, weight):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = F.linear(x, weight)
        return h.mean()  # AMP004


# ---- objects of this module's classes, through type hints or construction -------------
class Whitening(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 64)


def whitened_views(model: Whitening, v1):
    with torch.autocast("cuda", dtype=torch.float16):
        z = model.head(v1)
        return (z - z.mean(0)) / z.float().std(0)  # AMP004


def whitened_views_fp32(model: Whitening, v1):
    with torch.autocast("cuda", dtype=torch.float16):
        z = model.head(v1).float()
        return (z - z.mean(0)) / z.std(0)


class Projector(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)


def replaced_projection(v1):
    """Assigned from outside its class: what ``model.proj`` holds is no longer known."""
    model = Projector()
    model.proj = nn.Identity()
    with torch.autocast("cuda", dtype=torch.float16):
        z = model.proj(v1)
        return z.mean(0)


# ---- buffers registered by name ----------------------------------------------------------
class HalfMemoryBank(nn.Module):
    def __init__(self, size, dim):
        super().__init__()
        self.register_buffer("bank", torch.zeros(size, dim, dtype=torch.float16))

    def forward(self, x):
        return x - self.bank.mean(0)  # AMP004


class Fp32MemoryBank(nn.Module):
    def __init__(self, size, dim):
        super().__init__()
        self.register_buffer("bank", torch.zeros(size, dim))

    def forward(self, x):
        return x - self.bank.mean(0)


class HalfMemoryBankStats(nn.Module):
    """A statistic of training state under no_grad is still computed in fp16."""

    def __init__(self, size, dim):
        super().__init__()
        self.register_buffer("bank", torch.zeros(size, dim, dtype=torch.float16))

    @torch.no_grad()
    def bank_norm(self):
        return self.bank.norm(dim=1).mean().item()  # AMP004


# ---- a parameter's dtype is what every call site in the module passes ---------------------
class MinibatchStdDev(nn.Module):
    def forward(self, x):
        y = x.view(4, -1, *x.shape[1:])
        y = torch.sqrt(y.var(0, unbiased=False) + 1e-4)  # AMP004
        return torch.cat([x, y.mean([1, 2, 3], keepdim=True).expand_as(x[:, :1])], 1)  # AMP004


class StdDevDiscriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 3)
        self.mbstd = MinibatchStdDev()

    def forward(self, img):
        return self.mbstd(self.conv(img))


def discriminator_step(img, optimizer):
    disc = StdDevDiscriminator()
    with torch.autocast("cuda", dtype=torch.float16):
        score = disc(img).flatten(1).sum(1)
    score.float().mean().backward()
    optimizer.step()


def standardise(x):
    return (x - x.mean()) / x.std()


def standardise_callers(model, batch, optimizer):
    normed_input = standardise(batch.float())
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(normed_input)
    standardise(out.float()).pow(2).mean().backward()
    optimizer.step()


class FocalLoss(nn.Module):
    def forward(self, logits, targets):
        bce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        return ((1 - torch.exp(-bce)) ** 2 * bce).mean()


def focal_loss_after_the_block(model, images, labels, optimizer):
    criterion = FocalLoss()
    head = nn.Linear(512, 10)
    with torch.autocast("cuda", dtype=torch.float16):
        logits = head(model(images))
    # the call is AMP002; AMP004 inside FocalLoss would say it again
    loss = criterion(logits, labels)  # AMP002
    loss.backward()
    optimizer.step()


# ---- a training function whose name also names what it trains (a predictor) -------------
def train_predictor(generator, critic, z, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        fake = generator(z)
        scores = torch.nn.functional.linear(fake, critic)
        loss = -scores.mean()  # AMP004
    scaler.scale(loss.float()).backward()
    scaler.step(optimizer)
    scaler.update()


def generate_samples(generator, z, critic):
    with torch.autocast("cuda", dtype=torch.float16):
        scores = torch.nn.functional.linear(generator(z), critic)
        return scores.mean()


def test_fp16_scores_in_training_mode(generator, critic, z):
    with torch.autocast("cuda", dtype=torch.float16):
        scores = torch.nn.functional.linear(generator(z), critic)
        assert torch.isfinite(scores.mean())


def train_log_space_scan(x, optimizer):
    proj = torch.nn.Linear(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log_h = torch.logcumsumexp(proj(x), dim=1)
        energy = log_h.exp().pow(2).mean()  # AMP004
    energy.float().backward()
    optimizer.step()
