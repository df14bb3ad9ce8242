"""AMP011 in a file without a tiny literal: Adam's default eps over fp16 parameters."""
import torch
import torch.nn as nn


def train_half_model_with_default_eps(loader):
    model = nn.Linear(16, 4).cuda().half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # AMP011
    for x, y in loader:
        nn.functional.mse_loss(model(x.half()).float(), y).backward()
        optimizer.step()


def train_fp32_model_with_default_eps(loader):
    model = nn.Linear(16, 4).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def train_half_model_with_safe_eps(loader):
    model = nn.Linear(16, 4).cuda().half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    for x, y in loader:
        nn.functional.mse_loss(model(x.half()).float(), y).backward()
        optimizer.step()
