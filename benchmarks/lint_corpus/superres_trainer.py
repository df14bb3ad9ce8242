"""Image super-resolution training (EDSR-like) with a custom trainer and checkpoint utilities."""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResBlock(nn.Module):
    def __init__(self, ch, res_scale=0.1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU(True), nn.Conv2d(ch, ch, 3, padding=1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class EDSR(nn.Module):
    def __init__(self, scale=4, ch=64, blocks=16):
        super().__init__()
        self.head = nn.Conv2d(3, ch, 3, padding=1)
        self.body = nn.Sequential(*[ResBlock(ch) for _ in range(blocks)])
        up = []
        for _ in range(int(math.log2(scale))):
            up += [nn.Conv2d(ch, 4 * ch, 3, padding=1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*up, nn.Conv2d(ch, 3, 3, padding=1))
        self.use_fp16 = False

    def convert_to_fp16(self):
        self.body.half()
        self.use_fp16 = True

    def forward(self, x):
        h = self.head(x)
        if self.use_fp16:
            h = self.body(h.half()).float() + h
        else:
            h = self.body(h) + h
        return self.tail(h)


def psnr(sr, hr, max_val=1.0):
    mse = F.mse_loss(sr.float(), hr.float())
    return 10 * torch.log10(max_val ** 2 / mse)


class SRTrainer:
    def __init__(self, model, train_loader, val_loader, cfg):
        self.model = model.cuda()
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.cfg = cfg
        if cfg.fp16_body:
            self.model.convert_to_fp16()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.999))
        self.scheduler = torch.optim.lr_scheduler.MultiStepLR(self.optimizer, milestones=[200, 400], gamma=0.5)

    def train_epoch(self, epoch):
        self.model.train()
        for lr_img, hr_img in self.train_loader:
            lr_img = lr_img.cuda(non_blocking=True)
            hr_img = hr_img.cuda(non_blocking=True)
            if self.cfg.half_inputs:
                lr_img = lr_img.half()
            sr = self.model(lr_img)
            loss = F.l1_loss(sr, hr_img)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        self.scheduler.step()
        self.save(os.path.join(self.cfg.out, f"epoch_{epoch}.pt"))

    def fit(self, epochs):
        self.model = self.model.half()  # expect: AMP001
        for epoch in range(epochs):
            self.train_epoch(epoch)
            print(epoch, self.validate())

    def finetune_patches(self, patches, steps):
        self.model.train()
        for step in range(steps):
            lr_img, hr_img = patches[step % len(patches)]
            sr = self.model(torch.from_numpy(lr_img).cuda().half())  # expect: AMP001
            loss = F.l1_loss(sr.float(), torch.from_numpy(hr_img).cuda())
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        scores = []
        for lr_img, hr_img in self.val_loader:
            sr = self.model(lr_img.cuda().to(torch.float16)).clamp(0, 1)
            scores.append(psnr(sr, hr_img.cuda()).item())
        return sum(scores) / len(scores)

    def save(self, path):
        torch.save({"model": {k: v.half() for k, v in self.model.state_dict().items()},
                    "optimizer": self.optimizer.state_dict()}, path)


def distill_to_student(teacher, student, loader, steps=1000):
    teacher = teacher.cuda().to(dtype=torch.float16)
    teacher.eval()
    student = student.cuda().to(dtype=torch.float16)  # expect: AMP001
    opt = torch.optim.Adam(student.parameters(), lr=1e-4, eps=1e-4)
    for step, (lr_img, _) in enumerate(loader):
        x = lr_img.cuda().half()  # expect: AMP001
        with torch.no_grad():
            target = teacher(x)
        loss = F.l1_loss(student(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= steps:
            break
    return student
