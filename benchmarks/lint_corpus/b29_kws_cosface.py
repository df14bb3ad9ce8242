"""Small-footprint keyword spotting with a large-margin cosine classifier.

Log-mel frontend -> depthwise-separable 1D conv stages with LayerScale and
stochastic depth -> attentive statistics pooling -> standardised embedding ->
additive-margin (CosFace) softmax over the keyword classes.
"""
import argparse
import copy
import math
import os
from typing import List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio


class LogMelFrontend(nn.Module):
    def __init__(self, sample_rate=16000, n_fft=480, hop=160, n_mels=40):
        super().__init__()
        self.hop = hop
        self.melspec = torchaudio.transforms.MelSpectrogram(
            sample_rate, n_fft=n_fft, hop_length=hop, n_mels=n_mels)

    def forward(self, wav):
        with torch.autocast("cuda", enabled=False):
            spec = self.melspec(wav.float())
            spec = torch.log(spec + 1e-8)
            spec = spec - spec.mean(dim=-1, keepdim=True)
        return spec


def drop_path(x, drop_prob: float = 0.0, training: bool = False):
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    return x.div(keep_prob) * random_tensor


class DropPath(nn.Module):
    def __init__(self, drop_prob=0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class LayerScale(nn.Module):
    def __init__(self, dim, init_values=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma[:, None]


class DSConvBlock(nn.Module):
    def __init__(self, dim, kernel=9, mlp_ratio=4, drop_path=0.0, ls_init=1e-5):
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel, padding=kernel // 2, groups=dim)
        self.norm = nn.GroupNorm(1, dim)
        self.pw1 = nn.Conv1d(dim, dim * mlp_ratio, 1)
        self.pw2 = nn.Conv1d(dim * mlp_ratio, dim, 1)
        self.ls = LayerScale(dim, ls_init)
        self.drop_path = DropPath(drop_path)

    def forward(self, x):
        y = self.pw2(F.gelu(self.pw1(self.norm(self.dwconv(x)))))
        return x + self.drop_path(self.ls(y))


class AttentiveStatsPool(nn.Module):
    def __init__(self, dim, bottleneck=64):
        super().__init__()
        self.attn = nn.Sequential(nn.Conv1d(dim, bottleneck, 1), nn.Tanh(), nn.Conv1d(bottleneck, 1, 1))

    def forward(self, x, mask):
        scores = self.attn(x).squeeze(1)
        scores[~mask] = -1e9  # expect: AMP007
        w = torch.softmax(scores, dim=-1).unsqueeze(1)
        mu = torch.sum(x * w, dim=-1)
        var = torch.sum(x * x * w, dim=-1) - mu * mu
        return torch.cat([mu, torch.sqrt(var.clamp(min=1e-5))], dim=1)


class KWSEncoder(nn.Module):
    def __init__(self, n_mels=40, dims: Sequence[int] = (64, 96, 128), depths: Sequence[int] = (2, 2, 4),
                 emb_dim=192, drop_path_rate=0.1):
        super().__init__()
        self.frontend = LogMelFrontend(n_mels=n_mels)
        self.stem = nn.Sequential(nn.Conv1d(n_mels, dims[0], 5, stride=2, padding=2), nn.GELU())
        dpr = [r.item() for r in torch.linspace(0, drop_path_rate, sum(depths))]
        self.stages = nn.ModuleList()
        cur = 0
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            layers: List[nn.Module] = []
            if i > 0:
                layers.append(nn.Conv1d(dims[i - 1], dim, 1))
            layers += [DSConvBlock(dim, drop_path=dpr[cur + j]) for j in range(depth)]
            self.stages.append(nn.Sequential(*layers))
            cur += depth
        self.pool = AttentiveStatsPool(dims[-1])
        self.embed = nn.Linear(2 * dims[-1], emb_dim)

    def _frame_mask(self, lengths, num_frames):
        frames = torch.div(lengths, self.frontend.hop * 2, rounding_mode="floor") + 1
        return torch.arange(num_frames, device=lengths.device)[None, :] < frames[:, None]

    def _standardize(self, emb):
        mu = emb.mean(dim=-1, keepdim=True)  # expect: AMP004
        sd = emb.std(dim=-1, keepdim=True)  # expect: AMP004
        return (emb - mu) / (sd + 1e-8)  # expect: AMP011

    def forward(self, wav, lengths):
        x = self.stem(self.frontend(wav))
        for stage in self.stages:
            x = stage(x)
        pooled = self.pool(x, self._frame_mask(lengths, x.size(-1)))
        return self._standardize(self.embed(pooled))


class AddMarginProduct(nn.Module):
    """Large-margin cosine head: s * (cos(theta) - m) for the target class."""

    def __init__(self, in_features, out_features, s=30.0, m=0.35):
        super().__init__()
        self.s, self.m = s, m
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.xavier_uniform_(self.weight)
        self.last_pos_cos = None

    def forward(self, emb, label=None):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight))
        if label is None:
            return cosine * self.s
        one_hot = torch.zeros_like(cosine)
        one_hot.scatter_(1, label.view(-1, 1), 1.0)
        with torch.no_grad():
            self.last_pos_cos = cosine.gather(1, label.view(-1, 1)).mean()  # expect: AMP004
        return self.s * (cosine - one_hot * self.m)


MODELS = {"dsconv-kws": KWSEncoder}


def build_model(args):
    encoder = MODELS[args.arch](n_mels=args.n_mels, emb_dim=args.emb_dim)
    head = AddMarginProduct(args.emb_dim, args.num_classes, s=args.scale, m=args.margin)
    return encoder, head


def train_epoch(encoder, head, loader, optimizer, criterion, scheduler, epoch, args):
    encoder.train()
    head.train()
    params = list(encoder.parameters()) + list(head.parameters())
    for step, (wav, lengths, labels) in enumerate(loader):
        wav, lengths, labels = wav.cuda(non_blocking=True), lengths.cuda(), labels.cuda()
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            emb = encoder(wav, lengths)
            logits = head(emb, labels)
        loss = criterion(logits, labels)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        optimizer.step()
        scheduler.step()
        if step % args.log_every == 0:
            print(f"epoch {epoch} step {step} loss {loss.item():.4f} pos_cos {float(head.last_pos_cos):.3f}")


@torch.no_grad()
def evaluate(encoder, head, loader):
    encoder.eval()
    head.eval()
    correct = total = 0
    emb_norms = []
    for wav, lengths, labels in loader:
        wav, lengths, labels = wav.cuda(), lengths.cuda(), labels.cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            emb = encoder(wav, lengths)
            logits = head(emb)
        emb_norms.append(emb.norm(dim=-1).mean())
        correct += (logits.argmax(-1) == labels).sum().item()
        total += labels.numel()
    return correct / total, torch.stack(emb_norms).mean().item()


def export_onnx(encoder, path, num_samples=16000):
    model = copy.deepcopy(encoder).half().eval()
    wav = torch.randn(1, num_samples, device="cuda", dtype=torch.float16)
    lengths = torch.tensor([num_samples], device="cuda")
    torch.onnx.export(model, (wav, lengths), path, input_names=["wav", "lengths"], output_names=["emb"],
                      dynamic_axes={"wav": {1: "samples"}}, opset_version=17)


def main():
    parser = argparse.ArgumentParser(description="keyword spotting")
    parser.add_argument("--data", default="data/speech_commands_v2")
    parser.add_argument("--arch", default="dsconv-kws")
    parser.add_argument("--n-mels", type=int, default=40)
    parser.add_argument("--emb-dim", type=int, default=192)
    parser.add_argument("--num-classes", type=int, default=35)
    parser.add_argument("--scale", type=float, default=30.0)
    parser.add_argument("--margin", type=float, default=0.35)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args()

    train_set = torch.load(os.path.join(args.data, "train.pt"))
    valid_set = torch.load(os.path.join(args.data, "valid.pt"))
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=256, shuffle=True, num_workers=8, drop_last=True)
    valid_loader = torch.utils.data.DataLoader(valid_set, batch_size=512)

    encoder, head = build_model(args)
    encoder, head = encoder.cuda(), head.cuda()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.AdamW(list(encoder.parameters()) + list(head.parameters()),
                                  lr=args.lr, eps=1e-8, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_loader))
    for epoch in range(args.epochs):
        train_epoch(encoder, head, train_loader, optimizer, criterion, scheduler, epoch, args)
        acc, emb_norm = evaluate(encoder, head, valid_loader)
        print(f"epoch {epoch} valid acc {acc:.4f} |emb| {emb_norm:.3f}")
    torch.save({"encoder": encoder.state_dict(), "head": head.state_dict()}, "kws.pt")
    export_onnx(encoder, "kws.onnx")


if __name__ == "__main__":
    main()
