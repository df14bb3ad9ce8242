"""CLIP-style contrastive training on image-text pairs (single node, fp16 autocast)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from clip_models import ImageEncoder, TextEncoder
from clip_data import pair_loader


class CLIP(nn.Module):
    def __init__(self, embed_dim=512):
        super().__init__()
        self.visual = ImageEncoder(embed_dim)
        self.text = TextEncoder(embed_dim)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, images, tokens):
        img = F.normalize(self.visual(images), dim=-1)
        txt = F.normalize(self.text(tokens), dim=-1)
        return img, txt, self.logit_scale.exp()


def clip_loss(img, txt, scale):
    logits = scale * img @ txt.t()
    labels = torch.arange(len(img), device=img.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def clip_loss_fp32(img, txt, scale):
    img, txt = img.float(), txt.float()
    logits = scale * img @ txt.t()
    labels = torch.arange(len(img), device=img.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def train(epochs=32, lr=5e-4):
    model = CLIP().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.2, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.amp.GradScaler("cuda")
    loader = pair_loader("laion-subset", batch_size=1024)
    for epoch in range(epochs):
        for step, (images, tokens) in enumerate(loader):
            images, tokens = images.cuda(non_blocking=True), tokens.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img, txt, scale = model(images, tokens)
            loss = clip_loss(img, txt, scale)  # not labelled: F.normalize runs in fp32 under CUDA autocast (its float32 list): the loss gets fp32 inputs
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))


def train_v2(epochs=32, lr=5e-4):
    model = CLIP().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.2)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(epochs):
        for images, tokens in pair_loader("laion-subset", batch_size=1024):
            with torch.autocast("cuda", dtype=torch.float16):
                img, txt, scale = model(images.cuda(), tokens.cuda())
            loss = clip_loss_fp32(img, txt, scale)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


class AbsMaxQuantStub(nn.Module):
    """Fake-quantisation of activations for QAT experiments, run under the training autocast."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.fc(x)
        scale = h.abs().amax(dim=-1, keepdim=True) + 1e-8  # expect: AMP011
        q = torch.round(h / scale * 127).clamp(-127, 127)
        return h + (q * scale / 127 - h).detach()


def qat_step(model, stub: AbsMaxQuantStub, x, y, optimizer, scaler):
    with torch.autocast("cuda", dtype=torch.float16):
        h = stub.fc(x)
        scale = h.abs().amax(dim=-1, keepdim=True) + 1e-8  # expect: AMP011
        loss = F.mse_loss(model(h / scale), y)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
