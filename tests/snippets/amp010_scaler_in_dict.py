"""AMP010: a GradScaler kept in a dict and read back under the name ``scaler`` is used."""
import torch


def load_state(path):
    state = {"epoch": 0}
    state["scaler"] = torch.amp.GradScaler("cuda")
    return state


def train_resumed(model, loader, optimizer, path):
    state = load_state(path)
    scaler = state["scaler"]
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = (model(x).float() - y).abs().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
