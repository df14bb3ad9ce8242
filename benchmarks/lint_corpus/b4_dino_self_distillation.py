"""DINO self-distillation with a momentum teacher, multi-crop, KoLeo regulariser and a linear-probe evaluation."""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim=2048, bottleneck_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim), nn.GELU(),
            nn.Linear(hidden_dim, bottleneck_dim),
        )
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x = self.mlp(x)
        x = F.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super().__init__()
        backbone.fc, backbone.head = nn.Identity(), nn.Identity()
        self.backbone = backbone
        self.head = head

    def forward(self, x, return_feats=False):
        if not isinstance(x, list):
            x = [x]
        idx_crops = torch.cumsum(torch.unique_consecutive(torch.tensor([inp.shape[-1] for inp in x]), return_counts=True)[1], 0)
        start_idx, output = 0, torch.empty(0).to(x[0].device)
        for end_idx in idx_crops:
            _out = self.backbone(torch.cat(x[start_idx:end_idx]))
            output = torch.cat((output, _out))
            start_idx = end_idx
        out = self.head(output)
        return (out, output) if return_feats else out


class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp, warmup_epochs, nepochs, student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.ncrops = ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = torch.cat((
            torch.linspace(warmup_teacher_temp, teacher_temp, warmup_epochs),
            torch.ones(nepochs - warmup_epochs) * teacher_temp,
        ))

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
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True) / len(teacher_output)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def clip_gradients(model, clip):
    norms = []
    for name, p in model.named_parameters():
        if p.grad is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(p, clip))
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    if epoch >= freeze_last_layer:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


def train_one_epoch(student, teacher, dino_loss, data_loader, optimizer, lr_schedule, momentum_schedule, epoch, fp16_scaler, args):
    for it, (images, _) in enumerate(data_loader):
        it = len(data_loader) * epoch + it
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr_schedule[it]
        images = [im.cuda(non_blocking=True).to(torch.half) for im in images]  # expect: AMP001

        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16_scaler is not None):
            teacher_output = teacher(images[:2])
            student_output, feats = student(images, return_feats=True)
            cls = F.normalize(feats[: images[0].shape[0]], dim=-1)
            sim = cls @ cls.t()
            sim.fill_diagonal_(-1.0)
            nn_sim, _ = sim.max(dim=1)
            nn_dist = (2 - 2 * nn_sim).clamp_min(0).sqrt()
            koleo = -torch.log(nn_dist + 1e-8).mean()  # expect: AMP011
        loss = dino_loss(student_output, teacher_output, epoch) + args.koleo_weight * koleo  # expect: AMP002

        if not math.isfinite(loss.item()):
            print(f"Loss is {loss.item()}, stopping training")
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
                clip_gradients(student, args.clip_grad)  # expect: AMP005
            cancel_gradients_last_layer(epoch, student, args.freeze_last_layer)
            fp16_scaler.step(optimizer)
            fp16_scaler.update()

        with torch.no_grad():
            m = momentum_schedule[it]
            for param_q, param_k in zip(student.parameters(), teacher.parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)


def eval_linear(backbone, linear_classifier, train_loader, epochs, lr=1e-3):
    backbone.eval()
    optimizer = torch.optim.SGD(linear_classifier.parameters(), lr, momentum=0.9, weight_decay=0)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        linear_classifier.train()
        for inp, target in train_loader:
            inp, target = inp.cuda(non_blocking=True), target.cuda(non_blocking=True)
            with torch.no_grad():
                feats = backbone(inp)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                output = linear_classifier(feats)
                loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return linear_classifier


def main(args, student, teacher, data_loader, lr_schedule, momentum_schedule):
    student, teacher = student.cuda(), teacher.cuda()
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    dino_loss = DINOLoss(args.out_dim, args.local_crops_number + 2, args.warmup_teacher_temp, args.teacher_temp,
                         args.warmup_teacher_temp_epochs, args.epochs).cuda()
    optimizer = torch.optim.AdamW(student.parameters())
    fp16_scaler = torch.amp.GradScaler("cuda") if args.use_fp16 else None
    for epoch in range(args.epochs):
        train_one_epoch(student, teacher, dino_loss, data_loader, optimizer, lr_schedule, momentum_schedule, epoch, fp16_scaler, args)
    return student
