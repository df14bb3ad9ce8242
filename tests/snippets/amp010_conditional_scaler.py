"""AMP010 with a GradScaler held through a conditional expression (``GradScaler() if amp else
None``): the construction is the line to delete when the autocast is bf16."""
import torch
import torch.nn.functional as F


def train_bf16(model, loader, optimizer, args):
    scaler = torch.amp.GradScaler("cuda") if args.amp else None  # AMP010
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()


def train_fp16(model, loader, optimizer, args):
    scaler = torch.amp.GradScaler("cuda") if args.amp else None
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()


def train_fp16_unchecked_scaler(model, loader, optimizer, use_scaler):
    scaler = None if not use_scaler else torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
