"""AMP011 tiny-epsilon: epsilons below fp16's smallest subnormal (5.96e-8) on fp16 values."""
import copy
import itertools

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import AdamW

EPS = 1e-10
SAFE_EPS = 1e-6


# ---------------------------------------------------------------- positives


def log_of_probs(n):
    probs = torch.rand(n, dtype=torch.float16)
    return torch.log(probs + 1e-8)  # AMP011


def divide_by_norm(n):
    x = torch.randn(n, dtype=torch.float16)
    norm = torch.ones(n, dtype=torch.float16)
    return x / (norm + 1e-10)  # AMP011


def clamp_guard(n):
    probs = torch.rand(n, dtype=torch.half)
    return probs.clamp(min=1e-8).log()  # AMP011


def torch_clamp_guard(n):
    probs = torch.rand(n, dtype=torch.float16)
    return torch.log(torch.clamp(probs, min=1e-12))  # AMP011


def clamp_min_guard(n):
    probs = torch.rand(n, dtype=torch.float16)
    return torch.log(probs.clamp_min(1e-9))  # AMP011


def sqrt_guard(n):
    var = torch.rand(n, dtype=torch.float16)
    return torch.sqrt(var + 1e-10)  # AMP011


def add_method(n):
    x = torch.rand(n, dtype=torch.float16)
    return x.add(1e-8)  # AMP011


def add_inplace(n):
    x = torch.rand(n, dtype=torch.float16)
    x.add_(1e-8)  # AMP011
    return x


def local_epsilon(n):
    eps = 1e-8
    x = torch.rand(n, dtype=torch.float16)
    return 1.0 / (x + eps)  # AMP011


def module_epsilon(n):
    x = torch.rand(n, dtype=torch.float16)
    return torch.log(x + EPS)  # AMP011


def reversed_operands(n):
    x = torch.rand(n, dtype=torch.float16)
    return torch.log(1e-8 + x)  # AMP011


def adam_default_over_half_model(model_cls):
    model = model_cls().half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # AMP011
    return model, optimizer


def adamw_explicit_eps(model):
    model.half()
    return AdamW(model.parameters(), lr=1e-4, eps=1e-8)  # AMP011


def adam_tiny_eps_after_to(model):
    model = model.to(torch.float16)
    return torch.optim.Adam(model.parameters(), eps=1e-10)  # AMP011


def half_behind_a_flag(model, args):
    if args.fp16:
        model.half()
    model.to(args.device)
    return torch.optim.Adam(model.parameters())  # AMP011


def rmsprop_default(model):
    model.half()
    return torch.optim.RMSprop(model.parameters(), lr=1e-3)  # AMP011


def adam_over_trainable_parameters(model):
    model = model.cuda().half()
    trainable = [p for p in model.parameters() if p.requires_grad]
    first = torch.optim.AdamW(trainable, lr=1e-4)  # AMP011
    second = torch.optim.Adam(  # AMP011
        filter(lambda p: p.requires_grad, model.parameters())
    )
    return first, second


# ---------------------------------------------------------------- negatives


def representable_epsilon(n):
    probs = torch.rand(n, dtype=torch.float16)
    return torch.log(probs + 1e-6)


def module_safe_epsilon(n):
    probs = torch.rand(n, dtype=torch.float16)
    return torch.log(probs + SAFE_EPS)


def fp32_values(n):
    probs = torch.rand(n)
    return torch.log(probs + 1e-8)


def explicit_upcast(n):
    probs = torch.rand(n, dtype=torch.float16)
    return torch.log(probs.float() + 1e-8)


def unknown_dtype(probs):
    return torch.log(probs + 1e-8)


def bf16_values(n):
    probs = torch.rand(n, dtype=torch.bfloat16)
    return torch.log(probs + 1e-8)


def adam_over_fp32_model(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)


def adam_representable_eps(model):
    model.half()
    return torch.optim.Adam(model.parameters(), eps=1e-4)


def adam_over_fp32_master_params(model):
    model.half()
    master = [p.detach().clone().float() for p in model.parameters()]
    return torch.optim.Adam(master, lr=1e-3)


def export_half(model, path):
    torch.save(model.half().state_dict(), path)


def compacted_after_training(model, loader):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for batch in loader:
        model(batch).backward()
        optimizer.step()
    model.half()
    torch.save(model.state_dict(), "model_fp16.pt")


def half_export_undone_before_optimizer(model, example):
    model.half()
    torch.onnx.export(model, example.half(), "model.onnx")
    model.float()
    return torch.optim.AdamW(model.parameters(), eps=1e-8)


def adam_in_other_function(model):
    return torch.optim.Adam(model.parameters())


def finfo_epsilon(n):
    x = torch.rand(n, dtype=torch.float16)
    return torch.log(x + torch.finfo(x.dtype).tiny)


def tiny_learning_rate(model):
    return torch.optim.Adam(model.parameters(), lr=1e-8)


def python_numbers(total, count):
    return total / (count + 1e-8)


def numpy_values(arr):
    return np.log(np.asarray(arr, dtype=np.float16) + 1e-8)


def scaling_is_not_an_epsilon(n):
    x = torch.rand(n, dtype=torch.float16)
    return x * 1e-8


def layer_norm_eps(x):
    return F.layer_norm(x, x.shape[-1:], eps=1e-12)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16, eps=1e-12)

    def forward(self, x):
        return self.norm(x) / (x.std() + 1e-8)


def bf16_model_adam(model):
    model = model.bfloat16()
    return torch.optim.Adam(model.parameters(), lr=1e-3)


# ---- flag-enabled regions, Python numbers by name ------------------------------------


class ScorerWithAmpSwitch(nn.Module):
    def __init__(self, dim, use_amp):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.use_amp = use_amp

    def forward(self, x):
        with torch.autocast("cuda", enabled=self.use_amp):
            h = self.proj(x)
            return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)  # AMP011


def tempered_log_probs(scores, temperature=0.05):
    probs = (scores.half() / temperature).softmax(dim=-1)
    return torch.log(probs + 1e-10)  # AMP011


def tempered_log_probs_fp32(scores, temperature=0.05):
    probs = (scores.half().float() / temperature).softmax(dim=-1)
    return torch.log(probs + 1e-10)


def norm_under_switch_is_fp32(x, w, use_amp):
    with torch.autocast("cuda", enabled=use_amp):
        h = x @ w
        return h / (h.norm(dim=-1, keepdim=True) + 1e-8)


def normalize_half_index(emb):
    return F.normalize(emb.half(), dim=-1)  # AMP011


def normalize_half_with_eps(emb):
    return F.normalize(emb.half(), dim=-1, eps=1e-12)  # AMP011


def normalize_half_under_cuda_autocast(x, w):
    with torch.autocast("cuda"):
        return F.normalize(x @ w, dim=-1)


def normalize_half_safe_eps(emb):
    return F.normalize(emb.half(), dim=-1, eps=1e-4)


def build_half_model(dim):
    return nn.Linear(dim, dim).cuda().half()


def optimizer_over_model_built_half(dim):
    model = build_half_model(dim)
    return torch.optim.AdamW(model.parameters(), lr=1e-4)  # AMP011


class TemperedSoftmax(nn.Module):
    def __init__(self, temperature=1.0):
        super().__init__()
        self.temperature = temperature

    def forward(self, logits):
        z = logits.half() / self.temperature
        return z.exp() / (z.exp().sum(dim=-1, keepdim=True) + 1e-10)  # AMP011


def scaled_by_width(x):
    B, N, C = x.shape
    h = x.half() * C ** -0.5
    return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)  # AMP011


def scaled_by_fp32_tensor(x, weight):
    h = x.half() * weight.float()
    return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)


class HalfTrainer:
    def __init__(self, model):
        self.model = model.half()

    def build_optimizer(self):
        return torch.optim.Adam(self.model.parameters(), lr=1e-3)  # AMP011


class RestoredTrainer:
    def __init__(self, model):
        self.model = model.half()

    def restore_fp32(self):
        self.model = self.model.float()

    def build_optimizer(self):
        return torch.optim.Adam(self.model.parameters(), lr=1e-3)


# ---- buffers and parameters registered by name: ``self.<name>`` is the registered value ----
class HalfNegativeQueue(nn.Module):
    def __init__(self, dim, size):
        super().__init__()
        self.register_buffer("queue", torch.randn(dim, size, dtype=torch.float16))
        self.queue = F.normalize(self.queue, dim=0)  # AMP011


class HalfRegisteredScale(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_parameter("scale", nn.Parameter(torch.ones(dim, dtype=torch.half)))

    def forward(self, x):
        return x.half() / (self.scale + 1e-8)  # AMP011


class HalfBufferByKeyword(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer(name="running_var", tensor=torch.ones(dim, dtype=torch.float16))

    def forward(self, x):
        return x / torch.sqrt(self.running_var + 1e-10)  # AMP011


class Fp32NegativeQueue(nn.Module):
    """Registered fp32; a later ``model.half()`` is not followed into the buffer."""

    def __init__(self, dim, size):
        super().__init__()
        self.register_buffer("queue", torch.randn(dim, size))
        self.queue = F.normalize(self.queue, dim=0)


class HalfQueueNormalizedInFp32(nn.Module):
    def __init__(self, dim, size):
        super().__init__()
        self.register_buffer("queue", torch.randn(dim, size, dtype=torch.float16))
        self.queue = F.normalize(self.queue.float(), dim=0)


class HalfQueueSafeEps(nn.Module):
    def __init__(self, dim, size):
        super().__init__()
        self.register_buffer("queue", torch.randn(dim, size, dtype=torch.float16))
        self.queue = F.normalize(self.queue, dim=0, eps=1e-4)


class QueueRegisteredTwice(nn.Module):
    """Registered fp16 in one method and fp32 in another: its dtype is not known."""

    def __init__(self, dim, size):
        super().__init__()
        self.register_buffer("queue", torch.randn(dim, size, dtype=torch.float16))

    def reset(self, dim, size):
        self.register_buffer("queue", torch.randn(dim, size))

    def scores(self, q):
        return q @ self.queue / (self.queue.norm() + 1e-8)


class HalfOffset(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("offset", torch.zeros(dim, dtype=torch.float16))


def offset_replaced_from_outside(dim, x):
    """Registered again from outside (fp32): what ``model.offset`` holds is not known."""
    model = HalfOffset(dim)
    model.register_buffer("offset", torch.zeros(dim))
    return x / (model.offset + 1e-8)


# ---- the modules an optimizer steps: names, chains, param groups --------------------------
def adamw_over_param_groups(model, weight_decay):
    model.half()
    no_decay = ("bias", "LayerNorm.weight")
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)]},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(grouped, lr=1e-4, eps=1e-8)  # AMP011


def adamw_over_input_embeddings(text_encoder, device):
    text_encoder.to(device, dtype=torch.float16)
    params = text_encoder.get_input_embeddings().parameters()
    return torch.optim.AdamW(params, lr=5e-4, eps=1e-08)  # AMP011


def adam_over_head_by_keyword(model):
    model.half()
    return torch.optim.Adam(params=model.head.parameters(), lr=1e-3)  # AMP011


def adam_over_chained_modules(encoder, decoder):
    encoder.half()
    decoder.half()
    return torch.optim.Adam(itertools.chain(encoder.parameters(), decoder.parameters()))  # AMP011


def adam_over_dict_group(model):
    model = model.half()
    return torch.optim.Adam([dict(params=model.parameters(), lr=1e-4)])  # AMP011


def adamw_over_fp32_master_copies(model):
    model.half()
    master = [p.detach().clone().float() for p in model.parameters()]
    return torch.optim.AdamW(master, lr=1e-4, eps=1e-8)


def adamw_after_the_model_is_restored(model):
    model.half()
    model.float()
    grouped = [{"params": [p for n, p in model.named_parameters()]}]
    return torch.optim.AdamW(grouped, eps=1e-8)


def adam_over_head_restored_to_fp32(model):
    model.half()
    model.head.float()
    return torch.optim.Adam(model.head.parameters())


def adam_beside_a_half_export_copy(model):
    exported = copy.deepcopy(model).half()
    optimizer = torch.optim.Adam(model.parameters())
    return exported, optimizer


def adam_over_student_beside_half_teacher(teacher, student):
    teacher.half()
    return torch.optim.Adam([p for p in student.parameters() if p.requires_grad])


def adamw_over_bf16_groups(model):
    model.bfloat16()
    grouped = [{"params": [p for n, p in model.named_parameters()], "weight_decay": 0.01}]
    return torch.optim.AdamW(grouped, lr=1e-4, eps=1e-8)


def adam_wrapped_for_fp32_master_weights(model, FP16_Optimizer):
    model.half()
    optimizer = torch.optim.Adam(model.parameters())
    return FP16_Optimizer(optimizer, dynamic_loss_scale=True)


def adam_over_fp16_body_and_fp32_head(model, head, half_weights):
    """The head's dtype is not known: not every stepped parameter is known to be fp16."""
    if half_weights:
        model = model.half()
    params = list(model.parameters()) + list(head.parameters())
    return torch.optim.AdamW(params, lr=1e-4)


def adam_over_fp32_parameters_picked_by_dtype(model):
    model.half()
    fp32 = [p for p in model.parameters() if p.dtype == torch.float32]
    return torch.optim.Adam(fp32, eps=1e-8)
