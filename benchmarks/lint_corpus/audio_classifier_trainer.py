"""Audio event classifier trainer (spectrogram CNN), written as a small trainer class."""
import copy
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)
TARGET_DTYPE = "torch.cuda.HalfTensor"


class SpecAugment(nn.Module):
    def __init__(self, freq_mask=24, time_mask=64):
        super().__init__()
        self.freq_mask = freq_mask
        self.time_mask = time_mask

    def forward(self, spec):
        if not self.training:
            return spec
        b, f, t = spec.shape
        f0 = torch.randint(0, f - self.freq_mask, (1,)).item()
        t0 = torch.randint(0, t - self.time_mask, (1,)).item()
        spec = spec.clone()
        spec[:, f0 : f0 + self.freq_mask, :] = 0
        spec[:, :, t0 : t0 + self.time_mask] = 0
        return spec


class Trainer:
    def __init__(self, model, cfg, device="cuda"):
        self.cfg = cfg
        self.device = device
        self.model = model.to(device, memory_format=torch.channels_last)
        self.augment = SpecAugment()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9)
        self.dtype = torch.float32

    def _prepare(self, batch):
        spec = batch["spec"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, dtype=self.dtype)
        return self.augment(spec), labels

    def train_epoch(self, loader):
        self.model.train()
        for batch in loader:
            spec, labels = self._prepare(batch)
            spec = spec.type(TARGET_DTYPE)  # expect: AMP001
            logits = self.model(spec.unsqueeze(1))
            loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()

    def train_epoch_string_type(self, loader):
        self.model.train()
        for batch in loader:
            spec, labels = self._prepare(batch)
            logits = self.model(spec.unsqueeze(1).type("torch.cuda.HalfTensor"))  # expect: AMP001
            loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()

    def train_epoch_half_model(self, loader):
        self.model = self.model.to(self.device, torch.bfloat16)  # expect: AMP001
        self.model.train()
        for batch in loader:
            spec, labels = self._prepare(batch)
            logits = self.model(spec.unsqueeze(1).to(torch.bfloat16))  # expect: AMP001
            loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()

    @torch.inference_mode()
    def predict(self, spec):
        self.model.eval()
        return torch.sigmoid(self.model(spec.to(self.device).half().unsqueeze(1)))

    def export_half(self, path):
        model = copy.deepcopy(self.model).half().eval()
        example = torch.randn(1, 1, 128, 400, device=self.device, dtype=torch.float16)
        torch.jit.trace(model, example).save(path)


def compact_checkpoint(path, out):
    state = torch.load(path, map_location="cpu")
    state["model"] = {k: v.half() if v.is_floating_point() else v for k, v in state["model"].items()}
    torch.save(state, out)
