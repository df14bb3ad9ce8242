"""Keyword spotting on Speech Commands with a TC-ResNet (temporal convolutions).

Trained on CPU with bfloat16 autocast so that the same recipe runs on the
edge build farm, which has no GPUs.
"""
import argparse
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

LABELS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go", "_silence_", "_unknown_"]


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduction=4):
        super().__init__()
        self.fc1 = nn.Linear(channels, channels // reduction)
        self.fc2 = nn.Linear(channels // reduction, channels)

    def forward(self, x):
        s = x.sum(dim=-1) / x.size(-1)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s.unsqueeze(-1)


class TCBlock(nn.Module):
    def __init__(self, c_in, c_out, stride, use_se=True):
        super().__init__()
        self.conv1 = nn.Conv1d(c_in, c_out, 9, stride=stride, padding=4, bias=False)
        self.bn1 = nn.BatchNorm1d(c_out)
        self.conv2 = nn.Conv1d(c_out, c_out, 9, padding=4, bias=False)
        self.bn2 = nn.BatchNorm1d(c_out)
        self.se = SqueezeExcite(c_out) if use_se else nn.Identity()
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv1d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm1d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.se(self.conv2(out)))
        return F.relu(out + self.shortcut(x))


class TCResNet(nn.Module):
    def __init__(self, n_mels=40, n_classes=12, widths=(16, 24, 32, 48), use_se=True, emb_dim=64):
        super().__init__()
        self.stem = nn.Conv1d(n_mels, widths[0], 3, padding=1, bias=False)
        self.blocks = nn.ModuleList(
            [TCBlock(widths[i], widths[i + 1], stride=2, use_se=use_se) for i in range(len(widths) - 1)]
        )
        self.proj = nn.Conv1d(widths[-1], emb_dim, 1)
        self.head = nn.Linear(2 * emb_dim, n_classes)

    def _stats_pool(self, h):
        return {
            "mean": h.mean(dim=-1),  # expect: AMP004
            "std": h.std(dim=-1),  # expect: AMP004
        }

    def forward(self, x):
        x = self.stem(x)
        x = x / (x.abs().amax(dim=(1, 2), keepdim=True) + 1e-9)
        for i, block in enumerate(self.blocks):
            x = block(x)
        emb = self.proj(x)
        stats = self._stats_pool(emb)
        return self.head(torch.cat([stats["mean"], stats["std"]], dim=1))


def spec_augment(feats, max_f=8, max_t=20):
    feats = feats.clone()
    n_mels, n_frames = feats.shape[-2:]
    f = random.randint(0, max_f)
    f0 = random.randint(0, n_mels - f)
    feats[..., f0:f0 + f, :] = 0.0
    t = random.randint(0, max_t)
    t0 = random.randint(0, max(n_frames - t, 0))
    time_mask = torch.zeros(n_frames, dtype=torch.bool)
    time_mask[t0:t0 + t] = True
    return feats.masked_fill(time_mask, 0.0)


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    correct = total = 0
    for feats, labels in loader:
        with torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
            logits = model(feats)
        correct += (logits.argmax(dim=-1) == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / max(total, 1)


def train(args, train_loader, val_loader):
    torch.manual_seed(args.seed)
    model = TCResNet(n_mels=args.n_mels, n_classes=len(LABELS), use_se=not args.no_se)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-3, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_loader)
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    scaler = torch.amp.GradScaler("cpu")  # expect: AMP010
    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        for it, (feats, labels) in enumerate(train_loader):
            feats = spec_augment(feats)
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                logits = model(feats)
                loss = criterion(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if it % args.log_every == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}")
        acc = evaluate(model, val_loader)
        if acc > best_acc:
            best_acc = acc
            torch.save(model.state_dict(), args.ckpt)
        print(f"epoch {epoch}: val acc {acc:.4f} (best {best_acc:.4f})")
    return best_acc


def main():
    parser = argparse.ArgumentParser(description="TC-ResNet keyword spotting")
    parser.add_argument("--n-mels", dest="n_mels", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-se", dest="no_se", action="store_true")
    parser.add_argument("--log-every", dest="log_every", type=int, default=100)
    parser.add_argument("--ckpt", default="tcresnet_kws.pt")
    args = parser.parse_args()
    from speech_commands import build_loaders  # project-local data pipeline

    train_loader, val_loader = build_loaders(args)
    train(args, train_loader, val_loader)


if __name__ == "__main__":
    main()
