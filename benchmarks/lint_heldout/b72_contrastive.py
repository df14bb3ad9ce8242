"""Image-text contrastive pre-training (CLIP-style) with optional ITM and SimCLR auxiliary heads.

``ContrastiveModel.forward`` returns the loss itself for single-node training. When the
features of all ranks are gathered first, the loss is computed separately with
``ContrastiveModel.compute_loss(outputs, batch)``.
"""
import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from clipx.data import ImageTextDataset, build_transforms
from clipx.encoders import TextTransformer, VisionTransformer
from clipx.utils import cosine_lr, load_config, save_checkpoint, zero_shot_eval

log = logging.getLogger("clipx.train")


class ClipLoss(nn.Module):
    def forward(self, image_features, text_features, logit_scale):
        logits = logit_scale * image_features @ text_features.t()
        labels = torch.arange(logits.size(0), device=logits.device)
        return 0.5 * (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.t().float(), labels))


class NTXentHead(nn.Module):
    """Image-image SimCLR term on two augmented views."""

    def __init__(self, dim, proj_dim=128, temperature=0.1):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, proj_dim))
        self.temperature = temperature

    def forward(self, v1, v2):
        z = F.normalize(self.proj(torch.cat([v1, v2], dim=0)), dim=1)
        n = z.size(0)
        sim = z @ z.t() / self.temperature
        self_mask = torch.eye(n, dtype=torch.bool, device=sim.device)
        sim.masked_fill_(self_mask, -9e15)  # expect: AMP007
        pos = (torch.arange(n, device=sim.device) + n // 2) % n
        return F.cross_entropy(sim, pos)


class ContrastiveModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.visual = VisionTransformer(**cfg.vision)
        self.text = TextTransformer(**cfg.text)
        self.image_proj = nn.Linear(cfg.vision["width"], cfg.embed_dim, bias=False)
        self.text_proj = nn.Linear(cfg.text["width"], cfg.embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))
        self.clip_loss = ClipLoss()
        self.use_itm = cfg.itm_weight > 0
        self.itm_weight = cfg.itm_weight
        if self.use_itm:
            self.itm_head = nn.Sequential(nn.Linear(2 * cfg.embed_dim, cfg.embed_dim), nn.GELU(),
                                          nn.Linear(cfg.embed_dim, 1))
            self.itm_criterion = nn.BCELoss()
        self.simclr_head = NTXentHead(cfg.vision["width"]) if cfg.simclr_weight > 0 else None
        self.simclr_weight = cfg.simclr_weight

    def encode_image(self, images):
        return self.visual(images)

    def encode_text(self, input_ids, attention_mask):
        return self.text(input_ids, attention_mask=attention_mask)

    def forward(self, batch, return_loss=True):
        img_feats = self.encode_image(batch["images"])
        txt_feats = self.encode_text(batch["input_ids"], batch["attention_mask"])
        image_embeds = F.normalize(self.image_proj(img_feats), dim=-1)
        text_embeds = F.normalize(self.text_proj(txt_feats), dim=-1)
        outputs = {
            "image_embeds": image_embeds,
            "text_embeds": text_embeds,
            "logit_scale": self.logit_scale.exp().clamp(max=100.0),
        }
        if self.use_itm:
            # matched pairs vs. the text of the next sample in the batch
            pairs = torch.cat([
                torch.cat([image_embeds, text_embeds], dim=-1),
                torch.cat([image_embeds, text_embeds.roll(1, dims=0)], dim=-1),
            ])
            itm_prob = torch.sigmoid(self.itm_head(pairs)).squeeze(-1)
            itm_labels = torch.cat([itm_prob.new_ones(len(image_embeds)), itm_prob.new_zeros(len(image_embeds))])
            outputs["loss_itm"] = self.itm_weight * self.itm_criterion(itm_prob, itm_labels)  # expect: AMP003
        if self.simclr_head is not None and "images_aug" in batch:
            aug_feats = self.encode_image(batch["images_aug"])
            outputs["loss_simclr"] = self.simclr_weight * self.simclr_head(img_feats, aug_feats)
        if return_loss:
            loss = self.clip_loss(image_embeds, text_embeds, outputs["logit_scale"])
            outputs["loss"] = loss + sum(outputs.get(k, 0.0) for k in ("loss_itm", "loss_simclr"))
        return outputs

    def compute_loss(self, outputs, batch):
        img, txt = outputs["image_embeds"], outputs["text_embeds"]
        logits = outputs["logit_scale"] * img @ txt.t()
        if "caption_ids" in batch:
            # the same caption can occur twice in a global batch: those are not negatives
            dup = batch["caption_ids"][:, None] == batch["caption_ids"][None, :]
            dup.fill_diagonal_(False)
            logits = logits.masked_fill(dup, torch.finfo(logits.dtype).min)
        labels = torch.arange(logits.size(0), device=logits.device)
        loss = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))
        return loss + sum(outputs.get(k, 0.0) for k in ("loss_itm", "loss_simclr"))


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


def gather_features(outputs, batch):
    outputs = dict(outputs)
    for key in ("image_embeds", "text_embeds"):
        outputs[key] = torch.cat(GatherLayer.apply(outputs[key]), dim=0)
    if "caption_ids" in batch:
        ids = [torch.zeros_like(batch["caption_ids"]) for _ in range(dist.get_world_size())]
        dist.all_gather(ids, batch["caption_ids"])
        batch = {**batch, "caption_ids": torch.cat(ids)}
    return outputs, batch


def to_cuda(batch):
    return {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def train_one_epoch(model, loader, optimizer, scaler, epoch, args):
    model.train()
    distributed = dist.is_available() and dist.is_initialized()
    steps_per_epoch = len(loader)
    for i, batch in enumerate(loader):
        step = epoch * steps_per_epoch + i
        cosine_lr(optimizer, args.lr, args.warmup, args.epochs * steps_per_epoch, step)
        batch = to_cuda(batch)

        if not distributed:
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                outputs = model(batch)
                loss = outputs["loss"]
        else:
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                outputs = model(batch, return_loss=False)
                outputs, batch = gather_features(outputs, batch)
            loss = model.module.compute_loss(outputs, batch)  # expect: AMP002

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if args.grad_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()

        if i % args.log_every == 0:
            scale = outputs["logit_scale"].item()
            log.info("epoch %d step %d/%d loss %.4f logit_scale %.2f amp_scale %.0f", epoch, i,
                     steps_per_epoch, loss.item(), scale, scaler.get_scale())


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total, n = 0.0, 0
    for batch in loader:
        batch = to_cuda(batch)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            outputs = model(batch, return_loss=False)
            loss = model.compute_loss(outputs, batch)
        total += loss.item() * batch["images"].size(0)
        n += batch["images"].size(0)
    return {"val_loss": total / max(n, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--train-data", required=True)
    parser.add_argument("--val-data", default=None)
    parser.add_argument("--epochs", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--grad-clip", type=float, default=0.0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--output", default="logs/clip")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    cfg = load_config(args.config)

    model = ContrastiveModel(cfg).cuda()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.2}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.amp.GradScaler("cuda")

    train_set = ImageTextDataset(args.train_data, build_transforms(train=True))
    sampler = DistributedSampler(train_set) if distributed else None
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None,
                        num_workers=8, pin_memory=True, drop_last=True)
    val_loader = None
    if args.val_data:
        val_loader = DataLoader(ImageTextDataset(args.val_data, build_transforms(train=False)),
                                batch_size=args.batch_size, num_workers=8)

    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        train_one_epoch(model, loader, optimizer, scaler, epoch, args)
        unwrapped = model.module if distributed else model
        if val_loader is not None:
            log.info("epoch %d %s", epoch, evaluate(unwrapped, val_loader))
        log.info("zero-shot: %s", zero_shot_eval(unwrapped, epoch))
        if not distributed or dist.get_rank() == 0:
            save_checkpoint(os.path.join(args.output, f"epoch_{epoch}.pt"), unwrapped, optimizer, scaler, epoch)


if __name__ == "__main__":
    main()
