"""DINO self-distillation with multi-crop, plus an online feature queue for a kNN monitor.

Student and teacher share the architecture; the teacher is an EMA of the student and
its outputs are centered and sharpened. Adapted from the reference implementation.
"""
import argparse
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256, nlayers=3):
        super().__init__()
        layers = [nn.Linear(in_dim, hidden_dim), nn.GELU()]
        for _ in range(nlayers - 2):
            layers += [nn.Linear(hidden_dim, hidden_dim), nn.GELU()]
        layers.append(nn.Linear(hidden_dim, bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        # plain linear prototypes (no weight norm) -- last layer is frozen for the first epoch
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.mlp(x)
        x = F.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        if not isinstance(x, list):
            x = [x]
        sizes = torch.tensor([inp.shape[-1] for inp in x])
        idx_crops = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0)
        start, feats = 0, []
        for end in idx_crops.tolist():
            feats.append(self.backbone(torch.cat(x[start:end])))
            start = end
        return self.head(torch.cat(feats))


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs,
                 student_temp=0.1):
        super().__init__()
        self.student_temp, self.ncrops = student_temp, ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_epochs),
            np.ones(nepochs - warmup_epochs) * teacher_temp,
        ))

    def forward(self, student_output, teacher_output, epoch):
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total_loss, n_terms = 0.0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                total_loss = total_loss + torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
                n_terms += 1
        return total_loss / n_terms


@torch.no_grad()
def update_center(center, teacher_out, momentum=0.9):
    batch_center = teacher_out.mean(dim=0, keepdim=True)  # expect: AMP004
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(batch_center)
        batch_center = batch_center / dist.get_world_size()
    center.mul_(momentum).add_(batch_center, alpha=1 - momentum)


class FeatureQueue:
    """Ring buffer of L2-normalised teacher features, stored in half to save memory."""

    def __init__(self, dim, size=65536, device="cuda"):
        self.feats = torch.zeros(size, dim, dtype=torch.float16, device=device)
        self.labels = torch.full((size,), -1, dtype=torch.long, device=device)
        self.ptr, self.size = 0, size

    @torch.no_grad()
    def enqueue(self, x, y):
        x = x.half()
        x = x / (x.norm(dim=-1, keepdim=True) + 1e-8)  # expect: AMP004 AMP011
        n = x.shape[0]
        idx = (torch.arange(n, device=x.device) + self.ptr) % self.size
        self.feats[idx] = x
        self.labels[idx] = y
        self.ptr = (self.ptr + n) % self.size


def cosine_scheduler(base, final, epochs, niter_per_ep, warmup_epochs=0, start_warmup=0.0):
    warmup = np.linspace(start_warmup, base, warmup_epochs * niter_per_ep)
    iters = np.arange(epochs * niter_per_ep - len(warmup))
    schedule = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, schedule))


def clip_gradients(model, clip):
    norms = []
    for p in model.parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            norms.append(param_norm.item())
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    if epoch >= freeze_last_layer:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


def train_one_epoch(student, teacher, teacher_without_ddp, dino_loss, data_loader, optimizer, lr_schedule,
                    wd_schedule, momentum_schedule, epoch, fp16_scaler, feat_queue, args):
    t0 = time.time()
    for it, (images, labels) in enumerate(data_loader):
        it = len(data_loader) * epoch + it
        for i, pg in enumerate(optimizer.param_groups):
            pg["lr"] = lr_schedule[it]
            if i == 0:
                pg["weight_decay"] = wd_schedule[it]
        images = [im.cuda(non_blocking=True).half() for im in images]  # expect: AMP001
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16_scaler is not None):
            teacher_output = teacher(images[:2])
            student_output = student(images)
        loss = dino_loss(student_output, teacher_output, epoch)  # expect: AMP002
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"loss is {loss.item()}, stopping training")
        update_center(dino_loss.center, teacher_output, args.center_momentum)

        optimizer.zero_grad()
        if fp16_scaler is None:
            loss.backward()
            if args.clip_grad:
                clip_gradients(student, args.clip_grad)
            cancel_gradients_last_layer(epoch, student, args.freeze_last_layer)
            optimizer.step()
        else:
            fp16_scaler.scale(loss).backward()
            if args.clip_grad:
                fp16_scaler.unscale_(optimizer)
                clip_gradients(student, args.clip_grad)
            cancel_gradients_last_layer(epoch, student, args.freeze_last_layer)
            fp16_scaler.step(optimizer)
            fp16_scaler.update()

        with torch.no_grad():
            m = momentum_schedule[it]
            for p_s, p_t in zip(student.module.parameters(), teacher_without_ddp.parameters()):
                p_t.data.mul_(m).add_((1 - m) * p_s.detach().data)
            feat_queue.enqueue(teacher_without_ddp.backbone(images[0].float()), labels.cuda(non_blocking=True))
        if it % 50 == 0:
            print(f"ep {epoch} it {it} loss {loss.item():.4f} lr {lr_schedule[it]:.2e} ({time.time() - t0:.0f}s)")


def train_linear_probe(backbone, train_loader, num_classes, epochs=10, lr=1e-3):
    backbone.eval()
    probe = nn.Linear(backbone.embed_dim, num_classes).cuda()
    opt = torch.optim.SGD(probe.parameters(), lr=lr, momentum=0.9, weight_decay=0.0)
    for _ in range(epochs):
        for images, targets in train_loader:
            images, targets = images.cuda(non_blocking=True), targets.cuda(non_blocking=True)
            with torch.no_grad():
                feats = backbone(images)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                loss = F.cross_entropy(probe(feats), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return probe


def main(args):
    student_bb = timm.create_model(args.arch, num_classes=0, drop_path_rate=args.drop_path)
    teacher_bb = timm.create_model(args.arch, num_classes=0)
    embed_dim = student_bb.embed_dim
    student = MultiCropWrapper(student_bb, DINOHead(embed_dim, args.out_dim)).cuda()
    teacher = MultiCropWrapper(teacher_bb, DINOHead(embed_dim, args.out_dim)).cuda()
    student = nn.parallel.DistributedDataParallel(student, device_ids=[args.gpu])
    teacher_without_ddp = teacher
    teacher_without_ddp.load_state_dict(student.module.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs).cuda()
    regularized = [p for n, p in student.named_parameters() if p.requires_grad and p.ndim > 1]
    not_regularized = [p for n, p in student.named_parameters() if p.requires_grad and p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}])
    fp16_scaler = torch.cuda.amp.GradScaler() if args.use_fp16 else None  # expect: AMP009

    data_loader = torch.load(args.loader_spec)
    n_it = len(data_loader)
    lr_schedule = cosine_scheduler(args.lr * args.batch_size / 256.0, args.min_lr, args.epochs, n_it,
                                   warmup_epochs=args.warmup_epochs)
    wd_schedule = cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs, n_it)
    momentum_schedule = cosine_scheduler(args.momentum_teacher, 1.0, args.epochs, n_it)
    feat_queue = FeatureQueue(embed_dim)

    for epoch in range(args.epochs):
        train_one_epoch(student, teacher, teacher_without_ddp, dino_loss, data_loader, optimizer, lr_schedule,
                        wd_schedule, momentum_schedule, epoch, fp16_scaler, feat_queue, args)
        ckpt = {"student": student.state_dict(), "teacher": teacher.state_dict(), "epoch": epoch + 1,
                "optimizer": optimizer.state_dict(), "dino_loss": dino_loss.state_dict()}
        if fp16_scaler is not None:
            ckpt["fp16_scaler"] = fp16_scaler.state_dict()
        torch.save(ckpt, os.path.join(args.output_dir, "checkpoint.pth"))
    if args.probe_loader_spec:
        train_linear_probe(teacher_without_ddp.backbone, torch.load(args.probe_loader_spec), args.num_classes)


if __name__ == "__main__":
    p = argparse.ArgumentParser("DINO")
    p.add_argument("--arch", default="vit_small_patch16_224")
    p.add_argument("--out_dim", type=int, default=65536)
    p.add_argument("--drop_path", type=float, default=0.1)
    p.add_argument("--use_fp16", type=bool, default=True)
    p.add_argument("--momentum_teacher", type=float, default=0.996)
    p.add_argument("--center_momentum", type=float, default=0.9)
    p.add_argument("--warmup_teacher_temp", type=float, default=0.04)
    p.add_argument("--teacher_temp", type=float, default=0.07)
    p.add_argument("--warmup_teacher_temp_epochs", type=int, default=30)
    p.add_argument("--local_crops_number", type=int, default=8)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--warmup_epochs", type=int, default=10)
    p.add_argument("--freeze_last_layer", type=int, default=1)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min_lr", type=float, default=1e-6)
    p.add_argument("--weight_decay", type=float, default=0.04)
    p.add_argument("--weight_decay_end", type=float, default=0.4)
    p.add_argument("--clip_grad", type=float, default=3.0)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--gpu", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--loader_spec", required=True)
    p.add_argument("--probe_loader_spec", default="")
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--output_dir", default=".")
    main(p.parse_args())
