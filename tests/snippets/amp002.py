# AMP002 loss-outside-autocast: a loss computed after the autocast block on its outputs.
import contextlib
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import functional as TF

from losses import build_loss, focal_loss

scaler = torch.amp.GradScaler("cuda")
criterion = nn.CrossEntropyLoss()
ctx = nullcontext() if torch.cuda.is_available() else torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)


# ---- positives --------------------------------------------------------------------


def classic_criterion_after_block(model, images, target):
    with torch.autocast("cuda", dtype=torch.float16):
        output = model(images)
    loss = criterion(output, target)  # AMP002
    scaler.scale(loss).backward()


def functional_after_block(model, x, y):
    with torch.autocast("cuda"):
        logits = model(x)
    return F.cross_entropy(logits, y)  # AMP002


def mse_after_block(model, x, y):
    with torch.amp.autocast("cuda"):
        pred = model(x)
    return F.mse_loss(pred, y)  # AMP002


class Trainer:
    def __init__(self, model):
        self.model = model
        self.loss_fn = nn.SmoothL1Loss()

    def train_step(self, x, y):
        with torch.autocast("cuda"):
            pred = self.model(x)
        return self.loss_fn(pred, y)  # AMP002


def tuple_unpacked_outputs(model, x, y):
    with torch.autocast("cuda"):
        logits, aux = model(x)
    return F.cross_entropy(logits, y) + 0.4 * F.cross_entropy(aux, y)  # AMP002


def indexed_output(model, x, y):
    with torch.autocast("cuda"):
        out = model(x)
    return criterion(out[0], y)  # AMP002


def attribute_and_view(model, batch, labels):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outputs = model(**batch)
    return F.cross_entropy(outputs.logits.view(-1, outputs.logits.size(-1)), labels.view(-1))  # AMP002


def nanogpt_ctx_then_loss(model, x, y):
    with ctx:
        logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))  # AMP002


def timm_partial_then_loss(model, x, y):
    amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)
    with amp_autocast():
        output = model(x)
    loss = criterion(output, y)  # AMP002
    return loss


def functional_module_alias(model, x, y):
    with torch.autocast("cuda"):
        log_probs = model(x)
    return TF.nll_loss(log_probs, y)  # AMP002


def kl_divergence(student, teacher, x):
    with torch.autocast("cuda"):
        s = student(x)
        t = teacher(x)
    return F.kl_div(s, t, reduction="batchmean")  # AMP002


def logits_loss_module(model, x, y):
    loss_fn = nn.BCEWithLogitsLoss()
    with torch.autocast("cuda"):
        logits = model(x)
    return loss_fn(logits, y)  # AMP002


def matmul_output(x, w, y):
    with torch.autocast("cuda"):
        logits = x @ w
    return F.cross_entropy(logits, y)  # AMP002


def full_torch_path(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = model(x)
    return torch.nn.functional.smooth_l1_loss(pred, y)  # AMP002


def keyword_arguments(model, x, y):
    with torch.autocast("cuda"):
        scores = model(x)
    return criterion(input=scores, target=y)  # AMP002


def flag_enabled_region(model, x, y, use_amp):
    with torch.autocast("cuda", enabled=use_amp):
        out = model(x)
    return F.l1_loss(out, y)  # AMP002


def accelerator_region(accelerator, model, x, y):
    with accelerator.autocast():
        out = model(x)
    return F.mse_loss(out, y)  # AMP002


def loss_module_moved_to_device(model, x, y, device):
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1).to(device)
    with torch.autocast("cuda"):
        logits = model(x)
    return loss_fn(logits, y)  # AMP002


def reshaped_after_block(model, x, y):
    with torch.autocast("cuda"):
        output = model(x)
    output = output.view(-1, output.size(-1))
    return F.cross_entropy(output, y.view(-1))  # AMP002


def wrapped_models(net, x, y, rank):
    ddp_model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[rank])
    compiled = torch.compile(net)
    with torch.autocast("cuda"):
        a = ddp_model(x)
        b = compiled(x)
    return F.cross_entropy(a, y) + F.cross_entropy(b, y)  # AMP002



def prediction_keyword_after_target(model, x, y):
    with torch.autocast("cuda"):
        scores = model(x)
    return criterion(target=y, input=scores)  # AMP002



def upcast_only_on_one_path(model, x, y, debug):
    with torch.autocast("cuda"):
        out = model(x)
    if debug:
        out = out.float()
    return criterion(out, y)  # AMP002



@torch.autocast("cuda", dtype=torch.float16)
def forward_under_autocast(model, x):
    return model(x)


def loss_on_decorated_forward(model, x, y):
    logits = forward_under_autocast(model, x)
    return F.cross_entropy(logits, y)  # AMP002



def project_prepare_function(net, x, y, prepare_model):
    model = prepare_model(net)
    with torch.autocast("cuda"):
        out = model(x)
    return F.cross_entropy(out, y)  # AMP002


# ---- negatives --------------------------------------------------------------------


def loss_inside_block(model, images, target):
    with torch.autocast("cuda"):
        output = model(images)
        loss = criterion(output, target)
    scaler.scale(loss).backward()


def upcast_in_argument(model, x, y):
    with torch.autocast("cuda"):
        logits = model(x)
    return F.cross_entropy(logits.float(), y)


def upcast_reassigned(model, x, y):
    with torch.autocast("cuda"):
        logits = model(x)
    logits = logits.float()
    return F.cross_entropy(logits, y)


def upcast_with_to(model, x, y):
    with torch.autocast("cuda"):
        logits = model(x)
    return F.cross_entropy(logits.to(torch.float32), y)


def hf_loss_from_forward(model, batch, accum_steps):
    with torch.autocast("cuda"):
        outputs = model(**batch)
        loss = outputs.loss
    loss = loss / accum_steps
    scaler.scale(loss).backward()
    return loss.item()


def loss_dict_from_forward(model, data):
    with torch.autocast("cuda"):
        loss_dict = model(data)
    losses = sum(loss for loss in loss_dict.values())
    scaler.scale(losses).backward()


def logits_and_loss_from_forward(model, x, y, accum_steps):
    with ctx:
        logits, loss = model(x, y)
        loss = loss / accum_steps
    scaler.scale(loss).backward()
    return logits


def targets_moved_in_region(model, x, y, device):
    with torch.autocast("cuda"):
        out = model(x)
        y = y.to(device, non_blocking=True)
    return F.cross_entropy(out.float(), y)


def plain_fp32(model, x, y):
    out = model(x)
    return criterion(out, y)


def disabled_island_outputs(model, x, y):
    with torch.autocast("cuda", enabled=False):
        out = model(x)
    return criterion(out, y)


def ctx_is_not_autocast(model, x, y):
    ctx = model.no_sync
    with ctx():
        out = model(x)
    return criterion(out, y)


def _compute_loss(out, y):
    return F.cross_entropy(out, y)


def helper_called_in_region(model, x, y):
    with torch.autocast("cuda"):
        out = model(x)
        loss = _compute_loss(out, y)
    return loss


def loss_on_parameters(logits, y):
    return F.cross_entropy(logits, y)


def softmax_probs_are_fp32(model, x, y):
    with torch.autocast("cuda"):
        probs = F.softmax(model(x), dim=-1)
    return F.nll_loss(torch.log(probs), y)


def metrics_after_block(model, x, y):
    with torch.autocast("cuda"):
        out = model(x)
        loss = criterion(out, y)
    accuracy = (out.argmax(-1) == y).float().mean()
    return loss, accuracy


def suppress_region(model, x, y):
    with contextlib.suppress(KeyError):
        out = model(x)
    return criterion(out, y)


def second_region_for_loss(model, x, y):
    with torch.autocast("cuda"):
        out = model(x)
    with torch.autocast("cuda"):
        loss = criterion(out, y)
    return loss


def loss_module_built_in_region(model, x, y):
    with torch.autocast("cuda"):
        loss_fn = nn.CrossEntropyLoss()
        out = model(x).float()
    return loss_fn(out, y)


def reshaped_and_upcast_after_block(model, x, y):
    with torch.autocast("cuda"):
        output = model(x)
    output = output.view(-1, output.size(-1)).float()
    return F.cross_entropy(output, y.view(-1))


def library_outputs_after_block(x, y, weight):
    with torch.autocast("cuda"):
        scores = torch.cat([x, y], dim=-1)
        per_item = nn.CrossEntropyLoss(reduction="none")(scores.float(), y)
    return F.mse_loss(per_item, torch.zeros_like(per_item)) + F.mse_loss(scores, weight)


def targets_made_in_region_prediction_upcast(model, scheduler, latents, noise, t):
    with torch.autocast("cuda", dtype=torch.float16):
        target = scheduler.get_velocity(latents, noise, t)
        pred = model(latents, t)
    return F.mse_loss(pred.float(), target)


def fresh_fp32_forward_for_logging(model, loader, optimizer):
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cuda"):
            out = model(x)
            loss = criterion(out, y)
        scaler.scale(loss).backward()
        if step % 100 == 0:
            with torch.no_grad():
                out = model(x)
            print(criterion(out, y).item())


@torch.autocast("cuda", dtype=torch.float16)
def forward_upcast_under_autocast(model, x):
    return model(x).float()


def loss_on_decorated_upcast_forward(model, x, y):
    logits = forward_upcast_under_autocast(model, x)
    return F.cross_entropy(logits, y)


def accelerate_prepared_model_returns_fp32(accelerator, model, optimizer, batch):
    model, optimizer = accelerator.prepare(model, optimizer)
    with accelerator.autocast():
        logits = model(batch["x"])
    return F.cross_entropy(logits, batch["y"])


def fabric_module_returns_fp32(fabric, model, x, y):
    model = fabric.setup(model)
    with fabric.autocast():
        out = model(x)
    return F.mse_loss(out, y)


# ---- losses by what they compute, predictions traced through computations ---------


class TripletLoss:
    def __init__(self, margin):
        self.ranking = nn.MarginRankingLoss(margin=margin)

    def __call__(self, anchor, positive, negative):
        d_ap = (anchor - positive).pow(2).sum(1)
        d_an = (anchor - negative).pow(2).sum(1)
        return self.ranking(d_an, d_ap, torch.ones_like(d_an))


class LabelSmoothing(nn.Module):
    def forward(self, logits, target):
        log_probs = logits.log_softmax(dim=-1)
        return -log_probs.gather(-1, target[:, None]).mean()


class UpcastingSmoothing(nn.Module):
    def forward(self, logits, target):
        log_probs = logits.float().log_softmax(dim=-1)
        return -log_probs.gather(-1, target[:, None]).mean()


def info_nce(query, keys, temperature):
    logits = query @ keys.t() / temperature
    return -logits.diagonal().sum() / query.size(0)


def top1_accuracy(output, target):
    return (output.argmax(-1) == target).float().sum() * 100.0 / target.size(0)


class IssueShapes:
    def __init__(self, model):
        self.model = model
        self.triplet = TripletLoss(0.3)
        self.smooth = LabelSmoothing()
        self.upcast_smooth = UpcastingSmoothing()

    def triplet_outside(self, x1, x2, x3):
        with torch.autocast("cuda"):
            a, p, n = self.model(x1), self.model(x2), self.model(x3)
        loss = self.triplet(a, p, n)  # AMP002
        scaler.scale(loss).backward()

    def local_module_computing_a_mean(self, x, y):
        with torch.autocast("cuda"):
            logits = self.model(x)
        loss = self.smooth(logits, y)  # AMP002
        scaler.scale(loss).backward()

    def local_module_that_upcasts(self, x, y):
        with torch.autocast("cuda"):
            logits = self.model(x)
        loss = self.upcast_smooth(logits, y)
        scaler.scale(loss).backward()


def keyword_input(model, x, y):
    with torch.autocast("cuda"):
        logits = model(x)
    return F.cross_entropy(input=logits, target=y)  # AMP002


def ctc_on_log_probs_made_after_block(model, feats, targets, in_lens, tgt_lens):
    with torch.autocast("cuda"):
        logits = model(feats)
    log_probs = logits.log_softmax(dim=2).transpose(0, 1)
    return F.ctc_loss(log_probs, targets, in_lens, tgt_lens)  # AMP002


def distillation_temperature(student, teacher, x, T):
    with torch.autocast("cuda"):
        s = student(x)
        t = teacher(x)
    return F.kl_div(F.log_softmax(s / T, dim=1), F.softmax(t / T, dim=1)) * T * T  # AMP002


def criterion_parameter(model, x, y, criterion):
    with torch.autocast("cuda"):
        out = model(x)
    loss = criterion(out, y)  # AMP002
    scaler.scale(loss).backward()


def local_objective_backpropagated(model, q, k):
    with torch.autocast("cuda"):
        zq = model(q)
        zk = model(k)
    loss = info_nce(zq, zk, 0.07)  # AMP002
    scaler.scale(loss).backward()


def deep_supervision_outputs(model, x, y):
    with torch.autocast("cuda"):
        outs = model(x)
    loss = sum(F.mse_loss(o, y) for o in outs)  # AMP002
    scaler.scale(loss).backward()


def sigmoid_then_bce_outside(model, x, y):
    with torch.autocast("cuda"):
        logits = model(x)
    return F.binary_cross_entropy(torch.sigmoid(logits), y)  # AMP002


def accuracy_metric_is_not_a_loss(model, x, y):
    with torch.autocast("cuda"):
        out = model(x)
        loss = criterion(out, y)
    acc = top1_accuracy(out, y)
    scaler.scale(loss).backward()
    return acc


def local_objective_not_backpropagated(model, q, k):
    with torch.no_grad(), torch.autocast("cuda"):
        zq = model(q)
        zk = model(k)
    return info_nce(zq, zk, 0.07).item()


def loss_scaler_takes_the_loss(model, x, y, optimizer, loss_scaler):
    with torch.autocast("cuda"):
        loss = criterion(model(x), y)
    loss_scaler(loss, optimizer)


def losses_summed_after_block(model, data, parse_losses):
    with torch.autocast("cuda"):
        losses = model(data)
    total_loss = parse_losses(losses)
    scaler.scale(total_loss).backward()


def upcast_before_resize(model, x, y):
    with torch.autocast("cuda"):
        pred = model(x)
    pred = F.interpolate(pred.float(), size=y.shape[-2:])
    return F.l1_loss(pred, y)


def criterion_on_upcast_outputs(model, x, y, criterion):
    with torch.autocast("cuda"):
        out = model(x)
    loss = criterion(out.float(), y)
    scaler.scale(loss).backward()


def reconstruction_loss(images, pred, mask):
    target = images.flatten(2)
    return ((pred - target) ** 2 * mask).sum() / mask.sum()


def prediction_in_second_position(model, images):
    with torch.autocast("cuda"):
        pred, mask = model(images)
    loss = reconstruction_loss(images, pred, mask)  # AMP002
    scaler.scale(loss).backward()


def some_inputs_upcast_by_the_caller(model, images, texts):
    with torch.autocast("cuda"):
        img, txt, scale = model(images, texts)
    loss = info_nce(img.float(), txt.float(), scale)
    scaler.scale(loss).backward()


def _update_losses(outputs, losses):
    losses.setdefault("count", 0)
    losses["count"] += len(outputs)
    return outputs, losses


def helper_named_for_losses_records_them(model, batch, history):
    with torch.no_grad(), torch.autocast("cuda"):
        outputs = model(batch)
    outputs, history = _update_losses(outputs, history)
    return outputs


def loss_handed_to_a_scaler_helper(model, images, optimizer, loss_scaler):
    with torch.autocast("cuda"):
        pred, mask = model(images)
    loss = reconstruction_loss(images, pred, mask)  # AMP002
    loss_scaler(loss, optimizer)


class LossFromABuilder:
    def __init__(self, model, cfg):
        self.model = model
        self.loss = build_loss(cfg)

    def step(self, x, y):
        with torch.autocast("cuda"):
            out = self.model(x)
        loss = self.loss(out, y)  # AMP002
        scaler.scale(loss).backward()


def imported_loss_function(model, x, y):
    with torch.autocast("cuda"):
        logits = model(x)
    loss = focal_loss(logits, y)  # AMP002
    scaler.scale(loss).backward()


def _spectrum(x):
    return torch.stft(x.float(), 512, return_complex=True).abs()


def spectral_loss(pred, target):
    return (_spectrum(pred) - _spectrum(target)).abs().mean()


def helper_upcasts_one_level_deeper(model, noisy, clean):
    with torch.autocast("cuda"):
        enhanced = model(noisy)
    loss = spectral_loss(enhanced, clean)
    scaler.scale(loss).backward()


# ---- scores assembled from several forward outputs -----------------------------------
def hard_negative_loss(model, users, items, negatives, target):
    with torch.autocast("cuda", dtype=torch.float16):
        u, pos = model(users), model(items)
        neg = model(negatives)
    scores = torch.cat([(u * pos).sum(-1, keepdim=True), u @ neg.T], dim=1) / 0.05
    loss = F.cross_entropy(input=scores, target=target)  # AMP002
    loss.backward()


def hard_negative_loss_upcast(model, users, items, negatives, target):
    with torch.autocast("cuda", dtype=torch.float16):
        u, pos = model(users), model(items)
        neg = model(negatives)
    scores = torch.cat([(u * pos).sum(-1, keepdim=True), u @ neg.T], dim=1).float() / 0.05
    loss = F.cross_entropy(input=scores, target=target)
    loss.backward()


def contrastive_objective(img, txt, scale):
    img, txt = img.float(), txt.float()
    logits = scale * img @ txt.t()
    labels = torch.arange(len(img), device=img.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def contrastive_step_upcast_inside(model, images, tokens):
    """The objective upcasts the embeddings and leaves the scalar temperature alone."""
    with torch.autocast("cuda", dtype=torch.float16):
        img, txt, scale = model(images, tokens)
    loss = contrastive_objective(img, txt, scale)
    scaler.scale(loss).backward()


def dice_and_bce(pred, target):
    return 0.5 * F.binary_cross_entropy_with_logits(pred, target) + 0.5 * (1 - (pred.sigmoid() * target).mean())


def deep_supervision_generator(model, images, masks):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        side_outputs = model(images)
    loss = sum(dice_and_bce(p, masks) for p in side_outputs) / len(side_outputs)  # AMP002
    loss.backward()


def deep_supervision_list(model, images, masks):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        side_outputs = model(images)
    loss = sum([F.mse_loss(p, masks) for p in side_outputs])  # AMP002
    loss.backward()


def deep_supervision_inside_region(model, images, masks):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        side_outputs = model(images)
        loss = sum(dice_and_bce(p, masks) for p in side_outputs) / len(side_outputs)
    loss.backward()


def deep_supervision_upcast(model, images, masks):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        side_outputs = model(images)
    loss = sum(dice_and_bce(p.float(), masks) for p in side_outputs)
    loss.backward()


def deep_supervision_metrics(model, images, masks):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        side_outputs = model(images)
        loss = F.mse_loss(side_outputs[0], masks)
    scores = [dice_and_bce(p, masks) for p in side_outputs]
    loss.backward()
    return scores


# ---- a criterion of this module returning a dict of losses (DETR's SetCriterion) --------
class SetCriterion(nn.Module):
    def single(self, outputs, targets):
        loss_ce = F.cross_entropy(outputs["pred_logits"].transpose(1, 2), targets["labels"])
        loss_bbox = F.l1_loss(outputs["pred_boxes"], targets["boxes"])
        return {"loss_ce": loss_ce, "loss_bbox": loss_bbox}

    def forward(self, outputs, targets):
        losses = self.single(outputs, targets)
        for i, aux in enumerate(outputs["aux_outputs"]):
            losses.update({f"{k}_{i}": v for k, v in self.single(aux, targets).items()})
        return losses


class RunningMetrics(nn.Module):
    def forward(self, outputs, targets):
        correct = (outputs["pred_logits"].argmax(-1) == targets["labels"]).float()
        return {"accuracy": correct.mean(), "box_error": (outputs["pred_boxes"] - targets["boxes"]).abs().mean()}


def detr_epoch(model, loader, optimizer, weight_dict):
    criterion = SetCriterion()
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
        loss_dict = criterion(outputs, targets)  # AMP002
        losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict)
        losses.backward()
        optimizer.step()


@torch.no_grad()
def detr_evaluate(model, loader):
    criterion = SetCriterion()
    totals = []
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
        loss_dict = criterion(outputs, targets)  # AMP002
        totals.append({k: v.item() for k, v in loss_dict.items()})
    return totals


@torch.no_grad()
def detr_metrics(model, loader):
    metrics = RunningMetrics()
    totals = []
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
        totals.append({k: v.item() for k, v in metrics(outputs, targets).items()})
    return totals


# ---- a loss of this module whose reduction is a helper with a per-dim branch -------------
def masked_mean(x, mask, dim=None):
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def ppo_policy_loss(logits, responses, old_logprobs, advantages, mask, cliprange):
    logprobs = torch.gather(F.log_softmax(logits, dim=-1), 2, responses.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logprobs - old_logprobs)
    pg_losses = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange))
    return masked_mean(pg_losses, mask), masked_mean((logprobs - old_logprobs) ** 2, mask)


def masked_agreement(logits, responses, mask):
    return masked_mean((logits.argmax(-1) == responses).float(), mask)


def ppo_update(policy, batch, optimizer, temperature):
    with torch.autocast("cuda", dtype=torch.float16):
        logits = policy(batch["seq"])
    logits = logits / temperature
    pg_loss, approx_kl = ppo_policy_loss(logits, batch["responses"], batch["logprobs"], batch["advantages"], batch["mask"], 0.2)  # AMP002
    agreement = masked_agreement(logits, batch["responses"], batch["mask"])
    pg_loss.backward()
    optimizer.step()
    return approx_kl.item(), agreement.item()


# ---- autocast or a context class of the file that does nothing (nnU-Net's dummy_context) --
class dummy_context(object):
    def __enter__(self):
        pass

    def __exit__(self, exc_type, exc_val, exc_tb):
        pass


class RecordingContext:
    def __enter__(self):
        torch.cuda.nvtx.range_push("step")

    def __exit__(self, *exc):
        torch.cuda.nvtx.range_pop()


@torch.no_grad()
def nnunet_validation_step(network, loss, data, target, device):
    with torch.autocast(device.type, enabled=True) if device.type == "cuda" else dummy_context():
        output = network(data)
    return loss(output, target)  # AMP002


@torch.no_grad()
def recorded_validation_step(network, loss, data, target, device):
    with torch.autocast(device.type, enabled=True) if device.type == "cuda" else RecordingContext():
        output = network(data)
    return loss(output, target)


# ---- a deep-supervision wrapper kept as self.loss, built by a method --------------------
class DeepSupervisionLossWrapper(nn.Module):
    def __init__(self, loss, weights):
        super().__init__()
        self.loss, self.weights = loss, weights

    def forward(self, *args):
        return sum([self.weights[i] * self.loss(*inputs) for i, inputs in enumerate(zip(*args))])


class SegValidator:
    def __init__(self, network):
        self.network = network
        self.loss = self._build_loss()

    def _build_loss(self):
        return DeepSupervisionLossWrapper(nn.CrossEntropyLoss(), [1.0, 0.5])

    @torch.no_grad()
    def validation_step(self, data, target):
        with torch.autocast("cuda", dtype=torch.float16):
            output = self.network(data)
        return self.loss(output, target)  # AMP002

    @torch.no_grad()
    def validation_step_upcast(self, data, target):
        with torch.autocast("cuda", dtype=torch.float16):
            output = self.network(data)
        return self.loss([o.float() for o in output], target)


# ---- a distance whose prediction comes second; a model passed through an init helper ------
def init_weights(net, gain=0.02):
    net.apply(lambda m: None)
    return net


def diffusion_step(model, audio, t, optimizer):
    noise = torch.randn_like(audio)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        predicted = model(audio + noise, t)
    loss = F.l1_loss(noise, predicted.squeeze(1))  # AMP002
    loss.backward()
    optimizer.step()


def diffusion_step_upcast_first(model, audio, t, optimizer, scheduler):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        target = scheduler.get_velocity(audio, t)
        predicted = model(audio, t)
    F.mse_loss(predicted.float(), target).backward()
    optimizer.step()


# ---- a loss of this module that upcasts slices of its input in a helper --------------------
def si_snr(est, ref):
    est, ref = est.float(), ref.float()
    proj = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + 1e-8)
    return 10 * torch.log10(proj.pow(2).sum(-1) / ((est - proj).pow(2).sum(-1) + 1e-8))


def pit_si_snr_loss(est, ref):
    scores = torch.stack([si_snr(est[:, i], ref[:, j]) for i, j in ((0, 1), (1, 0))], -1)
    return -scores.max(dim=-1)[0].mean()


@torch.no_grad()
def separation_validate(model, loader):
    total = 0.0
    for mix, sources in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            est = model(mix)
        total += -pit_si_snr_loss(est, sources).item()
    return total


# ---- a distance of einsum scores computed from the region's outputs after the block -------
def train_margin_distillation(model, batch, teacher_margin, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        q_emb = model(batch["query"])
        d_emb = model(batch["doc"])
    margin = torch.einsum("bd,bd->b", q_emb, d_emb)
    loss = F.mse_loss(margin, teacher_margin)  # AMP002
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def train_margin_distillation_upcast(model, batch, teacher_margin, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        q_emb = model(batch["query"])
        d_emb = model(batch["doc"])
    margin = torch.einsum("bd,bd->b", q_emb.float(), d_emb.float())
    loss = F.mse_loss(margin, teacher_margin)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# A loss of this module that upcasts the labels only to resize them (and makes them
# integers again) has chosen no precision for the prediction; one upcasting the prediction has.
def deep_supervision_loss(aux_logits, target, criterion):
    total = 0.0
    for logits in aux_logits:
        t = F.interpolate(target[:, None].float(), size=logits.shape[2:])[:, 0].long()
        total = total + criterion(logits, t)
    return total


def upcast_deep_supervision_loss(aux_logits, target, criterion):
    return sum(criterion(logits.float(), target) for logits in aux_logits)


def train_with_deep_supervision(model, images, seg, optimizer, scaler):
    criterion = nn.CrossEntropyLoss()
    with torch.autocast("cuda", dtype=torch.float16):
        aux = model(images)
    loss = deep_supervision_loss(aux, seg, criterion)  # AMP002
    loss = loss + upcast_deep_supervision_loss(aux, seg, criterion)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# A criterion returning a dict comprehension of weighted losses is a loss in evaluation too.
class WeightedCriterion(nn.Module):
    def __init__(self, weights):
        super().__init__()
        self.ce = nn.CrossEntropyLoss()
        self.weights = weights

    def forward(self, outputs, targets):
        losses = {"cls": self.ce(outputs["cls"], targets["cls"])}
        losses["aux"] = self.ce(outputs["aux"], targets["aux"])
        return {k: self.weights.get(k, 1.0) * v for k, v in losses.items()}


@torch.no_grad()
def evaluate_multitask(model, criterion: WeightedCriterion, loader):
    total = 0.0
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
        loss_dict = criterion(outputs, targets)  # AMP002
        total += sum(v.item() for v in loss_dict.values())
    return total


@torch.no_grad()
def evaluate_multitask_in_region(model, criterion: WeightedCriterion, loader):
    total = 0.0
    for images, targets in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(images)
            loss_dict = criterion(outputs, targets)
        total += sum(v.item() for v in loss_dict.values())
    return total


# Losses summed term by term (HiFi-GAN's feature and generator losses).
def feature_matching_loss(fmap_r, fmap_g):
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            loss += torch.mean(torch.abs(rl - gl))
    return loss * 2


def running_count(values):
    count = 0
    for value in values:
        count += len(value)
    return count


def train_vocoder_generator(mpd, generator, mel, y, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        y_hat = generator(mel)
        _, fmap_r = mpd(y)
        _, fmap_g = mpd(y_hat)
    loss = feature_matching_loss(fmap_r, fmap_g)  # AMP002
    loss = loss + running_count(fmap_g) * 0.0
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


# ---- the prediction passed by its own keyword (CTC, ranking, triplet, a loss of the file) ----
ctc_criterion = nn.CTCLoss(zero_infinity=True)


def ctc_loss_by_keywords(model, feats, labels, out_lens, label_lens):
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(feats)
    log_probs = logits.log_softmax(dim=-1).transpose(0, 1)
    loss = F.ctc_loss(log_probs=log_probs, targets=labels, input_lengths=out_lens, target_lengths=label_lens)  # AMP002
    loss = loss + ctc_criterion(log_probs=log_probs, targets=labels, input_lengths=out_lens, target_lengths=label_lens)  # AMP002
    scaler.scale(loss).backward()


def ctc_loss_by_keywords_upcast(model, feats, labels, out_lens, label_lens):
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(feats)
    log_probs = logits.float().log_softmax(dim=-1).transpose(0, 1)
    loss = F.ctc_loss(log_probs=log_probs, targets=labels, input_lengths=out_lens, target_lengths=label_lens)
    scaler.scale(loss).backward()


def ranking_losses_by_keywords(model, a, p, n, y):
    with torch.autocast("cuda", dtype=torch.float16):
        anchor, positive, negative = model(a), model(p), model(n)
    loss = F.triplet_margin_loss(anchor=anchor, positive=positive, negative=negative)  # AMP002
    loss = loss + F.margin_ranking_loss(input1=anchor.sum(-1), input2=positive.sum(-1), target=y)  # AMP002
    scaler.scale(loss).backward()


def reconstruction_loss(recon, target, mu, logvar):
    kld = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
    return F.mse_loss(recon, target) + kld


def reconstruction_loss_in_fp32(recon, target, mu, logvar):
    recon, mu, logvar = recon.float(), mu.float(), logvar.float()
    kld = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
    return F.mse_loss(recon, target) + kld


def file_loss_by_keywords(model, x):
    with torch.autocast("cuda", dtype=torch.float16):
        recon, mu, logvar = model(x)
    loss = reconstruction_loss(recon=recon, target=x, mu=mu, logvar=logvar)  # AMP002
    scaler.scale(loss).backward()


def file_loss_by_keywords_upcasting_itself(model, x):
    with torch.autocast("cuda", dtype=torch.float16):
        recon, mu, logvar = model(x)
    loss = reconstruction_loss_in_fp32(recon=recon, target=x, mu=mu, logvar=logvar)
    scaler.scale(loss).backward()


def keyword_target_made_in_region(model, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        pred = model(x)
        target = model(y).detach()
    loss = F.mse_loss(input=pred.float(), target=target.float())
    scaler.scale(loss).backward()


# ---- a forward run through activation checkpointing ----------------------------------
def checkpointed_forward_loss_after_block(model, x, y, optimizer):
    from torch.utils.checkpoint import checkpoint_sequential
    with torch.autocast("cuda", dtype=torch.float16):
        out = checkpoint_sequential(model, 4, x, use_reentrant=False)
    loss = F.mse_loss(out, y)  # AMP002
    scaler.scale(loss).backward()


def checkpointed_block_loss_after_block(block, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    loss = F.cross_entropy(out, y)  # AMP002
    scaler.scale(loss).backward()


def checkpointed_forward_upcast(model, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        out = torch.utils.checkpoint.checkpoint_sequential(model, 4, x, use_reentrant=False)
    loss = F.mse_loss(out.float(), y)
    scaler.scale(loss).backward()


def checkpointed_forward_loss_in_block(model, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        loss = F.mse_loss(out, y)
    scaler.scale(loss).backward()
