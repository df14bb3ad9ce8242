"""AMP007 fp16-overflow-literal: fills beyond +-65504 on tensors that can be fp16."""
import math

import numpy as np
import torch
import torch.nn as nn

NEG_INF = -1e9
SAFE_NEG = -1e4


# ---------------------------------------------------------------- positives


def attention(query, key, value, mask=None):
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)  # AMP007
    return torch.matmul(scores.softmax(dim=-1), value)


class SelfAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1)
        scores.masked_fill_(~mask, -1e8)  # AMP007
        return scores.softmax(-1) @ v



class AttributeConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.mask_value = -1e9

    def forward(self, scores, mask):
        return scores.masked_fill(mask, self.mask_value)  # AMP007


def with_float_call(scores, mask):
    return scores.masked_fill(mask == 0, float(-1e9))  # AMP007


def hard_coded_fp32_finfo(scores, mask):
    return scores.masked_fill(mask, torch.finfo(torch.float32).min)  # AMP007


def fill_under_autocast(model, tokens, pad_mask):
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(tokens)
        logits = logits.masked_fill(pad_mask, -1e9)  # AMP007
    return logits


def with_module_constant(scores, mask):
    return scores.masked_fill(mask, NEG_INF)  # AMP007


def with_local_constant(scores, mask):
    big_negative = -1e10
    return scores.masked_fill(mask, big_negative)  # AMP007


def with_where(scores, mask):
    return torch.where(mask, scores, -1e9)  # AMP007


def with_subscript(scores, mask):
    scores[mask] = -1e9  # AMP007
    return scores


def with_fill(attn_bias):
    attn_bias.fill_(-1e9)  # AMP007
    return attn_bias


def with_full_like(scores):
    return torch.full_like(scores, -1e9)  # AMP007


def with_new_full(scores):
    return scores.new_full(scores.shape, -1e9)  # AMP007


def with_keyword_value(scores, mask):
    return scores.masked_fill(mask=mask, value=-1e9)  # AMP007


def with_power_literal(scores, mask):
    return scores.masked_fill(mask, -2 ** 32 + 1)  # AMP007


def with_positive_overflow(logits, mask):
    return logits.masked_fill(mask, 1e5)  # AMP007


def fill_known_fp16(n, mask):
    buf = torch.zeros(n, dtype=torch.float16)
    buf.masked_fill_(mask, -1e9)  # AMP007
    return buf


def similarity_diagonal(embeddings):
    with torch.autocast("cuda"):
        sim = embeddings @ embeddings.t()
        sim.fill_diagonal_(-1e9)  # AMP007
    return sim


# ---------------------------------------------------------------- negatives


class SafeAttention(nn.Module):
    def forward(self, q, k, mask):
        scores = q @ k.transpose(-2, -1)
        return scores.masked_fill(mask, torch.finfo(scores.dtype).min)

def python_scalars(history):
    best_val_loss = 1e9
    for loss in history:
        best_val_loss = min(best_val_loss, loss)
    return best_val_loss


def neg_max(sim, mask):
    max_neg_value = -torch.finfo(sim.dtype).max
    return sim.masked_fill(~mask, max_neg_value)


def half_of_max(sim, mask):
    return sim.masked_fill(~mask, -torch.finfo(sim.dtype).max / 2)


def in_range_literal(scores, mask):
    return scores.masked_fill(mask == 0, -1e4)


def in_range_float(scores, mask):
    return scores.masked_fill(mask == 0, -10000.0)


def module_safe_constant(scores, mask):
    return scores.masked_fill(mask, SAFE_NEG)


def float_inf(scores, mask):
    return scores.masked_fill(mask, float("-inf"))


def math_inf(scores, mask):
    return scores.masked_fill(mask, -math.inf)


def dtype_conditional(x, mask):
    return x.masked_fill(mask, -1e8 if x.dtype == torch.float32 else -1e4)


def dtype_conditional_variable(scores, mask):
    fill = -1e9 if scores.dtype == torch.float32 else -1e4
    return scores.masked_fill(mask, fill)


def explicit_fp32(scores, mask):
    return scores.float().masked_fill(mask, -1e9)


def converted_fp32(scores, mask):
    scores = scores.to(torch.float32)
    scores[mask] = -1e9
    return scores


def known_bf16(n, mask):
    buf = torch.zeros(n, dtype=torch.bfloat16)
    return buf.masked_fill(mask, -1e9)


def full_with_default_dtype(n):
    return torch.full((n, n), -1e9)


def full_like_fp32(scores):
    return torch.full_like(scores, -1e9, dtype=torch.float32)


def where_with_finfo(scores, mask):
    return torch.where(mask, scores, torch.finfo(scores.dtype).min)


def clamp_is_not_a_fill(scores):
    return scores.clamp(min=-1e9, max=1e9)


def numpy_arrays(mask):
    arr = np.full(mask.shape, -1e9)
    return np.where(mask, arr, -1e9)


def disabled_island(scores, mask):
    with torch.autocast("cuda", enabled=False):
        return scores.float().masked_fill(mask, -1e9)


class PythonContainers(nn.Module):
    def forward(self, scores, keys):
        best = {}
        distances = [0.0] * len(keys)
        for i, key in enumerate(keys):
            best[key] = -1e9
            distances[i] = 1e10
        return torch.where(scores > 0, 1e9, 0.0), best, distances


def string_keyed_mapping(stats):
    stats["best_loss"] = 1e9
    return stats


def numpy_array_times_number(n):
    costs = np.ones((n, n)) * 5
    costs[0, 0] = 1e9
    return costs


def hungarian_costs_in_numpy(cost, valid):
    costs = cost.detach().cpu().numpy()
    costs[~valid] = 1e9
    return costs


def python_list_of_scores(scores):
    values = scores.tolist()
    values[0] = -1e9
    return values


class TokenIds(nn.Module):
    def forward(self, input_ids, pad_mask, n):
        input_ids = input_ids.masked_fill(pad_mask, 128001)
        token_idx = input_ids.new_full((n,), 151643)
        return input_ids, token_idx


# ---- F.pad values and 0-dim tensors in torch.where --------------------------------


class PaddedWindows(nn.Module):
    def forward(self, scores, n):
        return nn.functional.pad(scores, (0, n), value=-1e9)  # AMP007


class WhereWithScalarTensor(nn.Module):
    def forward(self, s, mask):
        return torch.where(mask, s, torch.tensor(-1e9))  # AMP007


class PaddedWindowsSafe(nn.Module):
    def forward(self, scores, n):
        return nn.functional.pad(scores, (0, n), value=torch.finfo(scores.dtype).min)


class PaddedFp32Windows(nn.Module):
    def forward(self, scores, n):
        return nn.functional.pad(scores.float(), (0, n), value=-1e9)


class WhereWithSafeScalarTensor(nn.Module):
    def forward(self, s, mask):
        return torch.where(mask, s, torch.tensor(-1e4, device=s.device))


class BeamScoresStayFp32(nn.Module):
    def forward(self, log_probs, beam):
        scores = torch.full((beam,), -1e9)
        log_probs = log_probs.float()
        for _ in range(4):
            cand = (scores[:, None] + log_probs).view(-1)
            top, idx = cand.topk(beam)
            scores = top
            scores = scores.masked_fill(idx < 0, -1e9)
        return scores


# ---- found in public projects: silent in target assignment, decoding, other dtypes ----
INF = 1e8


class CenterHead(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.reg = nn.Conv2d(channels, 4, 3, padding=1)

    def forward(self, feats):
        return self.reg(feats)

    def get_targets_single(self, gt_boxes, points, inside):
        areas = (gt_boxes[:, 2] - gt_boxes[:, 0]) * (gt_boxes[:, 3] - gt_boxes[:, 1])
        areas = areas[None].repeat(len(points), 1)
        areas[~inside] = INF
        min_area, min_inds = areas.min(dim=1)
        return min_inds

    def beam_search(self, scores, beam):
        scores[:, 0] = -1e10
        return scores.topk(beam, dim=-1)


class BitOps(nn.Module):
    def forward(self, x):
        bits = x.view(torch.int32)
        return torch.where(bits == 0, -2147483647, bits - 1).view(torch.float32)


class PrecisionPickingAttention(nn.Module):
    def forward(self, q, k, mask):
        q, k = q.float(), k.float()
        if q.dtype == torch.float32:
            q, k = q.bfloat16(), k.bfloat16()
        bias = torch.full((), -1e9, dtype=q.dtype, device=q.device)
        return q @ k.transpose(-1, -2) + torch.where(mask, 0.0, bias)


class MinMaxNorm(nn.Module):
    def normalise(self, x, mask):
        low = torch.amin(x.masked_fill(~mask, 1e30), dim=(1, 2), keepdim=True)  # AMP007
        return x - low

    def forward(self, pred, mask):
        return self.normalise(pred, mask)


INF_DISTANCE = 100000000


class CenternessHead(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.cls = nn.Conv2d(channels, 80, 3, padding=1)

    def forward(self, features, locations, boxes):
        targets = self.assign_targets(locations, boxes)
        logits = self.cls(features)
        return logits, targets

    @torch.no_grad()
    def assign_targets(self, locations, boxes):
        areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        areas = areas[None].repeat(len(locations), 1)
        areas[locations[:, :1] < 0] = INF_DISTANCE
        return areas.min(dim=1)


class ScoreMaskHead(nn.Module):
    def forward(self, scores, mask):
        scores = scores.masked_fill(mask, -1e9)  # AMP007
        return scores.softmax(-1)


class CausalScores(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return scores.masked_fill(mask, -1e10).softmax(-1)  # AMP007


def debug_step_bf16(x, mask):
    model = CausalScores(32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x, mask).sum()


def train_step_fp16(x, mask):
    model = CausalScores(32).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        return model(x, mask).sum()


class BfloatOnlyScores(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q = nn.Linear(dim, dim)

    def forward(self, x, mask):
        scores = self.q(x) @ x.transpose(-1, -2)
        return scores.masked_fill(mask, -1e10).softmax(-1)


def bf16_step_a(x, mask):
    model = BfloatOnlyScores(32).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(x, mask).sum()


def bf16_step_b(x, mask):
    model = BfloatOnlyScores(32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x, mask).sum()


# ---- model code a framework runs: the region of its training_step is not in the file -----
class PackedAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, pad_mask):
        q, k, v = self.qkv(x).unflatten(-1, (3, -1)).permute(2, 0, 1, 3)
        scores = q @ k.transpose(-2, -1)
        scores.masked_fill_(pad_mask[:, None, :], -1e9)  # AMP007
        return scores.softmax(-1) @ v


class LitEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = PackedAttention(dim)

    def forward(self, x, pad_mask):
        return self.attn(x.float(), pad_mask)

    def training_step(self, batch, batch_idx):
        x, pad_mask, y = batch
        return (self(x, pad_mask) - y).pow(2).mean()


# ---- a scale written as Python arithmetic of unknown numbers; a model kept by tuple assignment
class HeadsAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)

    def forward(self, x, pad_mask):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        attn.masked_fill_(pad_mask[:, None, None, :], -1e9)  # AMP007
        return attn.softmax(dim=-1) @ v


class TupleTrainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def train_step(self, x, pad_mask):
        with torch.autocast("cuda", dtype=torch.float16):
            out = self.model(x, pad_mask)
        out.float().mean().backward()
        self.optimizer.step()


def run_tuple_trainer(loader, dims):
    model = HeadsAttention(*dims)
    trainer = TupleTrainer(model, torch.optim.AdamW(model.parameters()))
    for x, pad_mask in loader:
        trainer.train_step(x, pad_mask)


# ---- model code some callers run under autocast and others not: not known to be fp32 ------
class SeedReadout(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.seed = torch.nn.Parameter(torch.randn(1, dim))
        self.lin_q = torch.nn.Linear(dim, dim)

    def forward(self, x, mask):
        q = self.lin_q(self.seed)
        scores = q @ x.transpose(-2, -1)
        return torch.where(mask, scores, torch.tensor(-1e9, device=scores.device))  # AMP007


class IslandReadout(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.seed = torch.nn.Parameter(torch.randn(1, dim))
        self.lin_q = torch.nn.Linear(dim, dim)

    def forward(self, x, mask):
        q = self.lin_q(self.seed)
        scores = q @ x.float().transpose(-2, -1)
        return torch.where(mask, scores, torch.tensor(-1e9, device=scores.device))


def fit_readouts(x, mask, optimizer):
    readout, island = SeedReadout(64), IslandReadout(64)
    with torch.autocast("cuda", dtype=torch.float16):
        out = readout(x, mask)
        with torch.autocast("cuda", enabled=False):
            out = out.float() + island(x, mask)
    out.sum().backward()
    optimizer.step()
    half_readout = SeedReadout(64).half()
    half_readout(x.half(), mask).float().sum().backward()
    optimizer.step()


# ---- a base class's forward calling the hook each subclass defines ------------------------
class AxialBase(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qk = torch.nn.Linear(dim, 2 * dim)

    def _attend(self, q, k, mask):
        raise NotImplementedError

    def forward(self, x, mask):
        q, k = self.qk(x).chunk(2, dim=-1)
        return self._attend(q, k, mask)


class RowAttention(AxialBase):
    def _attend(self, q, k, mask):
        scores = q @ k.transpose(-2, -1)
        return scores.masked_fill(mask, -1e9).softmax(dim=-1)  # AMP007


class UpcastColumnAttention(AxialBase):
    def forward(self, x, mask):
        q, k = self.qk(x).chunk(2, dim=-1)
        with torch.autocast("cuda", enabled=False):
            return self._attend(q.float(), k.float(), mask)

    def _attend(self, q, k, mask):
        scores = q @ k.transpose(-2, -1)
        return scores.masked_fill(mask, -1e9).softmax(dim=-1)


class AxialPair(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.row = RowAttention(dim)
        self.column = UpcastColumnAttention(dim)

    def forward(self, x, mask):
        return self.row(x, mask) + self.column(x, mask)


def fit_axial_pair(x, mask, optimizer, scaler):
    model = AxialPair(32).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, mask).float().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# Target assignment under no_grad in a method the forward runs: ground truth, not activations.
INF = 100000000


class AnchorFreeHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.cls = nn.Conv2d(dim, 4, 1)

    @torch.no_grad()
    def assign(self, points, boxes):
        areas = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))[None].repeat(len(points), 1)
        areas[points[:, None, 0] < boxes[None, :, 0]] = INF
        return areas.min(dim=1)

    @torch.no_grad()
    def suppress(self, features):
        scores = self.cls(features)
        scores[scores < 0] = -INF  # AMP007
        return scores

    def forward(self, features, points, boxes):
        return self.cls(features), self.assign(points, boxes), self.suppress(features)


def train_anchor_free(loader, optimizer, scaler):
    model = AnchorFreeHead(8).cuda()
    for features, points, boxes in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits, (min_area, _), _ = model(features, points, boxes)
            with torch.no_grad():
                ranks = logits.flatten(1)
                ranks[min_area[None] == INF] = -INF  # AMP007
            loss = logits.float().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def near_far_bins(z_near, z_far, n):
    z_vals, _ = torch.sort(torch.cat([z_near.float(), z_far.float()], dim=-1), dim=-1)
    return torch.cat([z_vals, torch.full_like(z_vals[..., :1], 1e10)], dim=-1)


class CausalAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def _attend(self, q, k, v):
        att = q @ k.transpose(-2, -1)
        return att.softmax(-1) @ v

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self._attend(q, k, v)


class PrefixAttention(CausalAttention):
    """Overrides only what the base class's forward calls: its fills are the forward's."""

    def _attend(self, q, k, v):
        T = q.size(-2)
        bias = torch.full((T, T), -1e9, dtype=q.dtype, device=q.device).triu_(1)  # AMP007
        return ((q @ k.transpose(-2, -1)) + bias).softmax(-1) @ v


class FloatPrefixAttention(CausalAttention):
    def _attend(self, q, k, v):
        T = q.size(-2)
        bias = torch.full((T, T), -1e9, dtype=torch.float32, device=q.device).triu_(1)
        return ((q.float() @ k.float().transpose(-2, -1)) + bias).softmax(-1).to(v.dtype) @ v


# ---- a big number in arithmetic whose result is known fp16 (the number becomes inf) ----
class BertStyleSelfAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1)
        extended = (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * -1e9  # AMP007
        return (scores + extended).softmax(dim=-1) @ v


class BertStyleSelfAttentionFinfo(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1)
        extended = (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
        return (scores + extended).softmax(dim=-1) @ v


class BertStyleSelfAttentionSmallBias(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1)
        extended = (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * -10000.0
        return (scores + extended).softmax(dim=-1) @ v


def train_bert_style_layers(x, attention_mask, target, optimizer, scaler):
    layers = [BertStyleSelfAttention(64), BertStyleSelfAttentionFinfo(64),
              BertStyleSelfAttentionSmallBias(64)]
    for layer in layers:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = (layer(x, attention_mask) - target).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def gat_attention_in_half(h, weight, adj):
    e = torch.mm(h.half(), weight.half())
    zero_vec = -9e15 * torch.ones_like(e)  # AMP007
    return torch.where(adj > 0, e, zero_vec).softmax(dim=1)


def gat_attention_in_fp32(h, weight, adj):
    e = torch.mm(h.float(), weight.float())
    zero_vec = -9e15 * torch.ones_like(e)
    return torch.where(adj > 0, e, zero_vec).softmax(dim=1)


def additive_mask_in_region(model, x, mask):
    with torch.autocast("cuda", dtype=torch.float16):
        scores = model(x) @ model(x).transpose(-2, -1)
        scores = scores - NEG_INF * (1.0 - mask.to(scores.dtype))  # AMP007
        return scores.softmax(dim=-1)


def additive_mask_from_fp32_mask(model, x, mask):
    with torch.autocast("cuda", dtype=torch.float16):
        scores = model(x) @ model(x).transpose(-2, -1)
        bias = (1.0 - mask.float()) * -1e9
        return (scores + bias).softmax(dim=-1)


def additive_mask_in_bf16_region(model, x, mask):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        scores = model(x) @ model(x).transpose(-2, -1)
        scores = scores + (1.0 - mask.to(scores.dtype)) * -1e9
        return scores.softmax(dim=-1)


def additive_mask_of_unknown_dtype(scores, mask):
    return (scores + mask * -1e9).softmax(dim=-1)


def numbers_only(warmup_steps):
    return 1e9 * warmup_steps + 2e10
