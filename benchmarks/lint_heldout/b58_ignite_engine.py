"""Multi-label attribute classifier (CelebA) trained with PyTorch-Ignite.

The default trainer comes from ``create_supervised_trainer(amp_mode="amp",
scaler=True)``, where Ignite owns the GradScaler.  ``--step`` selects one of the
hand-written process functions below instead; event handlers add an
orthogonality regulariser, checkpointing, early stopping and LR scheduling.
"""
import argparse
import copy
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from ignite.engine import Engine, Events, create_supervised_evaluator, create_supervised_trainer
from ignite.handlers import EarlyStopping, ModelCheckpoint
from ignite.handlers.param_scheduler import LRScheduler
from ignite.metrics import Loss, MultiLabelConfusionMatrix, RunningAverage


class MultiLabelNet(nn.Module):
    def __init__(self, num_attrs=40, width=64):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, 2, 1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, 2, 1), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(2 * width, num_attrs)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def focal_loss(logits, targets, alpha=0.25, gamma=2.0):
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss.mean()


def ortho_penalty(model):
    total = 0.0
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            w = m.weight.flatten(1)
            gram = w @ w.t()
            eye = torch.eye(gram.size(0), device=gram.device, dtype=gram.dtype)
            total = total + (gram - eye).pow(2).sum()
    return total


def prepare_batch(batch, device, non_blocking=True):
    x, y = batch
    return x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking).float()


def recalibrate_head(model, loader, device, steps=200):
    """Re-fit the classifier on a class-balanced subset with the backbone frozen."""
    backbone = model.features.eval().requires_grad_(False)
    head = copy.deepcopy(model.classifier).half()  # expect: AMP001
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)  # expect: AMP011
    for _, batch in zip(range(steps), loader):
        x, y = prepare_batch(batch, device)
        with torch.no_grad():
            feats = backbone(x).flatten(1).half()
        loss = F.binary_cross_entropy_with_logits(head(feats).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.classifier.load_state_dict({k: v.float() for k, v in head.state_dict().items()})


def make_linear_probe_trainer(backbone, num_attrs, loss_fn, device):
    head = nn.Linear(128, num_attrs).to(device)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    backbone.eval().requires_grad_(False)

    def probe_step(engine, batch):
        x, y = prepare_batch(batch, device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            feats = backbone.features(x).flatten(1)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            loss = loss_fn(head(feats), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    return Engine(probe_step), head


def run(args, train_loader, val_loader, unlabeled_loader=None):
    device = "cuda"
    model = MultiLabelNet(num_attrs=args.num_attrs).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    criterion = nn.BCEWithLogitsLoss()
    prob_criterion = nn.BCELoss()
    scaler = torch.amp.GradScaler("cuda")
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()
    amp_scaler = torch.amp.GradScaler("cuda") if args.amp else None

    def train_step(engine, batch):
        model.train()
        x, y = prepare_batch(batch, device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
            loss = criterion(logits, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        return {"loss": loss.item(), "scale": scaler.get_scale()}

    def train_step_accum(engine, batch):
        model.train()
        x, y = prepare_batch(batch, device)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(model(x), y) / args.accum
        scaler.scale(loss).backward()
        if engine.state.iteration % args.accum == 0:
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.item() * args.accum}

    def train_step_generic(engine, batch):
        model.train()
        x, y = prepare_batch(batch, device)
        optimizer.zero_grad(set_to_none=True)
        with amp_ctx:
            loss = criterion(model(x), y)
        if amp_scaler is not None:
            amp_scaler.scale(loss).backward()
            amp_scaler.step(optimizer)
            amp_scaler.update()
        else:
            loss.backward()
        optimizer.step()  # expect: AMP006
        return {"loss": loss.item()}

    def train_step_probs(engine, batch):
        model.train()
        x, y = prepare_batch(batch, device)
        with torch.autocast("cuda", dtype=torch.float16):
            probs = torch.sigmoid(model(x))
            loss = prob_criterion(probs, y)  # expect: AMP003
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        return {"loss": loss.item()}

    def train_step_focal(engine, batch):
        model.train()
        x, y = prepare_batch(batch, device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        if args.focal_fp32:
            loss = focal_loss(logits.float(), y)
        else:
            loss = focal_loss(logits, y)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return {"loss": loss.item()}

    def train_step_semi(engine, batch):
        model.train()
        (xl, yl), xu = prepare_batch(batch[0], device), batch[1].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss_sup = criterion(model(xl), yl)
            pu = torch.sigmoid(model(xu))
            ent = -(pu * torch.log(pu + 1e-8) + (1 - pu) * torch.log(1 - pu + 1e-8))  # expect: AMP011
            loss = loss_sup + args.ent_coef * ent.float().sum(dim=1).mean()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return {"loss": loss.item()}

    steps = {
        "manual": train_step,
        "accum": train_step_accum,
        "generic": train_step_generic,
        "probs": train_step_probs,
        "focal": train_step_focal,
        "semi": train_step_semi,
    }
    if args.step == "ignite":
        trainer = create_supervised_trainer(model, optimizer, criterion, device=device, prepare_batch=prepare_batch,
                                            amp_mode="amp", scaler=True, gradient_accumulation_steps=args.accum,
                                            output_transform=lambda x, y, y_pred, loss: {"loss": loss.item()})
    else:
        trainer = Engine(steps[args.step])
    RunningAverage(output_transform=lambda out: out["loss"]).attach(trainer, "avg_loss")

    evaluator = create_supervised_evaluator(
        model, metrics={"bce": Loss(criterion), "cm": MultiLabelConfusionMatrix(args.num_attrs)},
        device=device, prepare_batch=prepare_batch, amp_mode="amp",
        output_transform=lambda x, y, y_pred: (y_pred.float(), y.long()),
    )

    @trainer.on(Events.ITERATION_COMPLETED(every=args.ortho_every))
    def orthogonality_step(engine):
        with torch.autocast("cuda", dtype=torch.float16):
            reg = ortho_penalty(model)
            scaler.scale(reg * args.ortho_coef).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):
        evaluator.run(val_loader)
        m = evaluator.state.metrics
        engine.state.best_bce = min(getattr(engine.state, "best_bce", 1e9), m["bce"])
        print(f"epoch {engine.state.epoch}: val bce {m['bce']:.4f} (best {engine.state.best_bce:.4f})")

    @trainer.on(Events.COMPLETED)
    def finish(engine):
        if args.recalibrate:
            recalibrate_head(model, train_loader, device)
        torch.save({k: v.half() for k, v in model.state_dict().items()}, f"{args.out}/model_fp16.pt")

    scheduler = LRScheduler(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader)))
    trainer.add_event_handler(Events.ITERATION_STARTED, scheduler)
    to_save = {"model": model, "optimizer": optimizer, "scaler": scaler, "trainer": trainer}
    evaluator.add_event_handler(Events.COMPLETED, ModelCheckpoint(args.out, "best", n_saved=2, require_empty=False,
                                                                  score_function=lambda e: -e.state.metrics["bce"]), to_save)
    evaluator.add_event_handler(Events.COMPLETED, EarlyStopping(patience=5, score_function=lambda e: -e.state.metrics["bce"], trainer=trainer))
    trainer.run(train_loader, max_epochs=args.epochs)
    return model


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--step", default="ignite", choices=["ignite", "manual", "accum", "generic", "probs", "focal", "semi"])
    p.add_argument("--num-attrs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip-norm", type=float, default=0.0)
    p.add_argument("--ortho-every", type=int, default=100)
    p.add_argument("--ortho-coef", type=float, default=1e-4)
    p.add_argument("--ent-coef", type=float, default=0.1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--focal-fp32", action="store_true")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--recalibrate", action="store_true")
    p.add_argument("--out", default="checkpoints")
    return p.parse_args()
