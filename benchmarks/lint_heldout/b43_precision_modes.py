"""Text classifier trainer whose precision mode is picked on the command line.

--mode amp        autocast + GradScaler
--mode pure_fp16  fp16 weights and activations, no autocast (memory-bound runs)
--mode fast       fp16 weights everywhere
--mode head       fine-tune the head only, autocast when --amp is given
"""
import argparse
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

HALF = torch.float16
FP32 = torch.float32


class Fp16StorageLinear(nn.Linear):
    """Linear layer whose weights are rounded to fp16 storage precision in the forward."""

    def forward(self, x):
        w = self.weight.half().float()
        return F.linear(x, w, self.bias)


class Classifier(nn.Module):
    def __init__(self, vocab=30000, dim=256, classes=4, fp16_storage=False):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, dim, mode="mean")
        lin = Fp16StorageLinear if fp16_storage else nn.Linear
        self.hidden = lin(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids, offsets):
        return self.head(F.gelu(self.hidden(self.emb(ids, offsets))))


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["amp", "pure_fp16", "fast", "head"], default="amp")
    p.add_argument("--precision", choices=["fp32", "pure_fp16"], default="fp32")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--pure_fp16", action="store_true")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=5)
    return p.parse_args(argv)


def build_model(args):
    model = Classifier(fp16_storage=args.mode == "fast")
    if args.precision == "pure_fp16":
        model = model.half()
    return model.cuda()


def fit(model, loader, args):
    model = model.to(HALF)  # expect: AMP001
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for _ in range(args.epochs):
        for ids, offsets, y in loader:
            loss = F.cross_entropy(model(ids, offsets).float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model


def train_mixed(model, loader, args):
    scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)
    if args.fp16:
        model = model.half()  # expect: AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # expect: AMP011
    for _ in range(args.epochs):
        for ids, offsets, y in loader:
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = F.cross_entropy(model(ids, offsets), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


def train_pure_fp16(model, loader, args):
    if args.pure_fp16:
        model = model.half()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # expect: AMP011
    for _ in range(args.epochs):
        for ids, offsets, y in loader:
            logits = model(ids, offsets)
            loss = F.cross_entropy(logits.float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def train_classifier_head(model, loader, args):
    ctx = torch.autocast("cuda", dtype=torch.float16) if args.amp else nullcontext()  # expect: AMP010
    model.emb.requires_grad_(False)
    optimizer = torch.optim.SGD(model.head.parameters(), lr=args.lr, momentum=0.9)
    for _ in range(args.epochs):
        for ids, offsets, y in loader:
            with ctx:
                loss = F.cross_entropy(model(ids, offsets), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def train_epoch(model, loader, optimizer, scaler, amp_ctx=torch.cuda.amp.autocast):  # expect: AMP009
    for ids, offsets, y in loader:
        with amp_ctx():
            loss = F.cross_entropy(model(ids, offsets), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


def train_step_flexible(model, batch, optimizer, scaler=None):
    ids, offsets, y = batch
    if scaler is not None:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(ids, offsets), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss = F.cross_entropy(model(ids, offsets), y)
        loss.backward()
    optimizer.step()  # expect: AMP006
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def make_loader(n=256, batch=32, vocab=30000, device="cuda"):
    batches = []
    for _ in range(n // batch):
        ids = torch.randint(0, vocab, (batch * 16,), device=device)
        offsets = torch.arange(0, batch * 16, 16, device=device)
        batches.append((ids, offsets, torch.randint(0, 4, (batch,), device=device)))
    return batches


def main(argv=None):
    args = parse_args(argv)
    loader = make_loader()
    model = build_model(args)
    if args.mode == "amp":
        if args.fp16:
            train_mixed(model, loader, args)
        else:
            scaler = torch.amp.GradScaler("cuda")
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-6)
            for _ in range(args.epochs):
                train_epoch(model, loader, optimizer, scaler)
            train_step_flexible(model, loader[0], optimizer, scaler)
    elif args.mode == "pure_fp16":
        train_pure_fp16(model, loader, args)
    elif args.mode == "fast":
        fit(model, loader, args)
    else:
        train_classifier_head(model, loader, args)


if __name__ == "__main__":
    main()
