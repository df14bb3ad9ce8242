# AMP011 through module calls: epsilons added to the output of a module built in this file.
import torch
import torch.nn as nn


class Encoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, x):
        return self.body(x)


class NormedEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.fc(x))


def fp16_scale(x):
    enc = Encoder(64).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        h = enc(x)
        return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)  # AMP011


def bf16_scale(x):
    enc = Encoder(64).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = enc(x)
        return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)


def layer_norm_output_is_fp32(x):
    enc = NormedEncoder(64).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        h = enc(x)
        return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)


def outside_autocast(x):
    enc = Encoder(64).cuda()
    h = enc(x)
    return h / (h.abs().amax(dim=-1, keepdim=True) + 1e-8)
