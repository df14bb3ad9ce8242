# Self-distillation with no labels (DINO) + KoLeo regulariser on the student bottleneck.
# Stripped-down fork of facebookresearch/dino main_dino.py: timm ViT backbones, multi-crop
# loader, teacher EMA with centering, and a quick linear probe on the teacher every N epochs.
import argparse
import math
import os
import sys
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets

from dino_augment import DataAugmentationDINO, probe_transforms  # local: multi-crop transforms


def get_args_parser():
    parser = argparse.ArgumentParser("DINO", add_help=False)
    parser.add_argument("--arch", default="vit_small_patch16_224", type=str)
    parser.add_argument("--out_dim", default=65536, type=int)
    parser.add_argument("--momentum_teacher", default=0.996, type=float)
    parser.add_argument("--warmup_teacher_temp", default=0.04, type=float)
    parser.add_argument("--teacher_temp", default=0.04, type=float)
    parser.add_argument("--warmup_teacher_temp_epochs", default=0, type=int)
    parser.add_argument("--use_fp16", default=True, type=lambda s: s.lower() in ("1", "true", "yes"))
    parser.add_argument("--weight_decay", type=float, default=0.04)
    parser.add_argument("--clip_grad", type=float, default=3.0)
    parser.add_argument("--batch_size_per_gpu", default=64, type=int)
    parser.add_argument("--epochs", default=100, type=int)
    parser.add_argument("--freeze_last_layer", default=1, type=int)
    parser.add_argument("--lr", default=0.0005, type=float)
    parser.add_argument("--local_crops_number", type=int, default=8)
    parser.add_argument("--koleo_weight", type=float, default=0.1)
    parser.add_argument("--probe_every", type=int, default=10)
    parser.add_argument("--data_path", default="/path/to/imagenet/train/", type=str)
    parser.add_argument("--output_dir", default=".", type=str)
    return parser


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256, nlayers=3):
        super().__init__()
        layers = [nn.Linear(in_dim, hidden_dim), nn.GELU()]
        for _ in range(nlayers - 2):
            layers += [nn.Linear(hidden_dim, hidden_dim), nn.GELU()]
        layers.append(nn.Linear(hidden_dim, bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        z = self.mlp(x)
        logits = self.last_layer(F.normalize(z, dim=-1, p=2))
        return logits, z


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        backbone.fc, backbone.head = nn.Identity(), nn.Identity()
        self.backbone = backbone
        self.head = head

    def forward(self, x):
        if not isinstance(x, list):
            x = [x]
        idx_crops = torch.cumsum(torch.unique_consecutive(torch.tensor([inp.shape[-1] for inp in x]), return_counts=True)[1], 0)
        start_idx, output = 0, torch.empty(0).to(x[0].device)
        for end_idx in idx_crops:
            _out = self.backbone(torch.cat(x[start_idx:end_idx]))
            output = torch.cat((output, _out))
            start_idx = end_idx
        return self.head(output)


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs, nepochs,
                 student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.ncrops = ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs),
            np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp))

    def forward(self, student_output, teacher_output, epoch):
        student_out = (student_output / self.student_temp).chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1).detach().chunk(2)
        total_loss, n_loss_terms = 0, 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        total_loss /= n_loss_terms
        self.update_center(teacher_output)
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = teacher_output.mean(dim=0, keepdim=True)  # expect: AMP004
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(batch_center)
            batch_center = batch_center / dist.get_world_size()
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


class KoLeoLoss(nn.Module):
    """Kozachenko-Leonenko entropy estimator (Sablayrolles et al., 2018), as used in DINOv2."""

    @staticmethod
    def pairwise_nearest(x):
        dots = torch.mm(x, x.t())
        n = x.shape[0]
        dots.view(-1)[:: (n + 1)].fill_(-1)  # never pick yourself
        return torch.max(dots, dim=1)[1]

    def forward(self, student_feats):
        with torch.autocast("cuda", enabled=False):
            x = F.normalize(student_feats, p=2, dim=-1)  # expect: AMP011
            idx = self.pairwise_nearest(x)
            distances = (x - x[idx]).norm(p=2, dim=-1)  # expect: AMP004
            loss = -torch.log(distances + 1e-8).mean()  # expect: AMP004 AMP011
        return loss


def clip_gradients(model, clip):
    norms = []
    for _, p in model.named_parameters():
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


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    warmup = np.linspace(start_warmup_value, base_value, warmup_epochs * niter_per_ep)
    iters = np.arange(epochs * niter_per_ep - len(warmup))
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, schedule))


def train_one_epoch(student, teacher, teacher_without_ddp, dino_loss, koleo_loss, data_loader, optimizer,
                    lr_schedule, wd_schedule, momentum_schedule, epoch, fp16_scaler, args):
    for it, (images, _) in enumerate(data_loader):
        it = len(data_loader) * epoch + it
        for i, param_group in enumerate(optimizer.param_groups):
            param_group["lr"] = lr_schedule[it]
            if i == 0:
                param_group["weight_decay"] = wd_schedule[it]
        images = [im.cuda(non_blocking=True) for im in images]

        with torch.cuda.amp.autocast(fp16_scaler is not None):  # expect: AMP009
            teacher_logits, _ = teacher(images[:2])
            student_logits, student_feats = student(images)
            loss = dino_loss(student_logits, teacher_logits, epoch)
            if args.koleo_weight > 0:
                n_global = teacher_logits.shape[0]
                loss = loss + args.koleo_weight * koleo_loss(student_feats[:n_global])

        if not math.isfinite(loss.item()):
            print("Loss is {}, stopping training".format(loss.item()))
            sys.exit(1)

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
            for param_q, param_k in zip(student.module.parameters(), teacher_without_ddp.parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)


def eval_linear_probe(backbone, train_loader, val_loader, embed_dim, num_labels=1000, epochs=2):
    """Short linear probe on frozen teacher features, only to monitor progress."""
    backbone.eval()
    linear = nn.Linear(embed_dim, num_labels).cuda()
    linear.weight.data.normal_(mean=0.0, std=0.01)
    linear.bias.data.zero_()
    opt = torch.optim.SGD(linear.parameters(), lr=1e-3, momentum=0.9, weight_decay=0)
    for _ in range(epochs):
        linear.train()
        for images, labels in train_loader:
            images, labels = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                with torch.no_grad():
                    feats = backbone(images)
                loss = F.cross_entropy(linear(feats), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
    linear.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in val_loader:
            with torch.autocast("cuda", dtype=torch.float16):
                logits = linear(backbone(images.cuda(non_blocking=True)))
            correct += (logits.argmax(-1) == labels.cuda()).sum().item()
            total += labels.numel()
    return 100.0 * correct / total


def train_dino(args):
    dist.init_process_group("nccl")
    args.gpu = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.gpu)
    transform = DataAugmentationDINO((0.4, 1.0), (0.05, 0.4), args.local_crops_number)
    dataset = datasets.ImageFolder(args.data_path, transform=transform)
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    data_loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=args.batch_size_per_gpu,
                                              num_workers=10, pin_memory=True, drop_last=True)

    student = timm.create_model(args.arch, pretrained=False, drop_path_rate=0.1, num_classes=0)
    teacher = timm.create_model(args.arch, pretrained=False, num_classes=0)
    embed_dim = student.num_features
    student = MultiCropWrapper(student, DINOHead(embed_dim, args.out_dim)).cuda()
    teacher = MultiCropWrapper(teacher, DINOHead(embed_dim, args.out_dim)).cuda()
    student = nn.parallel.DistributedDataParallel(student, device_ids=[args.gpu])
    teacher_without_ddp = teacher
    teacher_without_ddp.load_state_dict(student.module.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False

    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs).cuda()
    koleo_loss = KoLeoLoss()
    regularized = [p for n, p in student.named_parameters() if p.requires_grad and not (n.endswith(".bias") or p.ndim == 1)]
    not_regularized = [p for n, p in student.named_parameters() if p.requires_grad and (n.endswith(".bias") or p.ndim == 1)]
    optimizer = torch.optim.AdamW([{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}])
    fp16_scaler = None
    if args.use_fp16:
        fp16_scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    niter = len(data_loader)
    lr_schedule = cosine_scheduler(args.lr * args.batch_size_per_gpu * dist.get_world_size() / 256.0, 1e-6, args.epochs, niter, warmup_epochs=10)
    wd_schedule = cosine_scheduler(args.weight_decay, 0.4, args.epochs, niter)
    momentum_schedule = cosine_scheduler(args.momentum_teacher, 1, args.epochs, niter)

    probe_train = torch.utils.data.DataLoader(datasets.ImageFolder(args.data_path, probe_transforms(True)), batch_size=256, shuffle=True, num_workers=8)
    probe_val = torch.utils.data.DataLoader(datasets.ImageFolder(args.data_path.replace("train", "val"), probe_transforms(False)), batch_size=256, num_workers=8)
    for epoch in range(args.epochs):
        data_loader.sampler.set_epoch(epoch)
        start = time.time()
        train_one_epoch(student, teacher, teacher_without_ddp, dino_loss, koleo_loss, data_loader, optimizer,
                        lr_schedule, wd_schedule, momentum_schedule, epoch, fp16_scaler, args)
        save_dict = {"student": student.state_dict(), "teacher": teacher.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch + 1, "dino_loss": dino_loss.state_dict(),
                     "fp16_scaler": fp16_scaler.state_dict() if fp16_scaler is not None else None}
        if dist.get_rank() == 0:
            torch.save(save_dict, os.path.join(args.output_dir, "checkpoint.pth"))
            if args.probe_every and (epoch + 1) % args.probe_every == 0:
                acc = eval_linear_probe(teacher_without_ddp.backbone, probe_train, probe_val, embed_dim)
                print(f"epoch {epoch}: linear probe top-1 {acc:.2f} ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    train_dino(get_args_parser().parse_args())
