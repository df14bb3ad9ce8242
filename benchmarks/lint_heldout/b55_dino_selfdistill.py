"""DINO: self-distillation with no labels, single-GPU version of main_dino.py.

ViT-S/16 student and EMA teacher, multi-crop, DINO head with a weight-normalised last
layer, centering + sharpening of the teacher, bf16 autocast, k-NN monitor.
"""
import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class MultiCropDataset(Dataset):
    """Stub: 2 global crops (224) and N local crops (96) of a random image."""

    def __init__(self, n=10000, local_crops_number=8, num_classes=1000):
        self.n, self.local, self.num_classes = n, local_crops_number, num_classes

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        crops = [torch.randn(3, 224, 224) for _ in range(2)] + [torch.randn(3, 96, 96) for _ in range(self.local)]
        return crops, idx % self.num_classes


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    warmup = np.linspace(start_warmup_value, base_value, warmup_epochs * niter_per_ep)
    iters = np.arange(epochs * niter_per_ep - len(warmup))
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, schedule))


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))
        self.drop_path = drop_path

    def _drop(self, x):
        if self.drop_path == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], 1, 1).bernoulli_(1 - self.drop_path)
        return x * keep / (1 - self.drop_path)

    def forward(self, x):
        x = x + self._drop(self.attn(self.norm1(x)))
        return x + self._drop(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    def __init__(self, img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, drop_path_rate=0.0):
        super().__init__()
        self.patch_size, self.embed_dim = patch_size, embed_dim
        self.patch_embed = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (img_size // patch_size) ** 2 + 1, embed_dim))
        dpr = np.linspace(0, drop_path_rate, depth)
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, drop_path=float(dpr[i])) for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def interpolate_pos_encoding(self, npatch, w, h):
        N = self.pos_embed.shape[1] - 1
        if npatch == N and w == h:
            return self.pos_embed
        side = int(math.sqrt(N))
        patch_pos = self.pos_embed[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        patch_pos = F.interpolate(patch_pos, size=(w // self.patch_size, h // self.patch_size), mode="bicubic")
        return torch.cat((self.pos_embed[:, :1], patch_pos.permute(0, 2, 3, 1).reshape(1, -1, self.embed_dim)), dim=1)

    def forward(self, x):
        B, _, w, h = x.shape
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)
        x = x + self.interpolate_pos_encoding(x.shape[1] - 1, w, h)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)[:, 0]


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256, norm_last_layer=True):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim),
                                 nn.GELU(), nn.Linear(hidden_dim, bottleneck_dim))
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)
        self.norm_last_layer = norm_last_layer

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        if self.norm_last_layer:
            return F.linear(x, F.normalize(self.last_layer.weight, dim=1))
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    """Runs the backbone once per crop resolution, then the head on all crops at once."""

    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x):
        sizes = torch.tensor([inp.shape[-1] for inp in x])
        idx_crops = torch.cumsum(torch.unique_consecutive(sizes, return_counts=True)[1], 0)
        start_idx, outputs = 0, []
        for end_idx in idx_crops.tolist():
            outputs.append(self.backbone(torch.cat(x[start_idx:end_idx])))
            start_idx = end_idx
        return self.head(torch.cat(outputs))


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs,
                 nepochs, student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.center_momentum, self.ncrops = student_temp, center_momentum, ncrops
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
        self.update_center(teacher_output)
        return total_loss / n_loss_terms

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = teacher_output.mean(dim=0, keepdim=True)  # expect: AMP004
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


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


def get_params_groups(model):
    regularized = [p for n, p in model.named_parameters() if p.requires_grad and not (n.endswith(".bias") or p.ndim == 1)]
    not_regularized = [p for n, p in model.named_parameters() if p.requires_grad and (n.endswith(".bias") or p.ndim == 1)]
    return [{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}]


def train_one_epoch(student, teacher, dino_loss, data_loader, optimizer, lr_schedule, wd_schedule,
                    momentum_schedule, epoch, fp16_scaler, args):
    for it, (images, _) in enumerate(data_loader):
        it = len(data_loader) * epoch + it
        for i, param_group in enumerate(optimizer.param_groups):
            param_group["lr"] = lr_schedule[it]
            if i == 0:
                param_group["weight_decay"] = wd_schedule[it]
        images = [im.cuda(non_blocking=True) for im in images]
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            teacher_output = teacher(images[:2])
            student_output = student(images)
            loss = dino_loss(student_output, teacher_output, epoch)
        if not math.isfinite(loss.item()):
            print(f"Loss is {loss.item()}, stopping training")
            sys.exit(1)
        with torch.no_grad():
            teacher_std = teacher_output.std(dim=0).mean().item()  # expect: AMP004
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
            fp16_scaler.step(optimizer)  # expect: AMP006
        with torch.no_grad():
            m = momentum_schedule[it]
            for param_q, param_k in zip(student.parameters(), teacher.parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)
        if it % args.print_freq == 0:
            print(f"it {it} loss {loss.item():.4f} lr {optimizer.param_groups[0]['lr']:.2e} teacher_std {teacher_std:.4f}")


@torch.no_grad()
def extract_features(backbone, loader):
    backbone.eval()
    feats, labels = [], []
    for crops, lab in loader:
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
            f = backbone(crops[0].cuda(non_blocking=True))
        feats.append(F.normalize(f.float(), dim=1))
        labels.append(lab.cuda())
    backbone.train()
    return torch.cat(feats), torch.cat(labels)


@torch.no_grad()
def knn_classifier(train_features, train_labels, test_features, test_labels, k=20, T=0.07, num_classes=1000):
    top1, total = 0.0, 0
    for idx in range(0, test_features.size(0), 256):
        features, targets = test_features[idx : idx + 256], test_labels[idx : idx + 256]
        similarity = torch.mm(features, train_features.T)
        distances, indices = similarity.topk(k, largest=True, sorted=True)
        retrieved = torch.gather(train_labels.view(1, -1).expand(targets.size(0), -1), 1, indices)
        one_hot = torch.zeros(targets.size(0) * k, num_classes, device=features.device)
        one_hot.scatter_(1, retrieved.view(-1, 1), 1)
        weights = distances.clone().div_(T).exp_()
        probs = torch.sum(one_hot.view(targets.size(0), -1, num_classes) * weights.view(targets.size(0), -1, 1), 1)
        top1 += (probs.argmax(1) == targets).sum().item()
        total += targets.size(0)
    return top1 * 100.0 / max(total, 1)


def train_dino(args):
    torch.manual_seed(args.seed)
    dataset = MultiCropDataset(local_crops_number=args.local_crops_number)
    data_loader = DataLoader(dataset, batch_size=args.batch_size_per_gpu, shuffle=True, num_workers=10, drop_last=True)
    knn_loader = DataLoader(MultiCropDataset(n=2000, local_crops_number=0), batch_size=128)
    student = MultiCropWrapper(VisionTransformer(drop_path_rate=args.drop_path_rate),
                               DINOHead(384, args.out_dim, norm_last_layer=args.norm_last_layer)).cuda()
    teacher = MultiCropWrapper(VisionTransformer(), DINOHead(384, args.out_dim)).cuda()
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs).cuda()
    optimizer = torch.optim.AdamW(get_params_groups(student))
    fp16_scaler = torch.amp.GradScaler("cuda") if args.use_fp16 else None  # expect: AMP010
    niter = len(data_loader)
    lr_schedule = cosine_scheduler(args.lr * args.batch_size_per_gpu / 256.0, args.min_lr, args.epochs, niter, args.warmup_epochs)
    wd_schedule = cosine_scheduler(args.weight_decay, args.weight_decay_end, args.epochs, niter)
    momentum_schedule = cosine_scheduler(args.momentum_teacher, 1, args.epochs, niter)
    for epoch in range(args.epochs):
        t0 = time.time()
        train_one_epoch(student, teacher, dino_loss, data_loader, optimizer, lr_schedule, wd_schedule,
                        momentum_schedule, epoch, fp16_scaler, args)
        save_dict = {"student": student.state_dict(), "teacher": teacher.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch + 1, "args": vars(args), "dino_loss": dino_loss.state_dict()}
        if fp16_scaler is not None:
            save_dict["fp16_scaler"] = fp16_scaler.state_dict()
        torch.save(save_dict, os.path.join(args.output_dir, "checkpoint.pth"))
        if args.knn_every and (epoch + 1) % args.knn_every == 0:
            feats, labels = extract_features(teacher.backbone, knn_loader)
            acc = knn_classifier(feats[:1000], labels[:1000], feats[1000:], labels[1000:])
            print(f"epoch {epoch}: k-NN top1 {acc:.2f} ({time.time() - t0:.0f}s)")


def get_args_parser():
    p = argparse.ArgumentParser("DINO", add_help=False)
    p.add_argument("--out_dim", default=65536, type=int)
    p.add_argument("--norm_last_layer", default=True, type=bool)
    p.add_argument("--momentum_teacher", default=0.996, type=float)
    p.add_argument("--warmup_teacher_temp", default=0.04, type=float)
    p.add_argument("--teacher_temp", default=0.04, type=float)
    p.add_argument("--warmup_teacher_temp_epochs", default=0, type=int)
    p.add_argument("--use_fp16", default=True, type=bool, help="use loss scaling (mixed precision)")
    p.add_argument("--weight_decay", type=float, default=0.04)
    p.add_argument("--weight_decay_end", type=float, default=0.4)
    p.add_argument("--clip_grad", type=float, default=3.0)
    p.add_argument("--batch_size_per_gpu", default=64, type=int)
    p.add_argument("--epochs", default=100, type=int)
    p.add_argument("--freeze_last_layer", default=1, type=int)
    p.add_argument("--lr", default=0.0005, type=float)
    p.add_argument("--warmup_epochs", default=10, type=int)
    p.add_argument("--min_lr", type=float, default=1e-6)
    p.add_argument("--drop_path_rate", type=float, default=0.1)
    p.add_argument("--local_crops_number", type=int, default=8)
    p.add_argument("--output_dir", default=".", type=str)
    p.add_argument("--knn_every", default=10, type=int)
    p.add_argument("--print_freq", default=10, type=int)
    p.add_argument("--seed", default=0, type=int)
    return p


if __name__ == "__main__":
    args = argparse.ArgumentParser("DINO", parents=[get_args_parser()]).parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    train_dino(args)
