"""Speaker-embedding training (ECAPA-lite + AAM-softmax) with a large-margin finetune stage."""
import math
import time
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

BatchNorm1d = partial(nn.BatchNorm1d, momentum=0.05)


class SEModule(nn.Module):
    def __init__(self, channels, bottleneck=128):
        super().__init__()
        self.se = nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Conv1d(channels, bottleneck, 1), nn.ReLU(),
                                nn.Conv1d(bottleneck, channels, 1), nn.Sigmoid())

    def forward(self, x):
        return x * self.se(x)


class Res2Block(nn.Module):
    def __init__(self, channels, kernel_size, dilation, scale=8):
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.conv1 = nn.Conv1d(channels, channels, 1)
        self.bn1 = BatchNorm1d(channels)
        self.convs = nn.ModuleList(nn.Conv1d(width, width, kernel_size, dilation=dilation,
                                             padding=dilation * (kernel_size // 2)) for _ in range(scale - 1))
        self.bns = nn.ModuleList(BatchNorm1d(width) for _ in range(scale - 1))
        self.conv3 = nn.Conv1d(channels, channels, 1)
        self.bn3 = BatchNorm1d(channels)
        self.se = SEModule(channels)

    def forward(self, x):
        out = self.bn1(F.relu(self.conv1(x)))
        spx = torch.chunk(out, self.scale, dim=1)
        outs, sp = [], None
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            sp = spx[i] if i == 0 else sp + spx[i]
            sp = bn(F.relu(conv(sp)))
            outs.append(sp)
        outs.append(spx[-1])
        out = self.bn3(F.relu(self.conv3(torch.cat(outs, dim=1))))
        return self.se(out) + x


class StatsPool(nn.Module):
    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x, lengths=None):
        if lengths is None:
            mean = x.mean(dim=-1)  # expect: AMP004
            std = x.var(dim=-1, unbiased=True).clamp(min=self.eps).sqrt()  # expect: AMP004
        else:
            mask = (torch.arange(x.size(-1), device=x.device)[None] < lengths[:, None]).unsqueeze(1).to(x.dtype)
            total = mask.sum(dim=-1)
            mean = (x * mask).sum(dim=-1) / total
            var = ((x - mean.unsqueeze(-1)).pow(2) * mask).sum(dim=-1) / total
            std = var.clamp(min=self.eps).sqrt()
        return torch.cat([mean, std], dim=1)


class ECAPALite(nn.Module):
    def __init__(self, n_mels=80, channels=512, emb_dim=192):
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, channels, 5, padding=2)
        self.bn1 = BatchNorm1d(channels)
        self.layer1 = Res2Block(channels, 3, 2)
        self.layer2 = Res2Block(channels, 3, 3)
        self.layer3 = Res2Block(channels, 3, 4)
        self.mfa = nn.Conv1d(3 * channels, 1536, 1)
        self.pool = StatsPool()
        self.bn_pool = BatchNorm1d(3072)
        self.fc = nn.Linear(3072, emb_dim)
        self.bn_emb = BatchNorm1d(emb_dim)

    def forward(self, feats, lengths=None):
        # utterance-level mean normalisation of the filterbanks (inputs are fp32 features)
        feats = feats - feats.mean(dim=-1, keepdim=True)
        x = self.bn1(F.relu(self.conv1(feats)))
        x1 = self.layer1(x)
        x2 = self.layer2(x + x1)
        x3 = self.layer3(x + x1 + x2)
        x = F.relu(self.mfa(torch.cat((x1, x2, x3), dim=1)))
        x = self.bn_pool(self.pool(x, lengths))
        return self.bn_emb(self.fc(x))


class AAMSoftmaxLoss(nn.Module):
    def __init__(self, emb_dim, n_classes, margin=0.2, scale=30.0, inter_topk=5, inter_margin=0.06):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_classes, emb_dim))
        nn.init.xavier_normal_(self.weight, gain=1)
        self.s, self.m = scale, margin
        self.cos_m, self.sin_m = math.cos(margin), math.sin(margin)
        self.th, self.mm = math.cos(math.pi - margin), math.sin(math.pi - margin) * margin
        self.inter_topk, self.inter_margin = inter_topk, inter_margin

    def forward(self, emb, label):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - cosine * cosine).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where((cosine - self.th) > 0, phi, cosine - self.mm)
        one_hot = torch.zeros_like(cosine).scatter_(1, label.view(-1, 1), 1)
        output = one_hot * phi + (1.0 - one_hot) * cosine
        if self.inter_topk > 0:
            # inter-topk: push up the hardest negatives by a small margin
            neg = cosine.masked_fill(one_hot.bool(), -1e9)  # expect: AMP007
            _, top_idx = neg.topk(self.inter_topk, dim=1)
            hard = torch.zeros_like(one_hot).scatter_(1, top_idx, 1)
            output = output + hard * self.inter_margin
        output = output * self.s
        loss = F.cross_entropy(output, label)
        acc = (output.detach().argmax(1) == label).float().mean()
        return loss, acc


class PrototypeMemory(nn.Module):
    """Running per-speaker centroids; fp16 storage so that 100k+ speakers fit next to the model."""

    def __init__(self, n_speakers, emb_dim, momentum=0.9):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("protos", torch.zeros(n_speakers, emb_dim, dtype=torch.float16))

    @torch.no_grad()
    def enqueue(self, emb, labels):
        old = self.protos[labels].float()
        new = old * self.momentum + emb.detach().float() * (1 - self.momentum)
        self.protos[labels] = F.normalize(new.half(), dim=-1)  # expect: AMP011


def build_model(cfg):
    model = ECAPALite(cfg.n_mels, cfg.channels, cfg.emb_dim)
    criterion = AAMSoftmaxLoss(cfg.emb_dim, cfg.n_speakers, cfg.margin, cfg.scale)
    return model, criterion


def train(cfg, loader):
    model, criterion = build_model(cfg)
    model.cuda()
    criterion.cuda()
    if cfg.compile:
        model = torch.compile(model)
    params = list(model.parameters()) + list(criterion.parameters())
    optimizer = torch.optim.Adam(params, lr=cfg.lr, weight_decay=2e-5)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    memory = PrototypeMemory(cfg.n_speakers, cfg.emb_dim).cuda()
    steps_per_epoch = len(loader)
    for epoch in range(cfg.epochs):
        model.train()
        t0 = time.time()
        for it, (feats, lengths, labels) in enumerate(loader):
            lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * (epoch * steps_per_epoch + it) / (cfg.epochs * steps_per_epoch)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            feats, labels = feats.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            lengths = lengths.cuda(non_blocking=True) if cfg.variable_length else None
            with torch.cuda.amp.autocast():  # expect: AMP009
                emb = model(feats, lengths)
                loss, acc = criterion(emb, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            scaler.step(optimizer)
            scaler.update()
            memory.enqueue(emb, labels)
            if it % cfg.log_every == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.3f} acc {acc.item():.3f} gn {grad_norm:.2f} "
                      f"{(time.time() - t0) / (it + 1):.3f}s/it")
    return model, criterion, memory


def large_margin_finetune(model, criterion, loader, epochs=2, lr=1e-5, margin=0.5):
    """Second stage: longer crops, larger margin, small lr (no loss scaling: short stage)."""
    criterion.m = margin
    criterion.cos_m, criterion.sin_m = math.cos(margin), math.sin(margin)
    optimizer = torch.optim.SGD(list(model.parameters()) + list(criterion.parameters()), lr=lr, momentum=0.9)
    model.train()
    for epoch in range(epochs):
        for feats, lengths, labels in loader:
            feats, labels = feats.cuda(), labels.cuda()
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                emb = model(feats)
                loss, _ = criterion(emb, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model


@torch.no_grad()
def extract_embeddings(model, loader):
    model.eval()
    embs = []
    for feats, lengths, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            e = model(feats.cuda(), lengths.cuda())
        embs.append(F.normalize(e.float(), dim=-1).half().cpu())
    return torch.cat(embs)


def main(cfg, train_loader, ft_loader, test_loader):
    model, criterion, _ = train(cfg, train_loader)
    model = large_margin_finetune(model, criterion, ft_loader)
    return extract_embeddings(model, test_loader)
