"""Hook-driven training engine for a small text classifier.

The runner owns the loop; everything else (logging, EMA, checkpoints) is a hook.
Mixed precision lives in AmpOptimWrapper, which owns the optimizer and the loss scaler.

    python b38_engine_hooks.py --work-dir runs/cls --epochs 10 --accum 2 --clip 1.0
"""
import argparse
import copy
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------- model
class SelfAttention(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :],
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class AttentionPool(nn.Module):
    """Learned attention pooling over tokens; padding positions get no weight."""

    def __init__(self, dim):
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, x, mask):
        scores = self.score(x).squeeze(-1)
        scores.masked_fill_(~mask, -1e9)  # expect: AMP007
        weights = scores.softmax(dim=-1)
        return torch.bmm(weights.unsqueeze(1).to(x.dtype), x).squeeze(1)


class TextClassifier(nn.Module):
    def __init__(self, vocab, num_classes, dim=256, depth=4, heads=4, max_len=512):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.pool = AttentionPool(dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens, mask):
        x = self.tok(tokens) + self.pos[:, : tokens.size(1)]
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.drop(self.pool(self.norm(x), mask)))


# --------------------------------------------------------------------------- optim wrapper
class AmpOptimWrapper:
    """Scaled backward per micro-batch, one optimizer update every `accumulative_counts`."""

    def __init__(self, optimizer, params, clip_grad=None, accumulative_counts=1, init_scale=2.0 ** 16):
        self.optimizer = optimizer
        self.params = list(params)
        self.clip_grad = clip_grad
        self.accumulative_counts = accumulative_counts
        try:
            self.scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)
        except (AttributeError, TypeError):  # torch < 2.3
            self.scaler = torch.cuda.amp.GradScaler(init_scale=init_scale)
        self._inner_count = 0

    def accumulate(self, loss):
        self.scaler.scale(loss / self.accumulative_counts).backward()  # expect: AMP008
        self._inner_count += 1

    def should_update(self):
        return self._inner_count % self.accumulative_counts == 0

    def step(self):
        grad_norm = None
        if self.clip_grad is not None:
            grad_norm = nn.utils.clip_grad_norm_(self.params, max_norm=self.clip_grad)  # expect: AMP005
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return grad_norm

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "inner_count": self._inner_count}

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scaler.load_state_dict(sd["scaler"])
        self._inner_count = sd["inner_count"]


# --------------------------------------------------------------------------- hooks
class Hook:
    priority = 50

    def before_train(self, runner): ...
    def before_train_iter(self, runner, batch_idx): ...
    def before_backward(self, runner, loss): ...
    def after_step(self, runner, grad_norm): ...
    def after_train_iter(self, runner, batch_idx, loss): ...
    def after_train_epoch(self, runner): ...
    def after_val_epoch(self, runner, metrics): ...


class LossSpikeHook(Hook):
    priority = 10

    def before_backward(self, runner, loss):
        if not torch.isfinite(loss).all():
            raise FloatingPointError(f"non-finite loss at iter {runner.iter}")


class EMAHook(Hook):
    def __init__(self, momentum=0.999):
        self.momentum = momentum
        self.ema = None

    def before_train(self, runner):
        self.ema = copy.deepcopy(runner.model).eval().requires_grad_(False)

    @torch.no_grad()
    def after_step(self, runner, grad_norm):
        for e, p in zip(self.ema.parameters(), runner.model.parameters()):
            e.mul_(self.momentum).add_(p.detach(), alpha=1 - self.momentum)


class LoggerHook(Hook):
    def __init__(self, interval=50):
        self.interval = interval
        self.buffer = []

    def after_train_iter(self, runner, batch_idx, loss):
        self.buffer.append(loss)
        if runner.iter % self.interval == 0 and self.buffer:
            print(json.dumps({"iter": runner.iter, "loss": float(np.mean(self.buffer)),
                              "lr": runner.optim_wrapper.optimizer.param_groups[0]["lr"]}))
            self.buffer.clear()

    def after_val_epoch(self, runner, metrics):
        print(json.dumps({"epoch": runner.epoch, **metrics}))


class CheckpointHook(Hook):
    priority = 90

    def __init__(self, interval=1):
        self.interval = interval
        self.best_acc = -1e9

    def after_val_epoch(self, runner, metrics):
        if (runner.epoch + 1) % self.interval == 0:
            runner.save_checkpoint(os.path.join(runner.work_dir, "latest.pth"))
        if metrics["acc"] > self.best_acc:
            self.best_acc = metrics["acc"]
            runner.save_checkpoint(os.path.join(runner.work_dir, "best.pth"))


# --------------------------------------------------------------------------- runner
class Runner:
    def __init__(self, model, train_loader, val_loader, cfg):
        self.model = model
        self.train_loader, self.val_loader = train_loader, val_loader
        self.work_dir, self.max_epochs, self.device = cfg.work_dir, cfg.epochs, cfg.device
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.wd)
        self.optim_wrapper = AmpOptimWrapper(optimizer, model.parameters(), clip_grad=cfg.clip,
                                             accumulative_counts=cfg.accum)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=cfg.lr, total_steps=cfg.epochs * len(train_loader) // cfg.accum + 1)
        self.hooks = sorted([LossSpikeHook(), EMAHook(), LoggerHook(), CheckpointHook()],
                            key=lambda h: h.priority)
        self.epoch, self.iter = 0, 0

    def call_hook(self, name, **kwargs):
        for hook in self.hooks:
            getattr(hook, name)(self, **kwargs)

    def train_iter(self, idx, batch):
        self.call_hook("before_train_iter", batch_idx=idx)
        tokens, mask, labels = (t.to(self.device, non_blocking=True) for t in batch)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = self.model(tokens, mask)
            loss = self.criterion(logits, labels)
            self.call_hook("before_backward", loss=loss)
            self.optim_wrapper.accumulate(loss)
        if self.optim_wrapper.should_update():
            grad_norm = self.optim_wrapper.step()
            self.optim_wrapper.zero_grad()
            self.scheduler.step()
            self.call_hook("after_step", grad_norm=grad_norm)
        self.iter += 1
        self.call_hook("after_train_iter", batch_idx=idx, loss=loss.item())

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        correct, total, loss_sum = 0, 0, 0.0
        for tokens, mask, labels in self.val_loader:
            tokens, mask, labels = tokens.to(self.device), mask.to(self.device), labels.to(self.device)
            with torch.cuda.amp.autocast(dtype=torch.float16):  # expect: AMP009
                logits = self.model(tokens, mask)
                loss = self.criterion(logits, labels)
            loss_sum += loss.item() * labels.numel()
            correct += (logits.argmax(-1) == labels).sum().item()
            total += labels.numel()
        self.model.train()
        return {"acc": correct / max(total, 1), "val_loss": loss_sum / max(total, 1)}

    def run(self):
        self.call_hook("before_train")
        self.model.train()
        while self.epoch < self.max_epochs:
            t0 = time.time()
            for idx, batch in enumerate(self.train_loader):
                self.train_iter(idx, batch)
            self.call_hook("after_train_epoch")
            metrics = self.evaluate()
            metrics["epoch_time"] = time.time() - t0
            self.call_hook("after_val_epoch", metrics=metrics)
            self.epoch += 1

    def save_checkpoint(self, path):
        torch.save({"model": self.model.state_dict(), "optim": self.optim_wrapper.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "epoch": self.epoch + 1, "iter": self.iter}, path)

    def resume(self, path):
        ckpt = torch.load(path, map_location="cpu")
        self.model.load_state_dict(ckpt["model"])
        self.optim_wrapper.load_state_dict(ckpt["optim"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.epoch, self.iter = ckpt["epoch"], ckpt["iter"]


# --------------------------------------------------------------------------- data + main
def synthetic_loader(n, vocab, seq_len, num_classes, batch_size, shuffle):
    lengths = torch.randint(seq_len // 4, seq_len + 1, (n,))
    tokens = torch.randint(1, vocab, (n, seq_len))
    mask = torch.arange(seq_len)[None, :] < lengths[:, None]
    tokens = tokens.masked_fill(~mask, 0)
    labels = tokens[:, 0] % num_classes
    ds = torch.utils.data.TensorDataset(tokens, mask, labels)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, drop_last=shuffle)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--work-dir", default="runs/textcls")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--num-classes", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--resume", default=None)
    p.add_argument("--device", default="cuda")
    return p.parse_args()


def main():
    cfg = parse_args()
    os.makedirs(cfg.work_dir, exist_ok=True)
    torch.manual_seed(0)
    model = TextClassifier(cfg.vocab, cfg.num_classes, max_len=cfg.seq_len)
    model.to(cfg.device)
    train_loader = synthetic_loader(20000, cfg.vocab, cfg.seq_len, cfg.num_classes, cfg.batch_size, True)
    val_loader = synthetic_loader(2000, cfg.vocab, cfg.seq_len, cfg.num_classes, cfg.batch_size, False)
    runner = Runner(model, train_loader, val_loader, cfg)
    if cfg.resume:
        runner.resume(cfg.resume)
    runner.run()


if __name__ == "__main__":
    main()
