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


def train_model_loaded_in_fp16_with_default_eps(name, loader):
    model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.float16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # AMP011
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()


def train_adapters_added_to_a_frozen_half_model(loader):
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).cuda().half()
    model.requires_grad_(False)
    attach_adapters(model)
    optimizer = torch.optim.AdamW(filter(lambda p: p.requires_grad, model.parameters()))
    for x, y in loader:
        nn.functional.mse_loss(model(x).float(), y).backward()
        optimizer.step()


def train_half_model_picked_by_requires_grad(loader):
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).cuda().half()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])  # AMP011
    for x, y in loader:
        nn.functional.mse_loss(model(x.half()).float(), y).backward()
        optimizer.step()


def lora_by_name_on_a_base_loaded_in_fp16(name, loader):
    model = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.float16)
    model.requires_grad_(False)
    inject_lora(model, r=8)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.AdamW(params, lr=2e-4)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()
