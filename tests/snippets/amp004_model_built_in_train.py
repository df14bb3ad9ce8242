"""AMP004/AMP007 in a model file whose training function builds the model: that model is the
one its uncalled ``sample(model)`` and trainer's ``model`` parameter hold, so the inverse
pass a sampler runs under ``no_grad`` does not count as a training run outside autocast."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CouplingNet(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, 2 * channels, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        spread = h.std(dim=(0, 2, 3), keepdim=True)  # AMP004
        return h / (spread.float() + 1e-3).to(h.dtype)


class Coupling(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.net = CouplingNet(channels // 2)

    def forward(self, x):
        x_a, x_b = x.chunk(2, dim=1)
        shift, scale = self.net(x_a).chunk(2, dim=1)
        return torch.cat([x_a, (x_b + shift) * torch.sigmoid(scale)], dim=1)

    def inverse(self, z):
        z_a, z_b = z.chunk(2, dim=1)
        shift, scale = self.net(z_a).chunk(2, dim=1)
        return torch.cat([z_a, z_b / torch.sigmoid(scale) - shift], dim=1)


class Flow(nn.Module):
    def __init__(self, channels=4, depth=3, vocab=16):
        super().__init__()
        self.steps = nn.ModuleList(Coupling(channels) for _ in range(depth))
        self.head = nn.Linear(channels, vocab)
        self.register_buffer("banned", torch.zeros(vocab, dtype=torch.bool))

    def forward(self, x):
        for step in self.steps:
            x = step(x)
        logits = self.head(x.mean(dim=(2, 3), dtype=torch.float32))
        return logits.masked_fill(self.banned, -1e9)  # AMP007

    def inverse(self, z):
        for step in reversed(self.steps):
            z = step.inverse(z)
        return z

    @torch.no_grad()
    def decode(self, z):
        logp = F.log_softmax(self.head(z.mean(dim=(2, 3))), dim=-1)
        logp[:, self.banned] = -1e9
        return logp.argmax(dim=-1)


@torch.no_grad()
def sample(model, shape, temperature=0.7):
    return model.inverse(torch.randn(shape) * temperature)


class Trainer:
    def __init__(self, model, device):
        self.model, self.device = model, torch.device(device)

    @torch.no_grad()
    def validate(self, z):
        with torch.autocast(self.device.type, dtype=torch.float16):
            return self.model.decode(z)


def train(loader, steps):
    model = Flow().cuda()
    optimizer = torch.optim.Adam(model.parameters())
    scaler = torch.amp.GradScaler("cuda")
    for _, (x, y) in zip(range(steps), loader):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return model
