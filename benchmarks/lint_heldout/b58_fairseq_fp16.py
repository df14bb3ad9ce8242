"""fairseq-style split of the training step: task -> criterion -> optimizer wrapper.

* ``FP16Optimizer``: pure fp16 model, fp32 master copies, fairseq's own
  ``DynamicLossScaler`` (no torch GradScaler involved).
* ``AMPOptimizer``: fp32 model under autocast, torch GradScaler.
* ``NativeFP16Optimizer``: the in-house variant that clips inside ``step``.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=None, reduce=True):
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    if ignore_index is not None:
        pad_mask = target.eq(ignore_index)
        nll_loss.masked_fill_(pad_mask, 0.0)
        smooth_loss.masked_fill_(pad_mask, 0.0)
    if reduce:
        nll_loss = nll_loss.sum()
        smooth_loss = smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = dropout

    def forward(self, x, key_padding_mask=None, attn_mask=None):
        tgt_len, bsz, embed_dim = x.size()
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q = (q * self.scaling).contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights = attn_weights.masked_fill(attn_mask.unsqueeze(0), -1e8)  # expect: AMP007
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, -1)
            attn_weights = attn_weights.masked_fill(key_padding_mask[:, None, None, :].to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, -1)
        attn_probs = F.softmax(attn_weights.float(), dim=-1).type_as(attn_weights)
        attn_probs = F.dropout(attn_probs, p=self.dropout, training=self.training)
        attn = torch.bmm(attn_probs, v).transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, dim, heads, ffn_dim):
        super().__init__()
        self.self_attn = MultiheadAttention(dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x, key_padding_mask, future_mask):
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_padding_mask, future_mask)
        return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))


class TransformerLanguageModel(nn.Module):
    def __init__(self, vocab_size, dim=512, heads=8, layers=6, padding_idx=1):
        super().__init__()
        self.padding_idx = padding_idx
        self.embed_tokens = nn.Embedding(vocab_size, dim, padding_idx=padding_idx)
        self.embed_scale = math.sqrt(dim)
        self.layers = nn.ModuleList(TransformerDecoderLayer(dim, heads, 4 * dim) for _ in range(layers))
        self.layer_norm = nn.LayerNorm(dim)
        self.output_projection = nn.Linear(dim, vocab_size, bias=False)
        self.num_updates = 0

    def set_num_updates(self, num_updates):
        self.num_updates = num_updates

    def forward(self, src_tokens, src_lengths=None):
        x = self.embed_scale * self.embed_tokens(src_tokens).transpose(0, 1)
        key_padding_mask = src_tokens.eq(self.padding_idx)
        t = src_tokens.size(1)
        future_mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=src_tokens.device), 1)
        for layer in self.layers:
            x = layer(x, key_padding_mask, future_mask)
        return self.output_projection(self.layer_norm(x).transpose(0, 1)), {"padding_mask": key_padding_mask}

    def get_normalized_probs(self, net_output, log_probs):
        logits = net_output[0]
        return F.log_softmax(logits.float(), dim=-1) if log_probs else F.softmax(logits.float(), dim=-1)


class LabelSmoothedCrossEntropyCriterion(nn.Module):
    def __init__(self, padding_idx, label_smoothing=0.1):
        super().__init__()
        self.padding_idx = padding_idx
        self.eps = label_smoothing

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        target = sample["target"]
        loss, nll_loss = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), target.view(-1), self.eps,
                                                 ignore_index=self.padding_idx, reduce=reduce)
        sample_size = sample["ntokens"]
        logging_output = {"loss": loss.data, "nll_loss": nll_loss.data, "ntokens": sample["ntokens"], "sample_size": sample_size}
        return loss, sample_size, logging_output


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
                raise FloatingPointError("Minimum loss scale reached ({}).".format(self.min_loss_scale))
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))


class FairseqOptimizer:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def backward(self, loss):
        loss.backward()

    def multiply_grads(self, c):
        for p in self.params:
            if p.grad is not None:
                p.grad.data.mul_(c)

    def clip_grad_norm(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


class FP16Optimizer(FairseqOptimizer):
    def __init__(self, cfg, fp16_params, fp32_optimizer, fp32_params):
        super().__init__(fp32_optimizer)
        self.fp16_params = fp16_params
        self.fp32_params = fp32_params
        self.scaler = DynamicLossScaler(init_scale=cfg["fp16_init_scale"], scale_window=cfg["fp16_scale_window"])

    @classmethod
    def build_optimizer(cls, cfg, params):
        fp32_params = [p.detach().clone().float().requires_grad_(True) for p in params]
        fp32_optimizer = torch.optim.Adam(fp32_params, lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-8)
        return cls(cfg, params, fp32_optimizer, fp32_params)

    def backward(self, loss):
        loss = self.scaler.scale(loss)
        loss.backward()

    def _sync_and_unscale(self):
        for p16, p32 in zip(self.fp16_params, self.fp32_params):
            if p16.grad is not None:
                p32.grad = p16.grad.float() / self.scaler.loss_scale

    def clip_grad_norm(self, max_norm):
        self._sync_and_unscale()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.fp32_params, max_norm)
        self.scaler.check_overflow(grad_norm)
        return grad_norm

    def step(self):
        self.optimizer.step()
        self.scaler.update()
        with torch.no_grad():
            for p16, p32 in zip(self.fp16_params, self.fp32_params):
                p16.copy_(p32)

    def zero_grad(self):
        for p in self.fp16_params:
            p.grad = None
        for p in self.fp32_params:
            p.grad = None


class AMPOptimizer(FairseqOptimizer):
    def __init__(self, cfg, fp32_optimizer):
        super().__init__(fp32_optimizer)
        self._grad_scaler = torch.amp.GradScaler("cuda", init_scale=cfg["fp16_init_scale"], growth_interval=cfg["fp16_scale_window"])
        self.min_loss_scale = cfg["min_loss_scale"]

    @classmethod
    def build_optimizer(cls, cfg, params):
        return cls(cfg, torch.optim.Adam(params, lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-8))

    def backward(self, loss):
        self._grad_scaler.scale(loss).backward()

    def clip_grad_norm(self, max_norm):
        self._grad_scaler.unscale_(self.optimizer)
        grad_norm = super().clip_grad_norm(max_norm)
        if not torch.isfinite(grad_norm).all() and self._grad_scaler.get_scale() <= self.min_loss_scale:
            raise FloatingPointError("AMP: minimum loss scale reached")
        return grad_norm

    def step(self):
        self._grad_scaler.step(self.optimizer)
        self._grad_scaler.update()


class NativeFP16Optimizer:
    """In-house GradScaler wrapper: clips inside step() so the norm is taken once per update."""

    def __init__(self, cfg, params, optimizer):
        self.params = list(params)
        self.optimizer = optimizer
        self.scaler = torch.amp.GradScaler("cuda", init_scale=cfg["fp16_init_scale"], growth_interval=cfg["fp16_scale_window"])

    @classmethod
    def build_optimizer(cls, cfg, params):
        params = list(params)
        return cls(cfg, params, torch.optim.Adam(params, lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-8))

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def multiply_grads(self, c):
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(c)

    def step(self, max_norm=0.0):
        grad_norm = None
        if max_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return grad_norm

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


class LanguageModelingTask:
    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        model.train()
        model.set_num_updates(update_num)
        with torch.autograd.profiler.record_function("forward"):
            with torch.cuda.amp.autocast(enabled=isinstance(optimizer, (AMPOptimizer, NativeFP16Optimizer))):  # expect: AMP009
                loss, sample_size, logging_output = criterion(model, sample)
        if ignore_grad:
            loss *= 0
        with torch.autograd.profiler.record_function("backward"):
            optimizer.backward(loss)
        return loss, sample_size, logging_output

    def valid_step(self, sample, model, criterion):
        model.eval()
        with torch.no_grad():
            loss, sample_size, logging_output = criterion(model, sample)
        return loss, sample_size, logging_output

    def optimizer_step(self, optimizer, model, update_num):
        optimizer.step()


class Trainer:
    def __init__(self, cfg, task, model, criterion):
        self.cfg = cfg
        self.task = task
        if cfg["fp16"] and not cfg["amp"]:
            model = model.half()
        elif cfg["bf16"] and not cfg["amp"]:
            model = model.to(dtype=torch.bfloat16)
        self.model = model.cuda()
        self.criterion = criterion.cuda()
        self.num_updates = 0
        self.best_loss = 1e9
        self._optimizer = None

    @property
    def optimizer(self):
        if self._optimizer is None:
            self._build_optimizer()
        return self._optimizer

    def _build_optimizer(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.cfg["amp"]:
            opt_cls = NativeFP16Optimizer if self.cfg["clip_in_step"] else AMPOptimizer
            self._optimizer = opt_cls.build_optimizer(self.cfg, params)
        elif self.cfg["fp16"]:
            self._optimizer = FP16Optimizer.build_optimizer(self.cfg, params)
        else:
            self._optimizer = FairseqOptimizer(torch.optim.Adam(params, lr=self.cfg["lr"], betas=(0.9, 0.98), eps=1e-8))

    def train_step(self, samples):
        self.model.train()
        self.criterion.train()
        self.optimizer.zero_grad()
        logging_outputs, sample_size = [], 0
        for sample in samples:
            loss, sample_size_i, logging_output = self.task.train_step(sample, self.model, self.criterion, self.optimizer, self.num_updates)
            logging_outputs.append(logging_output)
            sample_size += sample_size_i
        self.optimizer.multiply_grads(1.0 / float(sample_size))
        try:
            if isinstance(self.optimizer, NativeFP16Optimizer):
                grad_norm = self.optimizer.step(max_norm=self.cfg["clip_norm"])
            else:
                grad_norm = self.optimizer.clip_grad_norm(self.cfg["clip_norm"])
                self.task.optimizer_step(self.optimizer, model=self.model, update_num=self.num_updates)
        except OverflowError:
            self.optimizer.zero_grad()
            return None
        self.num_updates += 1
        self.model.set_num_updates(self.num_updates)
        return {"grad_norm": grad_norm, "logging_outputs": logging_outputs}

    def save_checkpoint(self, path):
        state = {"model": {k: v.half() for k, v in self.model.state_dict().items()}, "num_updates": self.num_updates}
        torch.save(state, path)
