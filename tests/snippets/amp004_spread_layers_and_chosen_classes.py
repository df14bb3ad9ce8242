"""AMP004/AMP011 through modules reached in ways model code builds them: an ``nn.Sequential``
spread from a list a helper fills in a loop, a class chosen by a conditional expression and
called through a name, and a scale computed from sizes kept on ``self``."""
import torch
import torch.nn.functional as F
from torch import nn


class ActNorm(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, features))

    @torch.no_grad()
    def initialize(self, x):
        self.loc.data.copy_(-x.mean(dim=0, keepdim=True))  # AMP004

    def forward(self, x):
        self.initialize(x)
        return x + self.loc


class UpcastActNorm(ActNorm):
    @torch.no_grad()
    def initialize(self, x):
        self.loc.data.copy_(-x.float().mean(dim=0, keepdim=True))


def coupling_net(features, hidden, depth=2):
    layers = [nn.Linear(features, hidden), ActNorm(hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), ActNorm(hidden), nn.ReLU()]
    layers.append(nn.Linear(hidden, features))
    return nn.Sequential(*layers)


def upcast_net(features, hidden):
    layers = [nn.Linear(features, hidden), UpcastActNorm(hidden)]
    return nn.Sequential(*layers)


class ArcHead(nn.Module):
    def __init__(self, features, classes):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, features))

    def forward(self, emb):
        return F.linear(F.normalize(emb.float()), F.normalize(self.weight))


class CosHead(nn.Module):
    def __init__(self, features, classes):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, features))

    def forward(self, emb):
        norms = torch.mm(emb.norm(dim=1, keepdim=True), self.weight.norm(dim=1, keepdim=True).t())
        return torch.mm(emb, self.weight.t()) / (norms + 1e-8)  # AMP011


class FloatCosHead(CosHead):
    def forward(self, emb):
        emb, weight = emb.float(), self.weight.float()
        with torch.autocast("cuda", enabled=False):
            norms = torch.mm(emb.norm(dim=1, keepdim=True), weight.norm(dim=1, keepdim=True).t())
            return torch.mm(emb, weight.t()) / (norms + 1e-8)


class Attention(nn.Module):
    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim ** -0.5
        self.to_q = nn.Linear(dim, dim)

    def forward(self, x):
        q = self.to_q(x) * self.scale
        return q.var(dim=-1)  # AMP004


class LearnedScaleAttention(Attention):
    def __init__(self, dim=256, heads=4):
        super().__init__(dim, heads)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        q = self.to_q(x) * self.scale
        return q.var(dim=-1)


class Model(nn.Module):
    def __init__(self, features, classes, arcface, upcast):
        super().__init__()
        self.flow = upcast_net(features, 64) if upcast else coupling_net(features, 64)
        head_cls = ArcHead if arcface else CosHead
        self.head = head_cls(features, classes)
        float_cls = FloatCosHead
        self.float_head = float_cls(features, classes)
        self.attn = Attention()
        self.learned = LearnedScaleAttention()

    def forward(self, x):
        h = self.flow(x)
        return self.head(h), self.float_head(h), self.attn(h), self.learned(h)


def train(loader, features, classes, args):
    model = Model(features, classes, args.arcface, args.upcast).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits, _, _, _ = model(x.cuda())
            loss = F.cross_entropy(logits, y.cuda())
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
