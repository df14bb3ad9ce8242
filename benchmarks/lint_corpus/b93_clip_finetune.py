"""Contrastive image-text fine-tuning with an optional image-text matching
head and gradient caching for large effective batches.

    python clip_finetune.py --train-data shards/{00000..00999}.tar --batch-size 4096 --chunk 512
"""
import argparse
import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self.scaler = torch.amp.GradScaler("cuda")

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None):
        self.scaler.scale(loss).backward()
        self.step(optimizer, clip_grad, parameters)

    def step(self, optimizer, clip_grad=None, parameters=None):
        if clip_grad is not None:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self):
        return self.scaler.state_dict()

    def load_state_dict(self, state):
        self.scaler.load_state_dict(state)


class ClipLoss(nn.Module):
    def forward(self, image_features, text_features, logit_scale):
        image_features = F.normalize(image_features, dim=-1)
        text_features = F.normalize(text_features, dim=-1)
        logits_per_image = logit_scale * image_features @ text_features.T
        labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.T, labels)) / 2


class SigmoidLoss(nn.Module):
    def __init__(self, init_bias=-10.0):
        super().__init__()
        self.bias = nn.Parameter(torch.tensor(init_bias))

    def forward(self, image_features, text_features, logit_scale):
        logits = logit_scale * F.normalize(image_features, dim=-1) @ F.normalize(text_features, dim=-1).T + self.bias
        labels = 2 * torch.eye(logits.shape[0], device=logits.device, dtype=logits.dtype) - 1
        return F.binary_cross_entropy_with_logits(logits, (labels + 1) / 2, reduction="sum") / logits.shape[0]


class MatchingHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * dim, dim), nn.GELU(), nn.Linear(dim, 1))

    def forward(self, img, txt):
        return self.mlp(torch.cat([img, txt], dim=-1))


def train_step(model, itm_head, batch, optimizer, loss_scaler, contrastive, args):
    images, texts, itm_labels = batch
    with amp_autocast():
        img = model.encode_image(images)
        txt = model.encode_text(texts)
        loss = contrastive(img, txt, model.logit_scale.exp())
        if itm_head is not None:
            shuffled = txt[torch.randperm(txt.shape[0], device=txt.device)]
            pair_txt = torch.where(itm_labels[:, None].bool(), txt, shuffled)
            itm_logits = itm_head(img, pair_txt).squeeze(-1)
            itm_loss = F.binary_cross_entropy(torch.sigmoid(itm_logits), itm_labels)  # expect: AMP003
            loss = loss + args.itm_weight * itm_loss
    loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters())
    with torch.no_grad():
        model.logit_scale.clamp_(0, math.log(100))
    return loss.item()


def train_step_cached(model, batch, optimizer, loss_scaler, contrastive, args):
    """Gradient caching: embed the full batch without a graph, take the loss
    gradient w.r.t. the embeddings, then replay chunks and backprop into the
    encoders with that cached gradient."""
    images, texts = batch[0], batch[1]
    with torch.no_grad(), amp_autocast():
        img_reps = torch.cat([model.encode_image(c) for c in images.split(args.chunk)])
        txt_reps = torch.cat([model.encode_text(c) for c in texts.split(args.chunk)])
    img_reps = img_reps.float().requires_grad_()
    txt_reps = txt_reps.float().requires_grad_()

    with amp_autocast():
        loss = contrastive(img_reps, txt_reps, model.logit_scale.exp())
    loss_scaler.scaler.scale(loss).backward()

    for chunk, grad in zip(images.split(args.chunk), img_reps.grad.split(args.chunk)):
        with amp_autocast():
            reps = model.encode_image(chunk)
            surrogate = torch.dot(reps.flatten().float(), grad.flatten())
            surrogate.backward()  # expect: AMP008
    for chunk, grad in zip(texts.split(args.chunk), txt_reps.grad.split(args.chunk)):
        with amp_autocast():
            reps = model.encode_text(chunk)
        torch.dot(reps.flatten().float(), grad.flatten()).backward()

    loss_scaler.step(optimizer, args.clip_grad, model.parameters())
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.logit_scale.clamp_(0, math.log(100))
    return loss.item()


@torch.no_grad()
def zeroshot_classifier(model, tokenizer, classnames, templates, device):
    weights = []
    for name in classnames:
        tokens = tokenizer([t.format(name) for t in templates]).to(device)
        with amp_autocast():
            emb = model.encode_text(tokens)
        emb = F.normalize(emb.float(), dim=-1).mean(dim=0)
        weights.append(emb / emb.norm())
    return torch.stack(weights, dim=1).half()


@torch.no_grad()
def zeroshot_eval(model, classifier, loader, device):
    model.eval()
    top1 = n = 0
    for images, target in loader:
        images, target = images.to(device), target.to(device)
        with amp_autocast():
            feats = model.encode_image(images)
        feats = F.normalize(feats.float(), dim=-1)
        logits = 100.0 * feats @ classifier.float()
        top1 += (logits.argmax(-1) == target).sum().item()
        n += target.numel()
    model.train()
    return top1 / n


def build_optimizer(model, extra_modules, lr, wd):
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    named = list(model.named_parameters()) + [(f"extra.{i}.{n}", p) for i, m in enumerate(extra_modules)
                                              for n, p in m.named_parameters()]
    decay = [p for n, p in named if not exclude(n, p) and p.requires_grad]
    no_decay = [p for n, p in named if exclude(n, p) and p.requires_grad]
    return torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": wd}],
                             lr=lr, betas=(0.9, 0.98), eps=1e-6)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-data", required=True)
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--pretrained", default="laion2b_s34b_b88k")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=0, help="gradient-cache chunk size; 0 disables caching")
    p.add_argument("--loss", choices=["softmax", "sigmoid"], default="softmax")
    p.add_argument("--itm-weight", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=None)
    p.add_argument("--epochs", type=int, default=10)
    args = p.parse_args()

    import open_clip
    from data import get_wds_loader

    device = torch.device("cuda")
    model, _, preprocess = open_clip.create_model_and_transforms(args.model, pretrained=args.pretrained)
    model = model.to(device)
    embed_dim = model.text_projection.shape[1]
    contrastive = (ClipLoss() if args.loss == "softmax" else SigmoidLoss()).to(device)
    itm_head = MatchingHead(embed_dim).to(device) if args.itm_weight > 0 else None
    extra = [m for m in (contrastive, itm_head) if m is not None and any(True for _ in m.parameters())]
    optimizer = build_optimizer(model, extra, args.lr, args.wd)
    loss_scaler = NativeScaler()
    loader = get_wds_loader(args.train_data, preprocess, open_clip.get_tokenizer(args.model),
                            args.batch_size, with_itm=itm_head is not None)

    for epoch in range(args.epochs):
        for step, batch in enumerate(loader):
            batch = [t.to(device, non_blocking=True) for t in batch]
            if args.chunk:
                loss = train_step_cached(model, batch, optimizer, loss_scaler, contrastive, args)
            else:
                optimizer.zero_grad(set_to_none=True)
                loss = train_step(model, itm_head, batch, optimizer, loss_scaler, contrastive, args)
            if step % 50 == 0:
                print(f"epoch {epoch} step {step} loss {loss:.4f} "
                      f"scale {loss_scaler.scaler.get_scale():.0f} T {model.logit_scale.exp().item():.1f}")


if __name__ == "__main__":
    main()
