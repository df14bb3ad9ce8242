"""Perceiver encoder (latent array, cross-attention to inputs) with DINO self-distillation pretraining."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def fourier_encode(pos, max_freq=10.0, num_bands=16):
    """pos: (B, N, D) coordinates in [-1, 1] -> (B, N, D * (2 * num_bands + 1))."""
    pos = pos.unsqueeze(-1)
    scales = torch.linspace(1.0, max_freq / 2, num_bands, device=pos.device, dtype=pos.dtype)
    x = pos * scales * math.pi
    return torch.cat([pos, x.sin(), x.cos()], dim=-1).flatten(-2)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, dim * mult * 2), GEGLU(), nn.Dropout(dropout),
            nn.Linear(dim * mult, dim),
        )

    def forward(self, x):
        return self.net(x)


class CrossAttention(nn.Module):
    """Latents (queries) attend to the input array; padded input elements are masked out."""

    def __init__(self, latent_dim, input_dim, heads=1, dim_head=64):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.scale = dim_head ** -0.5
        inner = heads * dim_head
        self.norm_latents = nn.LayerNorm(latent_dim)
        self.norm_inputs = nn.LayerNorm(input_dim)
        self.to_q = nn.Linear(latent_dim, inner, bias=False)
        self.to_kv = nn.Linear(input_dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, latent_dim)

    def forward(self, latents, inputs, input_mask=None):
        B = inputs.shape[0]
        q = self.to_q(self.norm_latents(latents))
        k, v = self.to_kv(self.norm_inputs(inputs)).chunk(2, dim=-1)
        q, k, v = (t.reshape(B, t.shape[1], self.heads, self.dim_head).transpose(1, 2) for t in (q, k, v))
        sim = (q @ k.transpose(-2, -1)) * self.scale
        if input_mask is not None:
            sim = torch.where(input_mask[:, None, None, :], sim, torch.tensor(-1e9, device=sim.device))  # expect: AMP007
        attn = sim.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(B, -1, self.heads * self.dim_head)
        return self.to_out(out)


class LatentSelfAttention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.scale = dim_head ** -0.5
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, heads * dim_head * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(heads * dim_head, dim), nn.Dropout(dropout))

    def forward(self, x, latent_mask=None):
        B, N, _ = x.shape
        q, k, v = self.to_qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, N, self.heads, self.dim_head).transpose(1, 2) for t in (q, k, v))
        sim = (q @ k.transpose(-2, -1)) * self.scale
        if latent_mask is not None:
            sim = sim.masked_fill(~latent_mask[:, None, None, :], -1e9 if sim.dtype == torch.float32 else -1e4)
        attn = sim.softmax(dim=-1)
        return self.to_out((attn @ v).transpose(1, 2).reshape(B, N, -1))


class PerceiverEncoder(nn.Module):
    def __init__(self, in_channels, pos_dim=2, num_bands=16, num_latents=256, latent_dim=512, depth=6,
                 latent_heads=8, cross_every=3):
        super().__init__()
        self.num_bands = num_bands
        input_dim = in_channels + pos_dim * (2 * num_bands + 1)
        self.latents = nn.Parameter(torch.randn(num_latents, latent_dim) * 0.02)
        self.cross_every = cross_every
        self.cross_attn = CrossAttention(latent_dim, input_dim)
        self.cross_ff = FeedForward(latent_dim)
        self.self_attns = nn.ModuleList([LatentSelfAttention(latent_dim, latent_heads) for _ in range(depth)])
        self.self_ffs = nn.ModuleList([FeedForward(latent_dim) for _ in range(depth)])
        self.latent_norm = nn.LayerNorm(latent_dim)
        self.out_dim = latent_dim

    def forward(self, values, pos, input_mask=None):
        inputs = torch.cat([values, fourier_encode(pos, num_bands=self.num_bands)], dim=-1)
        x = self.latents.unsqueeze(0).expand(values.shape[0], -1, -1)
        for i, (attn, ff) in enumerate(zip(self.self_attns, self.self_ffs)):
            if i % self.cross_every == 0:
                x = x + self.cross_attn(x, inputs, input_mask)
                x = x + self.cross_ff(x)
            x = x + attn(x)
            x = x + ff(x)
        return self.latent_norm(x).mean(dim=1)


class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim=16384, hidden=2048, bottleneck=256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, bottleneck),
        )
        self.last_layer = nn.Linear(bottleneck, out_dim, bias=False)

    def forward(self, x):
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class PerceiverDINO(nn.Module):
    def __init__(self, in_channels, out_dim=16384, **kwargs):
        super().__init__()
        self.backbone = PerceiverEncoder(in_channels, **kwargs)
        self.head = DINOHead(self.backbone.out_dim, out_dim)

    def forward(self, values, pos, input_mask=None):
        return self.head(self.backbone(values, pos, input_mask))


class DINOLoss(nn.Module):
    def __init__(self, out_dim, student_temp=0.1, teacher_temp=0.04, center_momentum=0.9):
        super().__init__()
        self.student_temp, self.teacher_temp = student_temp, teacher_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, student_out, teacher_out):
        s = F.log_softmax(student_out / self.student_temp, dim=-1)
        t = F.softmax((teacher_out - self.center) / self.teacher_temp, dim=-1).detach()
        loss = torch.sum(-t * s, dim=-1).mean()
        self.update_center(teacher_out)
        return loss

    @torch.no_grad()
    def update_center(self, teacher_out):
        batch_center = teacher_out.mean(dim=0, keepdim=True)  # expect: AMP004
        self.center.mul_(self.center_momentum).add_(batch_center, alpha=1.0 - self.center_momentum)


class MultiLabelClassifier(nn.Module):
    def __init__(self, in_channels, num_labels, **kwargs):
        super().__init__()
        self.backbone = PerceiverEncoder(in_channels, **kwargs)
        self.head = nn.Linear(self.backbone.out_dim, num_labels)

    def forward(self, values, pos, input_mask=None):
        return self.head(self.backbone(values, pos, input_mask))


@torch.no_grad()
def ema_update(teacher, student, momentum):
    for pt, ps in zip(teacher.parameters(), student.parameters()):
        pt.mul_(momentum).add_(ps.detach(), alpha=1.0 - momentum)


def pretrain_dino(loader, in_channels, epochs=100, lr=5e-4, momentum=0.996, queue_size=65536):
    student = PerceiverDINO(in_channels).cuda()
    teacher = PerceiverDINO(in_channels).cuda()
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    dino_loss = DINOLoss(16384).cuda()
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.04)
    queue = torch.zeros(queue_size, student.backbone.out_dim, dtype=torch.float16, device="cuda")
    ptr = 0
    for epoch in range(epochs):
        for (v_g, p_g, m_g), (v_l, p_l, m_l) in loader:
            v_g, p_g, m_g = v_g.cuda(), p_g.cuda(), m_g.cuda()
            v_l, p_l, m_l = v_l.cuda(), p_l.cuda(), m_l.cuda()
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                with torch.no_grad():
                    t_feats = teacher.backbone(v_g, p_g, m_g)
                    teacher_out = teacher.head(t_feats)
                student_out = student(v_l, p_l, m_l)
                loss = dino_loss(student_out, teacher_out)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 3.0)
            optimizer.step()
            ema_update(teacher, student, momentum)
            with torch.no_grad():
                bank = F.normalize(t_feats.half(), dim=-1)  # expect: AMP011
                n = bank.shape[0]
                idx = torch.arange(ptr, ptr + n, device=bank.device) % queue_size
                queue[idx] = bank
                ptr = (ptr + n) % queue_size
    return teacher, queue


def finetune_multilabel(loader, in_channels, num_labels, epochs=30, lr=3e-4):
    model = MultiLabelClassifier(in_channels, num_labels).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(epochs):
        model.train()
        for values, pos, mask, labels in loader:
            values, pos, mask, labels = values.cuda(), pos.cuda(), mask.cuda(), labels.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(values, pos, mask)
                probs = torch.sigmoid(logits)
                loss = F.binary_cross_entropy(probs, labels.float())  # expect: AMP003
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    return model


@torch.no_grad()
def evaluate_multilabel(model, loader, threshold=0.5):
    model.eval()
    tp = fp = fn = 0
    total_loss = 0.0
    for values, pos, mask, labels in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(values.cuda(), pos.cuda(), mask.cuda())
            total_loss += F.binary_cross_entropy_with_logits(logits, labels.cuda().float()).item()
        pred = logits.sigmoid() > threshold
        labels = labels.cuda().bool()
        tp += (pred & labels).sum().item()
        fp += (pred & ~labels).sum().item()
        fn += (~pred & labels).sum().item()
    return total_loss / max(1, len(loader)), 2 * tp / max(1, 2 * tp + fp + fn)
