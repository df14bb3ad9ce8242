"""Throughput benchmark of torchvision models in fp32 and mixed precision (training mode)."""
import argparse
import time

import torch
import torch.nn as nn
import torchvision.models as models
from torch.cuda.amp import GradScaler, autocast


def make_ctx(amp):
    return autocast() if amp else torch.autocast("cuda", enabled=False)  # expect: AMP009


def run_training(model, batch, steps, amp):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    scaler = GradScaler(enabled=amp)  # expect: AMP009
    images, labels = batch
    torch.cuda.synchronize()
    start = time.time()
    for _ in range(steps):
        optimizer.zero_grad()
        with make_ctx(amp):
            loss = criterion(model(images), labels)
            scaler.scale(loss).backward()  # expect: AMP008
        scaler.step(optimizer)
        scaler.update()
    torch.cuda.synchronize()
    return steps * images.size(0) / (time.time() - start)


def run_training_bf16(model, batch, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    images, labels = batch
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images)
            loss = criterion(out, labels)
        loss.backward()
        optimizer.step()


class StepTimer:
    def __init__(self, model, optimizer, dtype=torch.float16):
        self.model = model
        self.optimizer = optimizer
        self.dtype = dtype
        self.scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)

    def step(self, images, labels):
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=self.dtype):
            loss = nn.functional.cross_entropy(self.model(images), labels)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def step_with_grad_check(self, images, labels):
        with torch.autocast("cuda", dtype=self.dtype):
            loss = nn.functional.cross_entropy(self.model(images), labels)
            grads = torch.autograd.grad(self.scaler.scale(loss), list(self.model.parameters()),
                                        retain_graph=True)
        return [g.norm() for g in grads]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    model = models.__dict__[args.arch]().cuda().train()
    batch = (torch.randn(args.batch_size, 3, 224, 224, device="cuda"),
             torch.randint(0, 1000, (args.batch_size,), device="cuda"))
    for amp in (False, True):
        print(args.arch, "amp" if amp else "fp32", run_training(model, batch, args.steps, amp))


if __name__ == "__main__":
    main()
