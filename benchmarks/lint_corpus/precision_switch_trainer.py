"""A trainer whose precision is picked from a config string: fp32, fp16 (scaled) or bf16."""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Config:
    precision: str = "bf16"
    lr: float = 3e-4
    grad_clip: float = 1.0
    accum: int = 1


def autocast_context(precision):
    if precision == "fp32":
        return nullcontext()
    return torch.autocast("cuda", dtype=PRECISIONS[precision])


class Trainer:
    def __init__(self, model, cfg: Config):
        self.model = model.cuda()
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, fused=True)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")
        self.ctx = autocast_context(cfg.precision)

    def step(self, batch, step):
        with self.ctx:
            logits = self.model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        self.scaler.scale(loss / self.cfg.accum).backward()
        if (step + 1) % self.cfg.accum == 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    @torch.no_grad()
    def eval_step(self, batch):
        with self.ctx:
            logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


class SharedScalerTrainer:
    """Pretraining in fp16 and a bf16 fine-tuning phase share one scaler object."""

    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler("cuda")

    def pretrain_step(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(**batch).loss
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()

    def finetune_step(self, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.model(**batch).loss
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()


class BF16OnlyTrainer:
    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.grad_scaler = torch.amp.GradScaler()  # expect: AMP010

    def train_step(self, batch):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = self.model(**batch).loss
        self.grad_scaler.scale(loss).backward()
        self.grad_scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


def deepspeed_step(engine, batch):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()


def sam_step(model, batch, optimizer, scaler):
    """Sharpness-aware minimisation: two forward/backward passes per step."""
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    optimizer.first_step(zero_grad=True)
    with torch.autocast("cuda", dtype=torch.float16):
        loss2 = F.cross_entropy(model(batch["x"]), batch["y"])
    scaler.scale(loss2).backward()
    scaler.unscale_(optimizer)
    optimizer.second_step(zero_grad=True)
    scaler.update()
