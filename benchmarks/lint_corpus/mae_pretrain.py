"""Masked autoencoder pretraining (MAE style) with a NativeScaler-like helper."""
import math
import sys

import torch
import torch.nn as nn


class NativeScalerWithGradNormCount:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.cuda.amp.GradScaler()  # expect: AMP009

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, update_grad=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if update_grad:
            if clip_grad is not None:
                self._scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            else:
                self._scaler.unscale_(optimizer)
                norm = get_grad_norm_(parameters)
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            norm = None
        return norm

    def state_dict(self):
        return self._scaler.state_dict()


def get_grad_norm_(parameters, norm_type=2.0):
    parameters = [p for p in parameters if p.grad is not None]
    if len(parameters) == 0:
        return torch.tensor(0.0)
    device = parameters[0].grad.device
    return torch.norm(torch.stack([torch.norm(p.grad.detach(), norm_type).to(device) for p in parameters]), norm_type)


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (
            1.0 + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr * param_group.get("lr_scale", 1.0)
    return lr


def patchify(imgs, p=16):
    h = w = imgs.shape[2] // p
    x = imgs.reshape(shape=(imgs.shape[0], 3, h, p, w, p))
    x = torch.einsum("nchpwq->nhwpqc", x)
    return x.reshape(shape=(imgs.shape[0], h * w, p ** 2 * 3))


def mae_loss(imgs, pred, mask, norm_pix_loss=True):
    target = patchify(imgs)
    if norm_pix_loss:
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    loss = (pred - target) ** 2
    loss = loss.mean(dim=-1)
    return (loss * mask).sum() / mask.sum()


def train_one_epoch(model, data_loader, optimizer, device, epoch, loss_scaler, args):
    model.train(True)
    accum_iter = args.accum_iter
    optimizer.zero_grad()
    for data_iter_step, (samples, _) in enumerate(data_loader):
        if data_iter_step % accum_iter == 0:
            adjust_learning_rate(optimizer, data_iter_step / len(data_loader) + epoch, args)
        samples = samples.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():  # expect: AMP009
            loss, _, _ = model(samples, mask_ratio=args.mask_ratio)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            print(f"Loss is {loss_value}, stopping training")
            sys.exit(1)
        loss /= accum_iter
        loss_scaler(loss, optimizer, parameters=model.parameters(), update_grad=(data_iter_step + 1) % accum_iter == 0)
        if (data_iter_step + 1) % accum_iter == 0:
            optimizer.zero_grad()
        torch.cuda.synchronize()


def train_one_epoch_external_loss(model, data_loader, optimizer, device, loss_scaler, args):
    """Variant where the decoder returns predictions and the loss is computed by the caller."""
    model.train()
    for samples, _ in data_loader:
        samples = samples.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            pred, mask = model.forward_features(samples, mask_ratio=args.mask_ratio)
        loss = mae_loss(samples, pred, mask)  # expect: AMP002
        loss_scaler(loss, optimizer, parameters=model.parameters())
        optimizer.zero_grad()


class MaskedAutoencoder(nn.Module):
    def __init__(self, encoder, decoder, embed_dim=1024, decoder_dim=512):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.decoder_embed = nn.Linear(embed_dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))

    def random_masking(self, x, mask_ratio):
        N, L, D = x.shape
        len_keep = int(L * (1 - mask_ratio))
        noise = torch.rand(N, L, device=x.device)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, dim=1, index=ids_keep.unsqueeze(-1).repeat(1, 1, D))
        mask = torch.ones([N, L], device=x.device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, dim=1, index=ids_restore)
        return x_masked, mask, ids_restore

    def forward_features(self, imgs, mask_ratio=0.75):
        latent, mask, ids_restore = self.random_masking(self.encoder(imgs), mask_ratio)
        x = self.decoder_embed(latent)
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
        return self.decoder(x), mask

    def forward(self, imgs, mask_ratio=0.75):
        pred, mask = self.forward_features(imgs, mask_ratio)
        return mae_loss(imgs, pred, mask), pred, mask
