"""AMP010 where a factory builds the GradScaler: it reaches where the factory's callers put it."""
import torch

HALF = torch.float16


def make_scaler(precision):
    return torch.amp.GradScaler("cuda", enabled=precision == "fp16")


def run(model, loader, optimizer, precision="fp16"):
    scaler = make_scaler(precision)
    for batch in loader:
        with torch.autocast("cuda", dtype=HALF):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def quick_check(model, batch, optimizer):
    with torch.autocast("cuda", dtype=HALF):  # AMP010
        loss = model(batch)
    loss.backward()
    optimizer.step()
