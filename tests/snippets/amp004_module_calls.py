# AMP004 through module calls: the output of a module whose construction is known in this file.
import argparse
from collections import namedtuple
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from elsewhere import Backbone

parser = argparse.ArgumentParser()
parser.add_argument("--temperature", type=float, default=0.07)
args = parser.parse_args()


class Projection(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class NormedProjection(nn.Module):
    """Ends in LayerNorm: fp32 under CUDA autocast, low precision under CPU autocast."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.fc(x))


class SoftmaxHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return F.softmax(self.fc(x), dim=-1)


class Fp32Island(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        with torch.autocast("cuda", enabled=False):
            return self.fc(x.float())


class Heads(nn.Module):
    def __init__(self, dim, n):
        super().__init__()
        self.heads = nn.ModuleList([Projection(dim) for _ in range(n)])
        self.named = nn.ModuleDict({"a": nn.Linear(dim, dim)})

    def forward(self, x):
        return torch.stack([head(x) for head in self.heads]).mean(0)  # AMP004

    def last(self, x):
        return self.heads[-1](x)


def build_mlp(dims):
    layers, dim = [], dims[0]
    for i, out in enumerate(dims[1:]):
        layers.append(nn.Linear(dim, out))
        if i < len(dims) - 2:
            layers += [nn.BatchNorm1d(out), nn.ReLU()]
        dim = out
    return nn.Sequential(*layers)


# ---- positives --------------------------------------------------------------------


def local_class_under_autocast(x):
    model = Projection(64).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        z = model(x)
        return z.mean()  # AMP004


def sequential_literal(x):
    mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1))
    with torch.autocast("cuda"):
        return mlp(x).std(dim=0)  # AMP004


class SequentialBuiltInLoop(nn.Module):
    def __init__(self, dims):
        super().__init__()
        layers, dim = [], dims[0]
        for i, out in enumerate(dims[1:]):
            layers.append(nn.Linear(dim, out))
            if i < len(dims) - 2:
                layers += [nn.BatchNorm1d(out), nn.ReLU(inplace=True)]
            dim = out
        self.projector = nn.Sequential(*layers)

    def spread(self, x):
        with torch.autocast("cuda"):
            return self.projector(x).std(dim=0)  # AMP004


def ddp_module_attribute(x, rank):
    model = DistributedDataParallel(Projection(64).cuda(), device_ids=[rank])
    with torch.autocast("cuda"):
        z = model.module.fc2(model.module.fc1(x))
        return z.var(dim=0)  # AMP004


def compiled_model(x):
    model = torch.compile(Projection(64))
    with torch.autocast("cuda", dtype=torch.float16):
        return model(x).mean()  # AMP004


def normed_under_cpu_autocast(x):
    model = NormedProjection(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x).mean()  # AMP004


def annotated_model(model: Projection, x):
    with torch.autocast("cuda"):
        return model(x).mean(dim=1)  # AMP004


def heads_under_autocast(x):
    model = Heads(64, 4)
    with torch.autocast("cuda"):
        return model(x)


def module_list_indexed(heads: Heads, x):
    with torch.autocast("cuda"):
        return heads.last(x).var()  # AMP004


def argparse_temperature(q, k):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = torch.mm(q, k.t()) / args.temperature
        return logits.std(dim=1)  # AMP004


class Trainer:
    def __init__(self, model, opts):
        self.model = model
        self.opts = opts

    def step(self, q, k):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = (q @ k.t()) * self.opts.temperature
            return logits.mean(dim=1)  # AMP004


def make_trainer(model):
    return Trainer(model, parser.parse_args())


def helper_function_output(x, w):
    with torch.autocast("cuda"):
        return project(x, w).mean()  # AMP004


def project(x, w):
    return F.linear(x, w)


# ---- negatives --------------------------------------------------------------------


def layer_norm_last_under_cuda(x):
    model = NormedProjection(64)
    with torch.autocast("cuda", dtype=torch.float16):
        return model(x).mean()


def softmax_last_under_cuda(x):
    model = SoftmaxHead(64)
    with torch.autocast("cuda"):
        return model(x).mean(dim=0)


def layer_norm_last_device_unknown(x, device):
    model = NormedProjection(64)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        return model(x).mean()


def upcast_first(x):
    model = Projection(64)
    with torch.autocast("cuda"):
        return model(x).float().mean()


def fp32_outside_autocast(x):
    model = Projection(64)
    return model(x).mean()


def module_from_elsewhere(x):
    model = Backbone()
    with torch.autocast("cuda"):
        return model(x).mean()


def fp32_island_in_forward(x):
    model = Fp32Island(64)
    with torch.autocast("cuda"):
        return model(x).mean()


def sequential_may_end_in_layer_norm(x, dims):
    layers = []
    for d in dims:
        layers += [nn.Linear(d, d), nn.LayerNorm(d)]
    mlp = nn.Sequential(*layers)
    with torch.autocast("cuda"):
        return mlp(x).std()


def sequential_list_changed_elsewhere(x, dims):
    layers = [nn.Linear(d, d) for d in dims]
    extend_with_norms(layers)
    mlp = nn.Sequential(*layers)
    with torch.autocast("cuda"):
        return mlp(x).std()


def extend_with_norms(layers):
    layers.append(nn.LayerNorm(8))


def config_attribute_is_a_tensor(x):
    cfg = SimpleNamespace(class_weights=torch.ones(64))
    model = Projection(64)
    with torch.autocast("cuda"):
        weighted = model(x) * cfg.class_weights
        return weighted.mean()


def fp32_tensor_attribute(q, k, prior):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = torch.mm(q, k.t()) * prior.weights
        return logits.mean(dim=1)


@torch.no_grad()
def evaluation_statistic(x):
    model = Projection(64)
    with torch.autocast("cuda"):
        return model(x).mean().item()


def module_dict_keys(heads: Heads, x):
    with torch.autocast("cuda"):
        return torch.stack([torch.as_tensor(len(name)) for name in heads.named]).float().mean()


def returned_fp32(x):
    with torch.autocast("cuda"):
        return project(x.float(), x.float()).float().mean()


class RecursiveModule(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.child = RecursiveModule(dim) if dim > 1 else None

    def forward(self, x):
        return self.child(x) if self.child is not None else x

    def stat(self, x):
        with torch.autocast("cuda"):
            return self(x).mean()


class Scorer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.src = nn.Linear(dim, dim)
        self.dst = nn.Linear(dim, dim)


def score_pairs(scorer, h, pairs):
    hs = scorer.src(h[pairs[0]])
    hd = scorer.dst(h[pairs[1]])
    return hs * hd, hs, hd


def train_pairs_unpacked(h, pairs, optimizer):
    scorer = Scorer(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, hs, hd = score_pairs(scorer, h, pairs)
        reg = hs.pow(2).mean() + hd.pow(2).mean()  # AMP004
    (scores.float().sum() + reg).backward()
    optimizer.step()


def train_pairs_unpacked_upcast(h, pairs, optimizer):
    scorer = Scorer(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, hs, hd = score_pairs(scorer, h, pairs)
        reg = hs.float().pow(2).mean() + hd.float().pow(2).mean()
    (scores.float().sum() + reg).backward()
    optimizer.step()


def projection_step(model, x, optimizer):
    with torch.autocast("cuda", dtype=torch.float16):
        z = model.proj(x)
        spread = z.std(dim=0).mean()  # AMP004
    spread.backward()
    optimizer.step()


def normed_projection_step(model, x, optimizer):
    with torch.autocast("cuda", dtype=torch.float16):
        z = model.proj(x)
        spread = z.std(dim=0).mean()
    spread.backward()
    optimizer.step()


class WithProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = Projection(64)


class WithNormedProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = NormedProjection(64)


def run_projection_steps(x, optimizer):
    projection_step(WithProjection().cuda(), x, optimizer)
    normed_projection_step(WithNormedProjection().cuda(), x, optimizer)


def mixed_models_step(model, x, optimizer):
    """Called with models of two classes: one ends in LayerNorm, so the dtype is unknown."""
    with torch.autocast("cuda", dtype=torch.float16):
        z = model.proj(x)
        spread = z.std(dim=0).mean()
    spread.backward()
    optimizer.step()


def run_mixed_models(x, optimizer):
    mixed_models_step(WithProjection(), x, optimizer)
    mixed_models_step(WithNormedProjection(), x, optimizer)


def linear_probe_half_head(feats, target, optimizer):
    head = nn.Linear(64, 10).cuda().half()
    with torch.autocast("cuda", dtype=torch.float16):
        logits = head(feats)
        penalty = logits.var(dim=1).mean()  # AMP004
    (F.cross_entropy(logits, target) + penalty).backward()
    optimizer.step()


class RewardHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.v_head = nn.Linear(dim, 1)


def reward_pair_loss(h_chosen, h_rejected, optimizer, scaler):
    rm = RewardHead(64).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        r_c = rm.v_head(h_chosen).squeeze(-1)
        r_r = rm.v_head(h_rejected).squeeze(-1)
    loss = -F.logsigmoid(r_c - r_r).mean()  # AMP004
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def reward_pair_loss_upcast(h_chosen, h_rejected, optimizer, scaler):
    rm = RewardHead(64).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        r_c = rm.v_head(h_chosen).squeeze(-1)
        r_r = rm.v_head(h_rejected).squeeze(-1)
    loss = -F.logsigmoid((r_c - r_r).float()).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


class TinyEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        h = self.body(x)
        return self.head(h), h


def build_encoder(args):
    model = TinyEncoder(args.width)
    return model.cuda()


def train_built_encoder(args, x, optimizer):
    model = build_encoder(args)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, hidden = model(x)
        penalty = logits.abs().mean()  # AMP004
        spread = hidden.float().std(dim=0).mean()
    (penalty + spread).backward()
    optimizer.step()


def build_encoder_or_backbone(args):
    if args.pretrained:
        return Backbone.from_pretrained(args.name)
    return TinyEncoder(args.width)


def train_encoder_or_backbone(args, x, optimizer):
    model = build_encoder_or_backbone(args)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, hidden = model(x)
        penalty = logits.abs().mean()
    penalty.backward()
    optimizer.step()


# ---- elements unpacked from a sequence of tensors of one kind --------------------------
class PairEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 128, 3)

    def forward(self, x):
        is_list = isinstance(x, (tuple, list))
        if is_list:
            batch = x[0].shape[0]
            x = torch.cat(x, dim=0)
        x = self.conv(x)
        if is_list:
            x = torch.split(x, [batch, batch], dim=0)
        return x


def standardize(feat):
    return (feat - feat.mean(dim=1, keepdim=True)) / feat.std(dim=1, keepdim=True)  # AMP004 AMP004


class FlowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fnet = PairEncoder()
        self.qkv = nn.Linear(128, 384)

    def forward(self, image1, image2):
        with torch.autocast("cuda", dtype=torch.float16):
            fmap1, fmap2 = self.fnet([image1, image2])
            fmap1, fmap2 = standardize(fmap1), standardize(fmap2)
            q, k, v = self.qkv(fmap1.flatten(2).transpose(1, 2)).chunk(3, dim=-1)
            pooled, indices = F.max_pool1d(v.transpose(1, 2), 2, return_indices=True)
            return q.var(dim=-1) + k.mean() + indices.sum(), pooled  # AMP004 AMP004


def flow_step(image1, image2, optimizer):
    out, _ = FlowNet()(image1, image2)
    out.float().mean().backward()
    optimizer.step()


# ---- an empty container filled where it is built ---------------------------------------
class ChannelNorm(nn.Module):
    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)  # AMP004
        return (x - mean) / (x.var(dim=1, keepdim=True) + 1e-5).sqrt()  # AMP004


class ConvStack(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.convs = nn.ModuleList()
        for d_in, d_out in zip(dims, dims[1:]):
            self.convs.append(nn.Conv1d(d_in, d_out, 3))
        self.norm = ChannelNorm()
        self.heads = nn.Sequential()
        self.heads.add_module("act", nn.GELU())

    def forward(self, x):
        for i, conv in enumerate(self.convs):
            x = F.gelu(conv(x))
            if i == 0:
                x = self.norm(x)
        return self.heads(x)


def conv_stack_step(batch, optimizer):
    model = ConvStack([1, 64, 128])
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(batch)
    out.float().pow(2).mean().backward()
    optimizer.step()


# ---- an element of what a wrapper's returned head call returns; weight_norm'd layers --------
class ProjectionHead(nn.Module):
    def __init__(self, dim, out_dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, 256))
        self.last_layer = nn.utils.weight_norm(nn.Linear(256, out_dim, bias=False))

    def forward(self, x):
        z = self.mlp(x)
        return self.last_layer(F.normalize(z, dim=-1)), z


class CropWrapper(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, crops):
        return self.head(torch.cat(crops))


class CenteredLoss(nn.Module):
    def __init__(self, out_dim):
        super().__init__()
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, student_logits, teacher_logits):
        loss = -(F.softmax(teacher_logits - self.center, dim=-1) * F.log_softmax(student_logits, dim=-1))
        self.update_center(teacher_logits)
        return loss.sum(-1).mean()

    @torch.no_grad()
    def update_center(self, teacher_logits):
        self.center = 0.9 * self.center + 0.1 * teacher_logits.mean(dim=0, keepdim=True)  # AMP004


class SpreadLoss(nn.Module):
    def forward(self, feats):
        with torch.autocast("cuda", enabled=False):
            distances = (feats - feats.flip(0)).norm(p=2, dim=-1)  # AMP004
            return -torch.log(distances + 1e-4).mean()  # AMP004


def self_distillation_step(crops, optimizer):
    student = CropWrapper(ProjectionHead(384, 4096))
    teacher = CropWrapper(ProjectionHead(384, 4096))
    criterion, spread = CenteredLoss(4096), SpreadLoss()
    with torch.autocast("cuda", dtype=torch.float16):
        teacher_logits, _ = teacher(crops[:2])
        student_logits, student_feats = student(crops)
        loss = criterion(student_logits, teacher_logits) + spread(student_feats)
    loss.backward()
    optimizer.step()


# ---- fields a config class of the file declares numbers --------------------------------
@dataclass
class RouterConfig:
    n_embd: int = 512
    n_expert: int = 8
    router_noise: float = 0.0
    noise_table: object = None


class NoisyRouter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.noise = cfg.router_noise
        self.table = cfg.noise_table

    def forward(self, x):
        logits = self.gate(x)
        if self.training and self.noise > 0:
            logits = logits + torch.randn_like(logits) * self.noise
        load = torch.sigmoid(logits).mean(dim=0)  # AMP004
        tabled = logits * self.table
        return load, tabled.mean(dim=0)


def router_step(x, optimizer):
    router = NoisyRouter(RouterConfig(router_noise=0.1))
    with torch.autocast("cuda", dtype=torch.float16):
        load, tabled = router(x)
    (load.float().sum() + tabled.float().sum()).backward()
    optimizer.step()


# ---- a model kept on self by tuple assignment, called under the trainer's autocast -------
class TaggingHead(nn.Module):
    def __init__(self, dim, tags):
        super().__init__()
        self.frame_head = nn.Linear(dim, tags)

    def forward(self, frames):
        return self.frame_head(frames).mean(dim=1)  # AMP004


class TaggingTrainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def train_step(self, frames, tags):
        with torch.autocast("cuda", dtype=torch.float16):
            tag_logits = self.model(frames)
        F.binary_cross_entropy_with_logits(tag_logits.float(), tags).backward()
        self.optimizer.step()


def run_tagging(loader):
    model = TaggingHead(512, 527)
    trainer = TaggingTrainer(model, torch.optim.AdamW(model.parameters()))
    for frames, tags in loader:
        trainer.train_step(frames, tags)


# ---- norm layers passed as classes, in-place activations, pathways carried round a loop ---
def get_norm():
    return nn.BatchNorm3d


class Stem3d(nn.Module):
    def __init__(self, dim_in, dim_out, norm_module=nn.BatchNorm3d):
        super().__init__()
        self.conv = nn.Conv3d(dim_in, dim_out, 3)
        self.bn = norm_module(dim_out, eps=1e-5)

    def forward(self, x):
        return F.relu_(self.bn(self.conv(x)))


class Fuse(nn.Module):
    def __init__(self, dim, norm_module):
        super().__init__()
        self.conv_f2s = nn.Conv3d(dim, dim * 2, 1)
        self.bn = norm_module(dim * 2)

    def forward(self, x):
        x_s, x_f = x
        return [torch.cat([x_s, self.bn(self.conv_f2s(x_f))], 1), x_f]


class TwoPathwayHead(nn.Module):
    def forward(self, slow, fast):
        return torch.cat([slow.mean(dim=(2, 3, 4)), fast.mean(dim=(2, 3, 4))], 1)  # AMP004 AMP004


class TwoPathway(nn.Module):
    def __init__(self):
        super().__init__()
        norm = get_norm()
        self.slow_stem = Stem3d(3, 64, norm)
        self.fast_stem = Stem3d(3, 8, norm)
        self.fusions = nn.ModuleList()
        for _ in range(3):
            self.fusions.append(Fuse(8, norm))
        self.head = TwoPathwayHead()

    def forward(self, clips):
        x_s, x_f = self.slow_stem(clips[0]), self.fast_stem(clips[1])
        for fuse in self.fusions:
            x_s, x_f = fuse([x_s, x_f])
        return self.head(x_s, x_f)


def two_pathway_step(clips, optimizer):
    model = TwoPathway()
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(clips)
    logits.float().logsumexp(-1).mean().backward()
    optimizer.step()


# ---- a subclass's forward through super().forward -------------------------------------
class ConvEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv1d(64, 512, 3), nn.ReLU())

    def forward(self, x):
        return self.features(x).transpose(1, 2)


class PooledConvEncoder(ConvEncoder):
    def forward(self, x):
        x = super().forward(x)
        return torch.max(x, dim=1)[0] + torch.mean(x, dim=1)  # AMP004


def pooled_encoder_step(mels, optimizer):
    encoder = PooledConvEncoder()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        z = encoder(mels)
    z.float().pow(2).mean().backward()
    optimizer.step()


# ---- a dict of outputs built key by key, read back by key -----------------------------
class MultiTaskNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleDict({"seg": nn.Conv2d(64, 13, 1), "depth": nn.Conv2d(64, 1, 1)})
        self.valid_head = nn.Conv2d(64, 1, 1)

    def forward(self, feats):
        out = {}
        for task in ("seg", "depth"):
            out[task] = self.heads[task](feats)
        out["seg"] = out["seg"].masked_fill(out["seg"].isnan(), 0.0)
        out["valid"] = self.valid_head(feats)
        return out


def multitask_losses(preds, batch):
    smoothness = preds["depth"].abs().mean()  # AMP004
    return F.l1_loss(preds["depth"].float(), batch["depth"]) + 0.1 * smoothness


def multitask_step(feats, batch, optimizer):
    model = MultiTaskNet()
    with torch.autocast("cuda", dtype=torch.float16):
        preds = model(feats)
        loss = multitask_losses(preds, batch)
    loss.backward()
    optimizer.step()


# ---- models handed over in a tuple and unpacked -----------------------------------------
class ReferenceEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Conv1d(80, 256, 1)

    def forward(self, spec):
        return self.proj(spec).mean(dim=-1, keepdim=True)  # AMP004


def train_and_evaluate(nets, optimizers, loader):
    net_ref, net_head = nets
    optim_ref, _ = optimizers
    for spec, target in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            style = net_ref(spec)
        net_head(style.float(), target).backward()
        optim_ref.step()


def run_tts(loader, head):
    net_ref = ReferenceEncoder()
    optimizers = (torch.optim.AdamW(net_ref.parameters()), torch.optim.AdamW(head.parameters()))
    train_and_evaluate((net_ref, head), optimizers, loader)


# ---- a model built through a helper that returns what it is given -----------------------
def init_weights(net, gain=0.02):
    net.apply(lambda m: None)
    return net


class PatchHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(64, 1, 4)

    def forward(self, x):
        return self.conv(x).mean(dim=(2, 3))  # AMP004


class PatchTail(nn.Module):
    def forward(self, x):
        return x


def patch_step(images, optimizer):
    head = init_weights(PatchHead())
    tail = init_weights(PatchTail())
    with torch.autocast("cuda", dtype=torch.float16):
        score = tail(head(images))
    score.float().sum().backward()
    optimizer.step()


# ---- a norm inside blocks held by an nn.Sequential ----------------------------------------
class GlobalNorm(nn.Module):
    def forward(self, x):
        mean = x.mean(dim=(1, 2), keepdim=True)  # AMP004
        return (x - mean) / (x.var(dim=(1, 2), keepdim=True) + 1e-5).sqrt()  # AMP004


class TemporalConvBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 1)
        self.norm = GlobalNorm()

    def forward(self, x):
        return x + self.norm(self.conv(x))


class SeparationNet(nn.Module):
    def __init__(self, channels=128, repeats=3):
        super().__init__()
        self.tcn = nn.Sequential(*[TemporalConvBlock(channels) for _ in range(repeats)])

    def forward(self, x):
        return self.tcn(x)


def separation_step(mix, optimizer):
    model = SeparationNet()
    with torch.autocast("cuda", dtype=torch.float16):
        est = model(mix)
    est.float().abs().mean().backward()
    optimizer.step()


# ---- a model re-assigned through a wrapper of itself; a statistic under no_grad ------------
class SiameseHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.predictor = nn.Sequential(nn.Linear(256, 64), nn.BatchNorm1d(64), nn.Linear(64, 256))

    def forward(self, z1, z2):
        return {"p1": self.predictor(z1), "p2": self.predictor(z2)}


class SiameseTrainer:
    def __init__(self, sync_bn):
        self.model = SiameseHeads()
        self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model) if sync_bn else self.model
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def training_step(self, z1, z2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = self.model(z1, z2)
            loss = -(F.normalize(out["p1"].float(), dim=1) * z2).sum(1).mean()
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            collapse = out["p1"].std(dim=0).mean()  # AMP004
        return loss.detach(), collapse


# ---- a block held through a conditional expression (or nn.Identity) ----------------------
class SqueezeExcite(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.fc1 = nn.Conv2d(ch, ch // 4, 1)
        self.fc2 = nn.Conv2d(ch // 4, ch, 1)

    def forward(self, x):
        s = x.mean(dim=(2, 3), keepdim=True)  # AMP004
        return x * torch.sigmoid(self.fc2(F.relu(self.fc1(s))))


class UpcastSqueezeExcite(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.fc = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        s = x.float().mean(dim=(2, 3), keepdim=True).to(x.dtype)
        return x * torch.sigmoid(self.fc(s))


class OptionalSEBlock(nn.Module):
    def __init__(self, ch, use_se=True, upcast=False):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)
        self.se = SqueezeExcite(ch) if use_se else nn.Identity()
        self.se_upcast = UpcastSqueezeExcite(ch) if upcast else nn.Identity()

    def forward(self, x):
        return self.se_upcast(self.se(self.conv(x)))


def train_optional_se(loader, optimizer, scaler):
    block = OptionalSEBlock(64).cuda()
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = block(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# ---- nn.Sequential(*layers) whose head is appended after the loop ------------------------
class HeadMLP(nn.Module):
    def __init__(self, inp, out, hidden=256, depth=3):
        super().__init__()
        layers, d = [], inp
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.LayerNorm(hidden), nn.ELU()]
            d = hidden
        layers.append(nn.Linear(d, out))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class MaybeSquashedMLP(nn.Module):
    def __init__(self, inp, out, hidden=256, squash=False):
        super().__init__()
        layers = [nn.Linear(inp, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, out)]
        if squash:
            layers.append(nn.LayerNorm(out))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def train_value_heads(feats, optimizer, scaler):
    reward_head = HeadMLP(512, 1).cuda()
    squashed_head = MaybeSquashedMLP(512, 1).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        rewards = reward_head(feats).squeeze(-1)
        adv = (rewards - rewards.mean()) / rewards.std()  # AMP004
        squashed = squashed_head(feats).squeeze(-1)
        spread = squashed.std()
        loss = adv.float().pow(2).mean() + spread.float()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# ---- an element of an nn.Sequential takes the output of the one before it -----------------
class ChannelsLayerNorm(nn.Module):
    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # AMP004
        return self.weight[:, None, None] * (x - u)


class InputStandardize(nn.Module):
    def forward(self, x):
        return (x - x.mean(dim=(2, 3), keepdim=True)) / 255.0


class Stem(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dim, 4, stride=4), ChannelsLayerNorm(dim))
        self.pre = nn.Sequential(InputStandardize(), nn.Conv2d(3, 3, 1))

    def forward(self, images):
        return self.stem(images), self.pre(images)


def train_stem(loader, optimizer, scaler):
    stem = Stem(96).cuda()
    for images in loader:
        images = images.float()
        with torch.autocast("cuda", dtype=torch.float16):
            features, standardized = stem(images)
            loss = features.float().pow(2).mean() + standardized.float().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# ---- a module also called by no_grad evaluation is judged as the training run -------------
class PairScorer(nn.Module):
    def forward(self, z, pairs):
        src, dst = pairs.unbind(0)
        return (z[src] * z[dst]).mean(dim=-1)  # AMP004


@torch.no_grad()
def score_pairs_after_training(scorer, z, pairs):
    return scorer(z, pairs)


def train_pair_scorer(x, pairs, labels, optimizer, scaler):
    encoder = nn.Linear(64, 64).cuda()
    scorer = PairScorer()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.binary_cross_entropy_with_logits(scorer(encoder(x), pairs).float(), labels)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return score_pairs_after_training(scorer, encoder(x).float(), pairs)


# ---- q, k, v unbound from one projection keep its dtype -----------------------------------
class QKNormAttention(nn.Module):
    def __init__(self, channels, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Conv1d(channels, channels * 3, 1)

    def _rms(self, t):
        return t * torch.rsqrt(t.pow(2).float().mean(-1, keepdim=True)).to(t.dtype)

    def _ms(self, t):
        return (t * t).mean(dim=-1, keepdim=True)  # AMP004

    def forward(self, x):
        B, C, L = x.shape
        q, k, v = self.qkv(x).reshape(B, 3, self.heads, C // self.heads, L).unbind(1)
        return self._rms(q) * self._ms(k) + v


def train_qk_attention(x, optimizer, scaler):
    attention = QKNormAttention(64).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = attention(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# ---- mixers chosen per layer into a plain list, then wrapped block by block ---------------
class GatedMixer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.v = nn.Linear(dim, dim)
        self.g = nn.Linear(dim, 1)

    def forward(self, x):
        decay = torch.cumsum(F.logsigmoid(self.g(x)), dim=1)  # AMP004
        self.energy = self.v(x).pow(2).float().mean()
        return self.v(x) * decay.float().exp().to(x.dtype)


class ConvMixer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)

    def forward(self, x):
        y = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return y - y.mean(dim=1, keepdim=True)  # AMP004


class MixerBlock(nn.Module):
    def __init__(self, dim, mixer):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mixer = mixer

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class HybridStack(nn.Module):
    def __init__(self, dim, depth):
        super().__init__()
        mixers = []
        for i in range(depth):
            if i % 2:
                mixers.append(GatedMixer(dim))
            else:
                mixers.append(ConvMixer(dim))
        self.blocks = nn.ModuleList([MixerBlock(dim, m) for m in mixers])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def train_hybrid_stack(x, optimizer):
    stack = HybridStack(64, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stack(x)
        off_diagonal = torch.diag_embed(torch.diagonal(out @ out.transpose(1, 2), dim1=1, dim2=2))
        loss = out.float().pow(2).mean() + off_diagonal.abs().sum()  # AMP004
    loss.backward()
    optimizer.step()


# ---- heads collected in a list, stacked, then averaged ------------------------------------
class MultiHeadAverage(nn.Module):
    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(dim, dim) for _ in range(heads)])

    def forward(self, x):
        outs, outs32 = [], []
        for head in self.heads:
            y = head(x)
            outs.append(y)
            outs32.append(y.float())
        averaged = torch.mean(torch.stack(outs, dim=2), dim=2)  # AMP004
        spread = torch.stack(outs32, dim=2).std(dim=2)
        return averaged, spread


def train_head_average(x, optimizer, scaler):
    model = MultiHeadAverage(32).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        averaged, spread = model(x)
        loss = averaged.float().pow(2).mean() + spread.mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# ---- a ModuleList built from a generator expression; new_zeros keeps its tensor's dtype ---
class LowRankExpert(nn.Module):
    def __init__(self, dim, rank):
        super().__init__()
        self.down = nn.Linear(dim, rank)
        self.up = nn.Linear(rank, dim)

    def forward(self, x):
        return self.up(torch.tanh(self.down(x)))


class ExpertMix(nn.Module):
    def __init__(self, dim, rank, experts):
        super().__init__()
        self.experts = nn.ModuleList(LowRankExpert(dim, rank) for _ in range(experts))

    def forward(self, x):
        outs = torch.stack([expert(x) for expert in self.experts], dim=1)
        hard = outs.new_zeros(outs.shape).scatter_(1, outs.argmax(1, keepdim=True), 1.0)
        counts = outs.new_zeros(outs.shape, dtype=torch.float32)
        usage = hard.mean(0) + counts.mean(0)  # AMP004
        return outs.mean(dim=1), usage  # AMP004


def train_expert_mix(x, optimizer, scaler):
    mix = ExpertMix(32, 8, 4).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        out, usage = mix(x)
        loss = out.float().pow(2).mean() + usage.float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# ---- steps reached through zip(), reversed() and slices of their ModuleList ---------------
class InitOnFirstBatch(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.logs = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.register_buffer("ready", torch.tensor(False))

    def forward(self, x):
        if not self.ready:
            with torch.no_grad():
                spread = x.std(dim=(0, 2, 3), keepdim=True)  # AMP004
                self.logs.data.copy_(-torch.log(spread.float() + 1e-6))
                self.ready.fill_(True)
        return x * torch.exp(self.logs)


class CouplingStep(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = InitOnFirstBatch(channels)

    def forward(self, x):
        return x + self.norm(self.conv(x))

    def inverse(self, y):
        return y - self.norm(self.conv(y))


class SampleRefiner(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        # only ever run to polish samples, without gradients
        return x - self.conv(x).sum(dim=1, keepdim=True) / x.shape[1]


class InvertibleStack(nn.Module):
    def __init__(self, channels, depth):
        super().__init__()
        self.steps = nn.ModuleList([CouplingStep(channels) for _ in range(depth)])
        self.gates = nn.ModuleList([nn.Conv2d(channels, channels, 1) for _ in range(depth)])
        self.refiners = nn.ModuleList([SampleRefiner(channels) for _ in range(2)])

    def forward(self, x):
        for step, gate in zip(self.steps, self.gates):
            x = step(x) * torch.sigmoid(gate(x))
        return x

    def forward_trunk(self, x):
        outs = [gate(step(x)) for step, gate in zip(self.steps[:-1], self.gates[1:])]
        return torch.stack(outs).mean(dim=0)  # AMP004

    @torch.no_grad()
    def sample(self, z):
        for step in reversed(self.steps):
            z = step.inverse(z)
        for refiner in reversed(self.refiners):
            z = refiner(z)
        return z


def train_invertible_stack(x, optimizer, scaler):
    model = InvertibleStack(8, 4).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        y = model(x)
        trunk = model.forward_trunk(x)
        loss = y.float().pow(2).mean() + trunk.float().abs().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return model.sample(torch.randn_like(x))


# ---- heads held in an nn.ModuleDict, run through items() and values() ----------------------
class KeyedHeads(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.heads = nn.ModuleDict({"pose": nn.Linear(dim, dim), "depth": nn.Linear(dim, dim)})

    def forward(self, x):
        spread = torch.stack([head(x) for _, head in self.heads.items()]).var(dim=0)  # AMP004
        mean = torch.stack([head(x) for head in self.heads.values()]).mean(dim=0)  # AMP004
        names = [name for name in self.heads]
        return spread, mean, names


def train_keyed_heads(x, optimizer, scaler):
    model = KeyedHeads(16).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        spread, mean, _ = model(x)
        loss = spread.float().mean() + mean.float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# ---- a loop over what a method of an object annotated with a class of the file returns ----
class LayerRegistry:
    def items(self):
        return []


def run_registry(registry: LayerRegistry, x):
    for _, layer in registry.items():
        x = layer(x)
    return x.sum()


# ---- models built through a registry dict and a builder returning a tuple ----------------
class SpectralBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.mix = nn.Conv2d(width, width, 1)

    def forward(self, x):
        y = self.mix(x)
        return y - y.mean(dim=(-2, -1), keepdim=True)  # AMP004


class PressureHead(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, 3)

    def forward(self, x):
        out = self.proj(x)
        return out - out.mean(dim=1, keepdim=True)  # AMP004


class ScoringHead(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.score = nn.Linear(width, 1)

    def forward(self, x):
        return self.score(x).std(dim=0)  # AMP004


def make_head(width):
    return PressureHead(width)


OPERATORS = {
    "spectral": SpectralBlock,
    "pressure": make_head,
    "small": lambda width: SpectralBlock(width // 2),
}
ELSEWHERE_OPERATORS = {"spectral": SpectralBlock, "external": Backbone}


def build_operator(name, width):
    return OPERATORS[name](width)


def build_pair(width):
    return build_operator("spectral", width), ScoringHead(width)


def train_operator(x, feats, optimizer, scaler):
    operator = build_operator("spectral", 16).cuda()
    trunk, scorer = build_pair(16)
    unknown = ELSEWHERE_OPERATORS["external"](16)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = operator(x).float().pow(2).mean() + scorer(feats).float().sum()
        loss = loss + trunk(x).float().mean() + unknown(x).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# Casts to another tensor's dtype keep it (``.to(h.dtype)``, ``dtype=x.dtype``).
class NormalizedDownsample(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, stride=2, padding=1)

    def forward(self, x, lengths):
        h = self.conv(x)
        sd = h.float().std(dim=-1, keepdim=True).to(h.dtype)
        return h / (sd + 1e-3), (lengths + 1) // 2


def spread(h):
    return h.var(dim=1)  # AMP004


class SequenceEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.down = NormalizedDownsample(dim)
        self.style = nn.Linear(dim, dim)

    def forward(self, x, lengths, mask):
        h, lengths = self.down(x, lengths)
        keep = mask.unsqueeze(1).to(h.dtype)
        pooled = (h * keep).sum(-1) / keep.sum(-1)  # CUDA autocast runs sum in fp32
        weights = torch.ones(h.shape[-1], dtype=h.dtype, device=h.device)
        centred = h - (h * weights).mean(dim=-1, keepdim=True)  # AMP004
        return self.style(spread(centred) + pooled)


def train_sequence_encoder(x, lengths, mask, optimizer, scaler):
    encoder = SequenceEncoder(8).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = encoder(x, lengths, mask).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    evaluate_sequence_encoder(encoder, x, lengths, mask)


@torch.no_grad()
def evaluate_sequence_encoder(encoder, x, lengths, mask):
    """Outside autocast: the encoder's ``sum`` above is judged as the training run's."""
    return encoder(x, lengths, mask).float().mean()


# A model's outputs in a record type of the file: a namedtuple, a NamedTuple, a dataclass.
PolicyOutput = namedtuple("PolicyOutput", ["logits", "value", "hidden"])


class HeadOutputs(NamedTuple):
    embedding: torch.Tensor
    scores: torch.Tensor


@dataclass
class Prediction:
    depth: torch.Tensor
    confidence: torch.Tensor


class ActorCritic(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.torso = nn.Linear(dim, dim)
        self.actor = nn.Linear(dim, 4)
        self.critic = nn.Linear(dim, 1)

    def forward(self, obs):
        h = self.torso(obs)
        return PolicyOutput(self.actor(h), self.critic(h).squeeze(-1), h.float())

    def heads(self, obs):
        h = self.torso(obs)
        return HeadOutputs(embedding=self.actor(h), scores=self.critic(h).float())

    def predict(self, obs):
        out = Prediction(confidence=self.critic(obs).float(), depth=self.actor(obs))
        return out


def train_actor_critic(obs, optimizer, scaler, settings):
    agent = ActorCritic(8).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        out = agent(obs)
        value_mean = out.value.mean()  # AMP004
        hidden_mean = out.hidden.mean()  # fp32: cast in forward
        logits, _, hidden = agent(obs)
        spread = logits.std() + hidden.std()  # AMP004
        heads = agent.heads(obs)
        loss = heads.embedding.var() + heads.scores.var()  # AMP004
        prediction = agent.predict(obs)
        loss = loss + prediction.depth.mean() + prediction.confidence.mean()  # AMP004
        loss = loss + settings.value.mean()  # not a record of the file
    scaler.scale(loss + value_mean + hidden_mean + spread).backward()
    scaler.step(optimizer)
    scaler.update()


# A norm held in two Sequentials after a convolution, one of them the arm of a conditional.
class ChannelsFirstNorm(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x):
        return (x - x.mean(1, keepdim=True)) * self.weight[:, None, None]  # AMP004


class DownsampleStage(nn.Module):
    def __init__(self, in_chs, out_chs):
        super().__init__()
        if in_chs != out_chs:
            self.down = nn.Sequential(nn.Conv2d(in_chs, out_chs, 2, stride=2), ChannelsFirstNorm(out_chs))
        else:
            self.down = nn.Identity()

    def forward(self, x):
        return self.down(x)


class StemAndStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 4, stride=4), ChannelsFirstNorm(16))
        self.stage = DownsampleStage(16, 32)

    def forward(self, x):
        return self.stage(self.stem(x))


def train_stem_and_stage(images, optimizer, scaler):
    net = StemAndStage().cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = net(images).float().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# Records of two calls unpacked from a literal tuple; a field handed two functions deep.
def standardize_batch(z):
    return (z - z.mean(dim=0)) / z.std(dim=0)  # AMP004 AMP004


def cross_correlation(z1, z2):
    return standardize_batch(z1).T @ standardize_batch(z2)


def train_two_views(view1, view2, optimizer, scaler):
    agent = ActorCritic(8).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        out1, out2 = agent(view1), agent(view2)
        loss = cross_correlation(out1.logits, out2.logits).float().pow(2).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# A Sequential of stages a builder function returns as lists, with a head appended after.
def conv_block_layers(c_in, c_out, pool):
    layers = [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return layers


class StagedCNN(nn.Module):
    def __init__(self, widths):
        super().__init__()
        layers, c_prev = [], 1
        for width in widths:
            layers += conv_block_layers(c_prev, width, True)
            c_prev = width
        layers.append(nn.Conv2d(c_prev, 32, 1))
        self.cnn = nn.Sequential(*layers)

    def forward(self, images):
        return self.cnn(images).mean(dim=2)  # AMP004


def train_staged_cnn(images, optimizer, scaler):
    net = StagedCNN([8, 16]).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = net(images).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# The named fields of a (values, indices) result keep the input's dtype (PointNet's pooling).
class PointPool(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv = nn.Conv1d(3, dim, 1)

    def forward(self, points):
        return self.conv(points.transpose(1, 2)).max(dim=2).values


class PointPoolIndices(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv = nn.Conv1d(3, dim, 1)

    def forward(self, points):
        return self.conv(points.transpose(1, 2)).max(dim=2).indices


def train_point_pool(points, optimizer):
    pool, argmax = PointPool(16), PointPoolIndices(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        code = pool(points)
        spread = code.std(dim=0).mean()  # AMP004
        hits = argmax(points).float().mean()
        loss = code.float().pow(2).mean() + spread.float() + 0.0 * hits
    loss.backward()
    optimizer.step()


# A model called under autocast on the mixed-precision path of ``if use_amp:`` and plainly on
# the other runs its reductions in fp16 on the first.
class SwitchedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).std(dim=0)  # AMP004


def train_switched_precision(loader, optimizer, scaler, use_amp):
    head = SwitchedHead().cuda()
    for x in loader:
        if use_amp:
            with torch.autocast("cuda", dtype=torch.float16):
                out = head(x)
        else:
            out = head(x)
        scaler.scale(out.float().mean()).backward()
        scaler.step(optimizer)
        scaler.update()


# ...while one only ever called outside autocast keeps fp32.
class PlainHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).std(dim=0)


def train_plain_precision(loader, optimizer):
    head = PlainHead().cuda()
    for x in loader:
        out = head(x)
        out.mean().backward()
        optimizer.step()


# A one-operand einsum permutes or sums: no matmul for autocast to cast.
def train_patch_targets(images, pred, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        target = torch.einsum("nchw->nhwc", images)
        target = (target - target.mean(dim=-1, keepdim=True)) / target.std(dim=-1, keepdim=True)
        loss = (pred.float() - target).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# A record of outputs handed on: a matcher reads the model's field where it is passed.
@dataclass
class SetOutput:
    logits: torch.Tensor
    boxes: torch.Tensor


class SetPredictor(nn.Module):
    def __init__(self):
        super().__init__()
        self.cls = nn.Linear(8, 4)
        self.box = nn.Linear(8, 4)

    def forward(self, x):
        return SetOutput(logits=self.cls(x), boxes=self.box(x).sigmoid())


class CostMatcher(nn.Module):
    @torch.no_grad()
    def forward(self, outputs, targets):
        return outputs.logits.sigmoid().mean(dim=-1) - targets  # AMP004


class SetLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.matcher = CostMatcher()

    def forward(self, outputs, targets):
        cost = self.matcher(outputs, targets)
        return (outputs.boxes.float() * cost.float()[..., None]).mean()


def train_set_prediction(loader, optimizer, scaler):
    model, criterion = SetPredictor().cuda(), SetLoss()
    for x, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(x)
            loss = criterion(outputs, targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# Task towers in an nn.ModuleDict built by a dict comprehension, run through .items().
class TaskTower(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.fc(x)
        return h / (h * h).mean(dim=-1, keepdim=True).add(1e-3).sqrt()  # AMP004


class MultiTaskTowers(nn.Module):
    def __init__(self, tasks, dim):
        super().__init__()
        self.towers = nn.ModuleDict({task: TaskTower(dim) for task in tasks})

    def forward(self, x):
        outputs = {}
        for task, tower in self.towers.items():
            outputs[task] = tower(x)
        return outputs


def train_multi_task(loader, optimizer, scaler):
    model = MultiTaskTowers(["ctr", "cvr"], 8).cuda()
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(x)
        loss = sum(out.float().square().mean() for out in outputs.values())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# A feature pyramid: outputs collected in a list comprehension, fused by iterating over it,
# returned as a list concatenation, and each level iterated again by the head.
class Pyramid(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(dim, dim, 1) for _ in range(3))
        self.extra = nn.Conv2d(dim, dim, 3, 2, 1)

    def forward(self, feats):
        outs = [conv(f) for conv, f in zip(self.lateral, feats)]
        fused = torch.stack([F.interpolate(o, size=outs[1].shape[-2:]) for o in outs]).mean(0)  # AMP004
        return outs + [self.extra(fused)]


class LevelAttention(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x.mean(dim=(2, 3), keepdim=True))  # AMP004


class PyramidHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention = LevelAttention()
        self.score = nn.Conv2d(dim, 1, 1)

    def forward(self, levels):
        return [self.score(self.attention(level)) for level in levels]


class PyramidDetector(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.pyramid = Pyramid(dim)
        self.head = PyramidHead(dim)

    def forward(self, feats):
        levels = self.pyramid(feats)
        return self.head(levels), [level.float().mean() for level in levels]


def train_pyramid(loader, optimizer, scaler):
    model = PyramidDetector(16).cuda()
    for feats, target in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            scores, _ = model(feats)
            loss = sum(s.float().mean() for s in scores) - target
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# A set encoder whose layers loop replaces its raw input: the pooled mean is of fp16 layers.
class SetEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, entities, mask):
        h = entities
        for layer in self.layers:
            h = F.relu(layer(h))
        keep = mask > 0
        return (h * keep[..., None]).mean(dim=1)  # AMP004


class ConditionalSetEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, entities, deep):
        h = entities
        if deep:
            for layer in self.layers:
                h = F.relu(layer(h))
        return h.mean(dim=1)


# A model's method named for its predictions runs in its forward: it is training code.
class MaskedQueryHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.embed = nn.Linear(dim, dim)

    def forward(self, queries, features):
        return self.prediction_heads(queries, features)

    def prediction_heads(self, queries, features):
        prob = torch.einsum("bqc,bchw->bqhw", self.embed(queries), features).sigmoid()
        return (prob * (prob > 0.5)).flatten(2).mean(-1)  # AMP004


def train_sets(loader, optimizer, scaler):
    encoder, conditional, head = SetEncoder(8).cuda(), ConditionalSetEncoder(8), MaskedQueryHead(8)
    for entities, mask, features in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = encoder(entities, mask).float().sum() + conditional(entities, False).sum()
            loss = loss + head(entities, features).float().sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# Reductions over values the code itself keeps in bf16 (an EMA of the weights): that choice.
@torch.no_grad()
def init_bf16_ema(model):
    return [p.detach().bfloat16().clone() for p in model.parameters()]


@torch.no_grad()
def bf16_ema_norm(ema, model, decay=0.999):
    for e, p in zip(ema, model.parameters()):
        e.lerp_(p.detach().bfloat16(), 1 - decay)
    return torch.stack([e.norm() for e in ema]).norm()


def train_with_bf16_ema(loader, optimizer):
    model = Projection(8).cuda()
    ema = init_bf16_ema(model)
    for x in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().mean()
        loss.backward()
        optimizer.step()
        print(bf16_ema_norm(ema, model))


def sorted_depths(z_coarse, z_fine):
    z_all, _ = torch.sort(torch.cat([z_coarse.half(), z_fine.half()], dim=-1), dim=-1)
    return z_all.mean(dim=-1)  # AMP004


def sorted_depths_fp32(z_coarse, z_fine):
    z_all, _ = torch.sort(torch.cat([z_coarse.float(), z_fine.float()], dim=-1), dim=-1)
    return z_all.mean(dim=-1)


# A base class's forward runs the convolutions each subclass builds and returns them in a
# list filled by appends; a multi-discriminator collects those lists in lists.
class FeatureDiscriminator(nn.Module):
    def forward(self, x):
        fmap = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
            fmap.append(x)
        return self.post(x).flatten(1), fmap


class PeriodDiscriminator(FeatureDiscriminator):
    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(1, 1, 3, padding=1) for _ in range(3))
        self.post = nn.Conv2d(1, 1, 3, padding=1)


class ScaleDiscriminator(FeatureDiscriminator):
    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(1, 1, 3, padding=1) for _ in range(3))
        self.post = nn.Conv1d(1, 1, 3, padding=1)


class MultiDiscriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.discriminators = nn.ModuleList([PeriodDiscriminator(), ScaleDiscriminator()])

    def forward(self, y, y_hat):
        scores, fmap_rs, fmap_gs = [], [], []
        for d in self.discriminators:
            score, fmap_r = d(y)
            _, fmap_g = d(y_hat)
            scores.append(score)
            fmap_rs.append(fmap_r)
            fmap_gs.append(fmap_g)
        return scores, fmap_rs, fmap_gs


def feature_matching(fmap_r, fmap_g):
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            loss += torch.mean(torch.abs(rl.detach() - gl))  # AMP004
    return loss


def feature_matching_fp32(fmap_r, fmap_g):
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            loss += torch.mean(torch.abs(rl.detach().float() - gl.float()))
    return loss


def train_vocoder_discriminators(loader, optimizer, scaler):
    mpd = MultiDiscriminator().cuda()
    for y, y_hat in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            scores, fmap_r, fmap_g = mpd(y, y_hat)
            loss = feature_matching(fmap_r, fmap_g) + feature_matching_fp32(fmap_r, fmap_g)
            loss = loss + sum(s.float().mean() for s in scores)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# Heads built by a static method of a class and called with its name; per-task outputs in dicts.
class TaskBranches(nn.Module):
    def __init__(self, dim, names):
        super().__init__()
        self.branches = nn.ModuleDict({name: self.branch(dim, 2) for name in names})

    @staticmethod
    def branch(dim, out):
        return nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.ReLU(), nn.Conv2d(dim, out, 1))

    def forward(self, x):
        return {name: branch(x) for name, branch in self.branches.items()}


class MultiTaskCenterHead(nn.Module):
    def __init__(self, dim, tasks):
        super().__init__()
        self.heatmaps = nn.ModuleList(TaskBranches.branch(dim, 1) for _ in range(tasks))
        self.boxes = nn.ModuleList(TaskBranches(dim, ["reg", "dim"]) for _ in range(tasks))

    def forward(self, x):
        heatmaps, boxes = [], []
        for heatmap, box in zip(self.heatmaps, self.boxes):
            heatmaps.append(heatmap(x))
            boxes.append(box(x))
        return heatmaps, boxes


def focal(pred, target):
    return -(pred + 1e-12).log() * target.eq(1)  # AMP011


def train_center_head(loader, optimizer, scaler):
    model = MultiTaskCenterHead(8, 2).cuda()
    for x, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            heatmaps, boxes = model(x)
            loss = sum(focal(hm.sigmoid(), t).sum() for hm, t in zip(heatmaps, targets))
            loss = loss + sum(b["reg"].mean() for b in boxes)  # AMP004
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# Stages appended to a ModuleList after it is built with the stem (unpacked from a tuple).
class GroupStatNorm(nn.Module):
    def forward(self, x):
        b, c = x.shape[:2]
        std = (x.reshape(b, 4, -1).var(dim=-1, keepdim=True) + 1e-5).sqrt()  # AMP004
        return x / std.repeat_interleave(c // 4, dim=1).reshape(b, c, 1, 1)


class StageBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, padding=1)
        self.norm = GroupStatNorm()

    def forward(self, x):
        return self.norm(self.conv(x))


def make_stages(dim, depths):
    stages, width = nn.ModuleList([nn.Sequential(nn.Conv2d(3, dim, 3), nn.SiLU())]), dim
    for depth in depths:
        stages.append(nn.Sequential(*[StageBlock(width) for _ in range(depth)]))
    return stages


class StagedBackbone(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.stages = make_stages(dim, (1, 2))

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x


def train_staged(loader, optimizer, scaler):
    model = StagedBackbone(8).cuda()
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# A flow's layers collected in a list and handed to a container class of the file.
class FeatureStandardise(nn.Module):
    def forward(self, h):
        return (h - h.mean(-1, keepdim=True)) / 4.0  # AMP004


class FlowStep(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.Linear(dim, dim)
        self.norm = FeatureStandardise()

    def forward(self, x):
        return x + self.norm(self.net(x))


class FlowChain(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.chain = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.chain:
            x = layer(x)
        return x


def build_chain(dim, blocks):
    layers = [FlowStep(dim)]
    for _ in range(blocks):
        layers += [FlowStep(dim)]
    return FlowChain(layers)


def train_chain(loader, optimizer, scaler):
    model = build_chain(8, 2).cuda()
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# Patches taken with unfold keep the convolution's dtype.
class PatchVariance(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x):
        g = self.conv(x)
        return g.unfold(2, 4, 4).unfold(3, 4, 4).flatten(-2).var(dim=-1)  # AMP004


def train_patch_variance(loader, optimizer, scaler):
    model = PatchVariance().cuda()
    for x in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
