"""Contrastive image-text training (open_clip style) with a user-written loss module."""
import logging
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class ClipLoss(nn.Module):
    def __init__(self, local_loss=False, cache_labels=True):
        super().__init__()
        self.local_loss = local_loss
        self.cache_labels = cache_labels
        self.prev_num_logits = 0
        self.labels = {}

    def get_ground_truth(self, device, num_logits):
        if self.prev_num_logits != num_logits or device not in self.labels:
            labels = torch.arange(num_logits, device=device, dtype=torch.long)
            if self.cache_labels:
                self.labels[device] = labels
                self.prev_num_logits = num_logits
        else:
            labels = self.labels[device]
        return labels

    def forward(self, image_features, text_features, logit_scale):
        logits_per_image = logit_scale * image_features @ text_features.T
        logits_per_text = logit_scale * text_features @ image_features.T
        labels = self.get_ground_truth(image_features.device, logits_per_image.shape[0])
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def siglip_objective(image_features, text_features, logit_scale, logit_bias):
    logits = logit_scale * image_features @ text_features.T + logit_bias
    n = logits.size(0)
    labels = 2 * torch.eye(n, device=logits.device, dtype=logits.dtype) - 1
    return -F.logsigmoid(labels * logits).sum() / n


def train_one_epoch(model, data, loss, epoch, optimizer, scaler, scheduler, args):
    device = torch.device(args.device)
    model.train()
    num_batches_per_epoch = len(data)
    end = time.time()
    for i, batch in enumerate(data):
        step = num_batches_per_epoch * epoch + i
        scheduler(step)
        images, texts = batch
        images = images.to(device=device, non_blocking=True)
        texts = texts.to(device=device, non_blocking=True)
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            model_out = model(images, texts)
            logit_scale = model_out["logit_scale"]
            total_loss = loss(model_out["image_features"], model_out["text_features"], logit_scale)
        scaler.scale(total_loss).backward()
        if args.grad_clip_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip_norm, norm_type=2.0)
        scaler.step(optimizer)
        scaler.update()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if i % 100 == 0:
            logging.info(f"step {step} loss {total_loss.item():.4f} time {time.time() - end:.3f}")
            end = time.time()


def train_one_epoch_split(model, data, optimizer, scaler, args):
    criterion = ClipLoss()
    model.train()
    for images, texts in data:
        with torch.autocast("cuda", dtype=torch.float16):
            image_features, text_features, logit_scale = model(images.cuda(), texts.cuda())
        total_loss = criterion(image_features, text_features, logit_scale)  # expect: AMP002
        optimizer.zero_grad()
        scaler.scale(total_loss).backward()
        scaler.step(optimizer)
        scaler.update()


def train_one_epoch_siglip(model, data, optimizer, scaler):
    model.train()
    for images, texts in data:
        with torch.autocast("cuda", dtype=torch.float16):
            image_features = model.encode_image(images.cuda(), normalize=True)
            text_features = model.encode_text(texts.cuda(), normalize=True)
        loss = siglip_objective(image_features, text_features, model.logit_scale.exp(), model.logit_bias)  # expect: AMP002
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def train_one_epoch_upcast(model, data, optimizer, scaler):
    criterion = ClipLoss()
    for images, texts in data:
        with torch.autocast("cuda", dtype=torch.float16):
            image_features, text_features, logit_scale = model(images.cuda(), texts.cuda())
        total_loss = criterion(image_features.float(), text_features.float(), logit_scale)
        optimizer.zero_grad()
        scaler.scale(total_loss).backward()
        scaler.step(optimizer)
        scaler.update()


def evaluate(model, data, args):
    model.eval()
    criterion = ClipLoss()
    total = 0.0
    with torch.no_grad():
        for images, texts in data:
            with torch.autocast("cuda", dtype=torch.float16):
                image_features, text_features, logit_scale = model(images.cuda(), texts.cuda())
                total += criterion(image_features, text_features, logit_scale).item()
    return total / max(len(data), 1)
