"""AMP010 in a file that uses a GradScaler: only a scaler that can reach a function counts."""
import torch
from torch.amp import GradScaler


def train_with_local_scaler(model, loader, optimizer):
    scaler = GradScaler("cuda")
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def warmup_without_scaler(model, loader, optimizer):
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):  # AMP010
            loss = model(batch)
        loss.backward()
        optimizer.step()


def scaler_under_another_name(model, batch, optimizer, gs):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(batch)
    loss = gs.scale(loss)
    loss.backward()
    gs.step(optimizer)
    gs.update()


class ScalesThroughAMethod:
    def __init__(self, model):
        self.model = model
        self.gs = GradScaler("cuda")

    def scale_loss(self, loss):
        return self.gs.scale(loss)

    def train_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        loss = self.scale_loss(loss)
        loss.backward()


# ---- a classmethod trainer that hands its scaler on through cls.<method>(...) -------------
class ClassTrainer:
    @classmethod
    def run(cls, model, loader, optimizer, use_amp):
        scaler = torch.amp.GradScaler("cuda") if use_amp else None  # AMP010
        for _ in range(3):
            cls.train_one_epoch(model, loader, optimizer, scaler=scaler)

    @classmethod
    def train_one_epoch(cls, model, loader, optimizer, scaler):
        for batch in loader:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=scaler is not None):
                loss = model(batch)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()


class Fp16ClassTrainer:
    @classmethod
    def run(cls, model, loader, optimizer, use_amp):
        scaler = torch.amp.GradScaler("cuda") if use_amp else None
        cls.train_one_epoch(model, loader, optimizer, scaler=scaler)

    @classmethod
    def train_one_epoch(cls, model, loader, optimizer, scaler):
        for batch in loader:
            with torch.autocast("cuda", dtype=torch.float16, enabled=scaler is not None):
                loss = model(batch)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()


# ---- a scaler factory no code here calls: its scaler may reach any function, yet a loss made
# and backpropagated in a function that names no scaler is not scaled by it ----------------
def make_scaler(enabled=True):
    return torch.amp.GradScaler("cuda", enabled=enabled)


def train_probe_without_scaler(backbone, head, loader, optimizer):
    for x, y in loader:
        with torch.no_grad():
            feats = backbone(x)
        with torch.autocast("cuda", dtype=torch.float16):  # AMP010
            loss = torch.nn.functional.cross_entropy(head(feats), y)
        loss.backward()
        optimizer.step()


def train_scaling_through_a_helper(model, loader, optimizer, prepare):
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        loss = prepare(loss)
        loss.backward()
        optimizer.step()
