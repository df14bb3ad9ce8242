"""Multi-modal pretraining loop: image and audio towers, batches as dicts of tensors."""
import copy
import functools

import torch as th
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map

HALF = th.float16
COMPUTE_DTYPE = th.bfloat16
FEATURE_KEYS = ("image", "audio", "text")


def move_batch(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def cast_batch_for_export(batch):
    return {k: v.to(HALF) for k, v in batch.items()}


class Towers(nn.Module):
    def __init__(self, image_tower, audio_tower, text_tower, dim):
        super().__init__()
        self.image_tower = image_tower
        self.audio_tower = audio_tower
        self.text_tower = text_tower
        self.logit_scale = nn.Parameter(th.ones([]) * 2.659)

    def forward(self, image, audio, text):
        return self.image_tower(image), self.audio_tower(audio), self.text_tower(text)


def contrastive(a, b, scale):
    a = F.normalize(a.float(), dim=-1)
    b = F.normalize(b.float(), dim=-1)
    logits = scale.exp() * a @ b.t()
    labels = th.arange(a.size(0), device=a.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def train_step(model, batch, optimizer):
    image = batch["image"].to(HALF)  # expect: AMP001
    audio = batch["audio"].to(dtype=COMPUTE_DTYPE)  # expect: AMP001
    img, aud, txt = model(image, audio, batch["text"])
    loss = contrastive(img, txt, model.logit_scale) + contrastive(aud, txt, model.logit_scale)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_epoch(model, loader, optimizer, device):
    model.train()
    for batch in loader:
        batch = move_batch(batch, device)
        feats = [batch[k].half() for k in FEATURE_KEYS]  # expect: AMP001
        img, aud, txt = model(*feats)
        loss = contrastive(img, txt, model.logit_scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def train_epoch_tree(model, loader, optimizer, device):
    model.train()
    to_half = functools.partial(tree_map, lambda t: t.to(th.half))  # expect: AMP001
    for batch in loader:
        batch = to_half(move_batch(batch, device))
        img, aud, txt = model(batch["image"], batch["audio"], batch["text"])
        loss = contrastive(img, aud, model.logit_scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def train_epoch_dict(model, loader, optimizer, device):
    model.train()
    for batch in loader:
        batch = {k: v.to(device=device, dtype=th.float16) for k, v in batch.items()}  # expect: AMP001
        img, aud, txt = model(batch["image"], batch["audio"], batch["text"])
        loss = contrastive(img, aud, model.logit_scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def train_with_half_copy(model, loader, device, lr=1e-4):
    model16 = copy.deepcopy(model).half()  # expect: AMP001
    optimizer = th.optim.SGD(model16.parameters(), lr=lr, momentum=0.9)
    model16.train()
    for batch in loader:
        batch = move_batch(batch, device)
        img, aud, txt = model16(batch["image"], batch["audio"], batch["text"])
        loss = contrastive(img, txt, model16.logit_scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model16


def save_half_copy(model, path):
    half_model = copy.deepcopy(model).half()
    th.save(half_model.state_dict(), path)


def train_with_autocast(model, loader, optimizer, device):
    model.train()
    for batch in loader:
        batch = move_batch(batch, device)
        with th.autocast("cuda", dtype=COMPUTE_DTYPE):
            img, aud, txt = model(batch["image"], batch["audio"], batch["text"])
            loss = contrastive(img, txt, model.logit_scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@th.no_grad()
def embed_dataset(model, loader, device):
    model.eval()
    out = []
    for batch in loader:
        batch = {k: v.to(device, HALF) for k, v in move_batch(batch, device).items()}
        out.append(model(batch["image"], batch["audio"], batch["text"])[0])
    return th.cat(out)
