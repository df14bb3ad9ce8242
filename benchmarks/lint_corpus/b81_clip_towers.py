"""Two-tower image-text pretraining (CLIP or SigLIP objective) with an image-text
matching (ITM) head on hard negatives, BLIP style.

The image tower is a plain conv net (cheap enough for 8 GPUs at 224px), the text tower
a causal transformer with EOT pooling.  After pretraining, ``--probe`` trains a linear
classifier on frozen image embeddings.
"""
import argparse
import logging
import math
import os
import time
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlp.data import build_pretrain_loader, build_probe_loaders, build_retrieval_loader
from vlp.utils import AverageMeter, cosine_lr, save_checkpoint

logger = logging.getLogger("vlp")

amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)


# --------------------------------------------------------------------------- towers

class _TowerBase(nn.Module):
    """encode -> pool -> project.  Returns the projected embedding and the unpooled features."""

    def __init__(self, width, embed_dim):
        super().__init__()
        self.proj = nn.Linear(width, embed_dim, bias=False)

    def encode(self, x):
        raise NotImplementedError

    def _pool(self, h, x):
        raise NotImplementedError

    def forward(self, x):
        h = self.encode(x)
        pooled = self._pool(h, x)
        return self.proj(pooled), h


class ConvImageTower(_TowerBase):
    def __init__(self, width=512, embed_dim=512, layers=(2, 2, 2, 2)):
        super().__init__(width, embed_dim)
        chans = (64, 128, 256, width)
        body = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.GELU()]
        cin = 64
        for i, (c, n) in enumerate(zip(chans, layers)):
            for j in range(n):
                stride = 2 if (j == 0 and i > 0) else 1
                body += [nn.Conv2d(cin, c, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c), nn.GELU()]
                cin = c
        body.append(nn.Conv2d(cin, width, 1))
        self.body = nn.Sequential(*body)

    def encode(self, x):
        return self.body(x)

    def _pool(self, h, x):
        return h.mean(dim=(2, 3))  # expect: AMP004


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width, heads, mlp_ratio=4.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        hidden = int(width * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x, attn_mask=None):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=attn_mask)[0]
        return x + self.mlp(self.ln_2(x))


class TextTower(_TowerBase):
    def __init__(self, vocab_size=49408, context_length=77, width=512, heads=8, layers=12, embed_dim=512):
        super().__init__(width, embed_dim)
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, width))
        self.blocks = nn.ModuleList([ResidualAttentionBlock(width, heads) for _ in range(layers)])
        self.ln_final = nn.LayerNorm(width)
        self.register_buffer("attn_mask", self.build_causal_mask(context_length), persistent=False)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)

    @staticmethod
    def build_causal_mask(n):
        mask = torch.empty(n, n)
        mask.fill_(float("-inf"))
        mask.triu_(1)
        return mask

    def encode(self, text):
        x = self.token_embedding(text) + self.positional_embedding[: text.shape[1]]
        mask = self.attn_mask[: text.shape[1], : text.shape[1]]
        for blk in self.blocks:
            x = blk(x, attn_mask=mask)
        return self.ln_final(x)

    def _pool(self, h, text):
        return h[torch.arange(h.shape[0], device=h.device), text.argmax(dim=-1)]


class ITMHead(nn.Module):
    """Text tokens cross-attend to the image feature map; one logit per pair."""

    def __init__(self, width, img_width, heads=8):
        super().__init__()
        self.img_in = nn.Linear(img_width, width)
        self.ln = nn.LayerNorm(width)
        self.cross = nn.MultiheadAttention(width, heads, batch_first=True)
        self.cls = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))

    def forward(self, txt_tokens, img_map):
        img_tokens = self.img_in(img_map.flatten(2).transpose(1, 2))
        fused, _ = self.cross(self.ln(txt_tokens), img_tokens, img_tokens, need_weights=False)
        return self.cls(fused[:, 0]).squeeze(-1)


class DualEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.visual = ConvImageTower(width=cfg.img_width, embed_dim=cfg.embed_dim)
        self.text = TextTower(width=cfg.txt_width, layers=cfg.txt_layers, embed_dim=cfg.embed_dim)
        self.itm = ITMHead(cfg.txt_width, cfg.img_width)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))
        self.logit_bias = nn.Parameter(torch.ones([]) * cfg.init_logit_bias) if cfg.loss == "siglip" else None

    def encode_image(self, images):
        emb, fmap = self.visual(images)
        return F.normalize(emb, dim=-1), fmap

    def encode_text(self, text):
        emb, tokens = self.text(text)
        return F.normalize(emb, dim=-1), tokens

    def itm_loss(self, img_emb, txt_emb, fmap, tokens):
        bs = img_emb.shape[0]
        with torch.no_grad():
            sim = img_emb @ txt_emb.t()
            weights = F.softmax(sim.float(), dim=1) + 1e-4
            weights.fill_diagonal_(0)
            neg_idx = torch.multinomial(weights, 1).squeeze(1)
        logits = self.itm(torch.cat([tokens, tokens[neg_idx]], dim=0), torch.cat([fmap, fmap], dim=0))
        labels = torch.cat([torch.ones(bs), torch.zeros(bs)]).to(logits.device)
        p = torch.sigmoid(logits)
        log_p = torch.log(p + 1e-8)  # expect: AMP011
        log_q = torch.log(1.0 - p + 1e-8)  # expect: AMP011
        return -(labels * log_p + (1.0 - labels) * log_q).mean()

    def forward(self, images, text, with_itm=False):
        img_emb, fmap = self.encode_image(images)
        txt_emb, tokens = self.encode_text(text)
        out = {"image_embeds": img_emb, "text_embeds": txt_emb, "logit_scale": self.logit_scale.exp()}
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        if with_itm:
            out["itm_loss"] = self.itm_loss(img_emb, txt_emb, fmap, tokens)
        return out


# --------------------------------------------------------------------------- objectives

class ClipLoss(nn.Module):
    def __init__(self, mask_duplicates=True):
        super().__init__()
        self.mask_duplicates = mask_duplicates

    def forward(self, image_embeds, text_embeds, logit_scale, logit_bias=None, caption_ids=None):
        logits_per_image = logit_scale * image_embeds @ text_embeds.t()
        if caption_ids is not None and self.mask_duplicates:
            # identical captions in one batch are not negatives of each other
            eye = torch.eye(len(caption_ids), dtype=torch.bool, device=caption_ids.device)
            dup = (caption_ids[:, None] == caption_ids[None, :]) & ~eye
            logits_per_image = logits_per_image.masked_fill(dup, -1e9)  # expect: AMP007
        labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
        return 0.5 * (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.t(), labels))


class SigLipLoss(nn.Module):
    def forward(self, image_embeds, text_embeds, logit_scale, logit_bias=None, caption_ids=None):
        logits = logit_scale * image_embeds @ text_embeds.t() + logit_bias
        labels = 2 * torch.eye(logits.shape[0], device=logits.device, dtype=logits.dtype) - 1
        return -F.logsigmoid(labels * logits).sum() / image_embeds.shape[0]


def backward_step(loss, scaler):
    scaler.scale(loss).backward()  # expect: AMP008


# --------------------------------------------------------------------------- loops

def train_one_epoch(model, loader, criterion, optimizer, scaler, epoch, args):
    model.train()
    meters = {k: AverageMeter() for k in ("loss", "itm", "scale", "emb_std")}
    num_batches = len(loader)
    end = time.time()
    for i, batch in enumerate(loader):
        step = epoch * num_batches + i
        cosine_lr(optimizer, step, args.lr, args.warmup, args.epochs * num_batches)
        images = batch["image"].cuda(non_blocking=True)
        texts = batch["text"].cuda(non_blocking=True)
        caption_ids = batch["caption_id"].cuda(non_blocking=True)

        with amp_autocast():
            out = model(images, texts, with_itm=args.itm_weight > 0)
            loss = criterion(out["image_embeds"], out["text_embeds"], out["logit_scale"], out.get("logit_bias"), caption_ids)
            if "itm_loss" in out:
                loss = loss + args.itm_weight * out["itm_loss"]
            # collapse monitor: per-dimension spread of the normalised image embeddings
            emb_std = out["image_embeds"].detach().std(dim=0).mean()
            backward_step(loss / args.accum_freq, scaler)

        if (i + 1) % args.accum_freq == 0:
            if args.grad_clip_norm is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))

        meters["loss"].update(loss.item(), images.size(0))
        meters["scale"].update(out["logit_scale"].item())
        meters["emb_std"].update(emb_std.item())
        if "itm_loss" in out:
            meters["itm"].update(out["itm_loss"].item())
        if i % args.log_every == 0:
            logger.info("ep %d [%d/%d] loss %.4f itm %.4f scale %.1f emb_std %.4f %.2fs/it", epoch, i, num_batches,
                        meters["loss"].avg, meters["itm"].avg, meters["scale"].avg, meters["emb_std"].avg,
                        (time.time() - end) / (i + 1))


@torch.no_grad()
def evaluate_retrieval(model, loader):
    model.eval()
    img_embs, txt_embs = [], []
    for batch in loader:
        with amp_autocast():
            img, _ = model.encode_image(batch["image"].cuda(non_blocking=True))
            txt, _ = model.encode_text(batch["text"].cuda(non_blocking=True))
        img_embs.append(img.float())
        txt_embs.append(txt.float())
    img_embs, txt_embs = torch.cat(img_embs), torch.cat(txt_embs)
    sims = img_embs @ txt_embs.t()
    gt = torch.arange(sims.shape[0], device=sims.device)
    metrics = {}
    for k in (1, 5, 10):
        metrics[f"i2t_R@{k}"] = (sims.topk(k, dim=1).indices == gt[:, None]).any(dim=1).float().mean().item()
        metrics[f"t2i_R@{k}"] = (sims.t().topk(k, dim=1).indices == gt[:, None]).any(dim=1).float().mean().item()
    model.train()
    return metrics


def train_linear_probe(model, train_loader, val_loader, num_classes, epochs=10, lr=1e-3):
    model.eval()
    head = nn.Linear(model.visual.proj.out_features, num_classes).cuda()
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    for epoch in range(epochs):
        head.train()
        for images, labels in train_loader:
            images = images.cuda(non_blocking=True)
            labels = labels.cuda(non_blocking=True)
            with torch.no_grad():
                feats, _ = model.encode_image(images)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(head(feats), labels)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        head.eval()
        correct = total = 0
        with torch.no_grad():
            for images, labels in val_loader:
                feats, _ = model.encode_image(images.cuda(non_blocking=True))
                correct += (head(feats).argmax(-1).cpu() == labels).sum().item()
                total += labels.numel()
        logger.info("probe epoch %d acc %.4f", epoch, correct / total)
    return head


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-data", required=True)
    p.add_argument("--val-data", default=None)
    p.add_argument("--loss", choices=("clip", "siglip"), default="clip")
    p.add_argument("--init-logit-bias", type=float, default=-10.0)
    p.add_argument("--img-width", type=int, default=512)
    p.add_argument("--txt-width", type=int, default=512)
    p.add_argument("--txt-layers", type=int, default=12)
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--itm-weight", type=float, default=0.0)
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--accum-freq", type=int, default=1)
    p.add_argument("--grad-clip-norm", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--probe", default=None, help="dataset name for a linear probe after training")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--out", default="logs/dual_encoder")
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    os.makedirs(args.out, exist_ok=True)
    model = DualEncoder(args).cuda()

    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_" in n
    named = list(model.named_parameters())
    gain_or_bias = [p for n, p in named if exclude(n, p) and p.requires_grad]
    rest = [p for n, p in named if not exclude(n, p) and p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": gain_or_bias, "weight_decay": 0.0}, {"params": rest, "weight_decay": args.wd}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.amp.GradScaler("cuda")
    criterion = ClipLoss(mask_duplicates=True) if args.loss == "clip" else SigLipLoss()

    train_loader = build_pretrain_loader(args)
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, criterion, optimizer, scaler, epoch, args)
        if args.val_data:
            logger.info("retrieval %s", evaluate_retrieval(model, build_retrieval_loader(args)))
        save_checkpoint({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict()}, os.path.join(args.out, f"epoch_{epoch + 1}.pt"))

    if args.probe:
        train_loader, val_loader, num_classes = build_probe_loaders(args.probe)
        train_linear_probe(model, train_loader, val_loader, num_classes)


if __name__ == "__main__":
    main()
