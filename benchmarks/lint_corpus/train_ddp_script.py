"""Distributed example trainer: torchrun --nproc_per_node=8 train_ddp_script.py"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.cuda import amp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, models, transforms

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)

EPOCHS = 90
BATCH = 128
CLIP = 2.0
USE_AMP = True

tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.ToTensor()])
dataset = datasets.ImageFolder(os.environ.get("DATA", "imagenet/train"), tf)
sampler = DistributedSampler(dataset)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=8, pin_memory=True)

model = models.resnet50().to(device)
model = DDP(model, device_ids=[local_rank])
criterion = nn.CrossEntropyLoss().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * dist.get_world_size(), momentum=0.9, weight_decay=1e-4)
scaler = amp.GradScaler(enabled=USE_AMP)  # expect: AMP009

for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    model.train()
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", enabled=USE_AMP):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
    if local_rank == 0:
        torch.save({"model": model.module.state_dict(), "scaler": scaler.state_dict()}, f"ckpt_{epoch}.pt")

for epoch in range(2):
    for images, target in loader:
        with torch.autocast("cuda", enabled=USE_AMP):
            loss = criterion(model(images.to(device)), target.to(device))
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad()

dist.destroy_process_group()
