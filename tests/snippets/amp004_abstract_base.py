"""AMP004 through a base class whose ``forward`` calls methods its subclasses implement (the
base's own raise NotImplementedError)."""
import torch
import torch.nn.functional as F
from torch import nn


class ForecasterBase(nn.Module):
    def encode(self, x):
        raise NotImplementedError

    def project(self, h):
        """Maps the encoding to the output."""
        raise NotImplementedError

    def forward(self, x):
        return self.project(self.encode(x))


class PatchForecaster(ForecasterBase):
    def __init__(self, d):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.head = nn.Linear(d, 1)

    def encode(self, x):
        return self.embed(x)

    def project(self, h):
        return self.head(h)


class StatsClassifier(PatchForecaster):
    def __init__(self, d, classes):
        super().__init__(d)
        self.classifier = nn.Linear(2 * d, classes)

    def project(self, h):
        mean = h.mean(dim=1)  # AMP004
        std = h.std(dim=1)  # AMP004
        return self.classifier(torch.cat([mean, std], dim=-1))


class UpcastEncoderBase(nn.Module):
    def encode(self, x):
        ...

    def forward(self, x):
        h = self.encode(x)
        return h.mean(dim=1)


class UpcastEncoder(UpcastEncoderBase):
    def __init__(self, d):
        super().__init__()
        self.embed = nn.Linear(16, d)

    def encode(self, x):
        return self.embed(x).float()


MODELS = {"forecast": PatchForecaster, "classify": StatsClassifier, "upcast": UpcastEncoder}


def train(cfg, loader, optimizer, scaler):
    model = MODELS[cfg.task](cfg.d).cuda()
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


# ---- a base class's forward for each subclass: its self.encode is the subclass's ----------


class TowerBase(nn.Module):
    def __init__(self, width, embed_dim):
        super().__init__()
        self.proj = nn.Linear(width, embed_dim, bias=False)

    def encode(self, x):
        raise NotImplementedError

    def pool(self, h, x):
        raise NotImplementedError

    def forward(self, x):
        h = self.encode(x)
        return self.proj(self.pool(h, x))


class ConvTower(TowerBase):
    def __init__(self, width=64, embed_dim=32):
        super().__init__(width, embed_dim)
        self.body = nn.Sequential(nn.Conv2d(3, width, 3), nn.GELU(), nn.Conv2d(width, width, 1))

    def encode(self, x):
        return self.body(x)

    def pool(self, h, x):
        return h.mean(dim=(2, 3))  # AMP004


class NormedTextTower(TowerBase):
    def __init__(self, vocab=1000, width=64, embed_dim=32):
        super().__init__(width, embed_dim)
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.ln_final = nn.LayerNorm(width)

    def encode(self, tokens):
        return self.ln_final(self.mix(self.embed(tokens)))

    def pool(self, h, tokens):
        return h.mean(dim=1)  # layer_norm runs in fp32 under autocast


class DualTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = ConvTower()
        self.text = NormedTextTower()

    def forward(self, images, tokens):
        return self.visual(images), self.text(tokens)


def train_towers(loader):
    model = DualTowers().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    for images, tokens in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            image_emb, text_emb = model(images, tokens)
            loss = (image_emb.float() - text_emb.float()).pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
