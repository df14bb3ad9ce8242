"""Slot Attention autoencoder with adaptive slot dropping and set-property heads.

CNN encoder -> slot attention -> (spatial-broadcast decoder, presence head,
property head). Slots whose presence falls below a threshold are removed
from the alpha compositing; properties are matched to ground-truth objects
with the Hungarian algorithm.
"""
import argparse
import math
from typing import Dict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment


def build_grid(resolution):
    ranges = [np.linspace(0.0, 1.0, num=res) for res in resolution]
    grid = np.meshgrid(*ranges, sparse=False, indexing="ij")
    grid = np.stack(grid, axis=-1).reshape(resolution[0], resolution[1], -1)
    grid = np.expand_dims(grid, axis=0).astype(np.float32)
    return torch.from_numpy(np.concatenate([grid, 1.0 - grid], axis=-1))


class SoftPositionEmbed(nn.Module):
    def __init__(self, hidden, resolution):
        super().__init__()
        self.dense = nn.Linear(4, hidden)
        self.register_buffer("grid", build_grid(resolution))

    def forward(self, x):
        return x + self.dense(self.grid)


class LayerNorm2d(nn.Module):
    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)  # expect: AMP004
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class Encoder(nn.Module):
    def __init__(self, resolution, hid=64):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(3, hid, 5, padding=2), LayerNorm2d(hid), nn.ReLU(inplace=True),
            nn.Conv2d(hid, hid, 5, padding=2), LayerNorm2d(hid), nn.ReLU(inplace=True),
            nn.Conv2d(hid, hid, 5, padding=2), LayerNorm2d(hid), nn.ReLU(inplace=True),
            nn.Conv2d(hid, hid, 5, padding=2), nn.ReLU(inplace=True),
        )
        self.pos = SoftPositionEmbed(hid, resolution)

    def forward(self, img):
        x = self.convs(img).permute(0, 2, 3, 1)
        return self.pos(x).flatten(1, 2)


class SlotAttention(nn.Module):
    def __init__(self, num_slots, dim, iters=3, eps=1e-8, hidden_dim=128):
        super().__init__()
        self.num_slots, self.iters, self.eps = num_slots, iters, eps
        self.scale = dim ** -0.5
        self.slots_mu = nn.Parameter(torch.randn(1, 1, dim))
        self.slots_log_sigma = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.xavier_uniform_(self.slots_log_sigma)
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.gru = nn.GRUCell(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, dim))
        self.norm_input = nn.LayerNorm(dim)
        self.norm_slots = nn.LayerNorm(dim)
        self.norm_pre_ff = nn.LayerNorm(dim)

    def _attend(self, slots, k, v):
        q = self.to_q(self.norm_slots(slots))
        dots = torch.einsum("bid,bjd->bij", q, k) * self.scale
        attn = dots.softmax(dim=1) + self.eps
        attn = attn / attn.sum(dim=-1, keepdim=True)
        return torch.einsum("bjd,bij->bid", v, attn), attn

    def forward(self, inputs):
        b, n, d = inputs.shape
        mu = self.slots_mu.expand(b, self.num_slots, -1)
        sigma = self.slots_log_sigma.exp().expand(b, self.num_slots, -1)
        slots = mu + sigma * torch.randn_like(mu)
        inputs = self.norm_input(inputs)
        k, v = self.to_k(inputs), self.to_v(inputs)
        for _ in range(self.iters):
            slots_prev = slots
            updates, attn = self._attend(slots, k, v)
            slots = self.gru(updates.reshape(-1, d), slots_prev.reshape(-1, d)).reshape(b, -1, d)
            slots = slots + self.mlp(self.norm_pre_ff(slots))
        return slots, attn


class SpatialBroadcastDecoder(nn.Module):
    def __init__(self, dim, init_res=(8, 8), hid=64):
        super().__init__()
        self.init_res = init_res
        self.pos = SoftPositionEmbed(dim, init_res)
        self.deconvs = nn.Sequential(
            nn.ConvTranspose2d(dim, hid, 5, stride=2, padding=2, output_padding=1), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(hid, hid, 5, stride=2, padding=2, output_padding=1), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(hid, hid, 5, stride=2, padding=2, output_padding=1), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(hid, hid, 5, stride=2, padding=2, output_padding=1), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(hid, 4, 3, stride=1, padding=1),
        )

    def forward(self, slots, keep=None):
        b, k, d = slots.shape
        x = slots.reshape(b * k, 1, 1, d).expand(-1, *self.init_res, -1)
        x = self.deconvs(self.pos(x).permute(0, 3, 1, 2))
        x = x.reshape(b, k, 4, x.size(-2), x.size(-1))
        recons, alpha = x.split([3, 1], dim=2)
        if keep is not None:
            alpha = alpha.masked_fill(~keep[:, :, None, None, None], -1e9)  # expect: AMP007
        masks = alpha.softmax(dim=1)
        recon = (recons * masks).sum(dim=1)
        return recon, recons, masks


class SlotHeads(nn.Module):
    def __init__(self, dim, num_props):
        super().__init__()
        self.presence = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, 1))
        self.props = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, num_props))

    def forward(self, slots):
        return torch.sigmoid(self.presence(slots)).squeeze(-1), self.props(slots)


class AdaptiveSlotAutoEncoder(nn.Module):
    def __init__(self, resolution=(128, 128), num_slots=11, dim=64, num_props=19, keep_threshold=0.5):
        super().__init__()
        self.encoder = Encoder(resolution, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, dim))
        self.slot_attention = SlotAttention(num_slots, dim)
        self.heads = SlotHeads(dim, num_props)
        self.decoder = SpatialBroadcastDecoder(dim)
        self.keep_threshold = keep_threshold
        self.register_buffer("usage_ema", torch.full((num_slots,), 0.5))

    @torch.no_grad()
    def slot_usage_stats(self):
        return {"usage_mean": self.usage_ema.mean().item(), "usage_std": self.usage_ema.std().item()}

    def forward(self, img):
        feats = self.mlp(self.norm(self.encoder(img)))
        slots, attn = self.slot_attention(feats)
        presence, props = self.heads(slots)
        keep = presence.detach() > self.keep_threshold
        keep[:, 0] = True
        if self.training:
            self.usage_ema.lerp_(keep.float().mean(dim=0), 0.01)
        recon, recons, masks = self.decoder(slots, keep)
        sparsity = presence.mean()  # expect: AMP004
        return {"recon": recon, "recons": recons, "masks": masks, "attn": attn,
                "presence": presence, "props": props, "sparsity": sparsity}


class SlotSetLoss(nn.Module):
    def __init__(self, recon_weight=1.0, presence_weight=0.1, prop_weight=1.0, sparsity_weight=0.01):
        super().__init__()
        self.w = dict(recon=recon_weight, presence=presence_weight, prop=prop_weight, sparsity=sparsity_weight)

    @torch.no_grad()
    def _match(self, props, targets, target_mask):
        cost = torch.cdist(props.float(), targets.float(), p=1)
        cost = cost.masked_fill(~target_mask[:, None, :], 1e6)
        return [linear_sum_assignment(c.cpu().numpy()) for c in cost]

    def forward(self, out, image, targets, target_mask):
        recon_loss = F.mse_loss(out["recon"], image)
        props, presence = out["props"], out["presence"]
        target_presence = torch.zeros(presence.shape, device=presence.device)
        pred_idx, tgt_idx = [], []
        for b, (rows, cols) in enumerate(self._match(props, targets, target_mask)):
            valid = target_mask[b, cols].cpu().numpy()
            rows, cols = rows[valid], cols[valid]
            target_presence[b, rows] = 1.0
            pred_idx.append(props[b, rows])
            tgt_idx.append(targets[b, cols])
        prop_loss = F.smooth_l1_loss(torch.cat(pred_idx), torch.cat(tgt_idx))
        log_p = torch.log(presence + 1e-10)  # expect: AMP011
        log_not_p = torch.log1p(-presence.clamp(max=1 - 1e-3))
        pres_loss = -(target_presence * log_p + (1 - target_presence) * log_not_p).mean()
        loss = (self.w["recon"] * recon_loss + self.w["presence"] * pres_loss
                + self.w["prop"] * prop_loss + self.w["sparsity"] * out["sparsity"])
        return {"loss": loss, "recon": recon_loss.detach(), "presence": pres_loss.detach(), "prop": prop_loss.detach()}


def train_epoch(model, loader, optimizer, scaler, criterion, scheduler, epoch, device, grad_clip=1.0):
    model.train()
    for step, batch in enumerate(loader):
        image = batch["image"].to(device, non_blocking=True)
        targets = batch["props"].to(device, non_blocking=True)
        target_mask = batch["mask"].to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            out = model(image)
        losses = criterion(out, image, targets, target_mask)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(losses["loss"]).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if step % 100 == 0:
            stats = {k: round(v.item(), 5) for k, v in losses.items()}
            stats.update(model.slot_usage_stats())
            print(epoch, step, stats)


@torch.no_grad()
def visualize_slots(model, image):
    model.eval()
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        out = model(image)
    occupancy = out["masks"].mean(dim=(2, 3, 4))
    return out["recons"].float().clamp(-1, 1), out["masks"], occupancy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/clevr_train.pt")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--warmup", type=int, default=10000)
    args = parser.parse_args()
    device = torch.device("cuda")
    dataset = torch.load(args.data)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    model = AdaptiveSlotAutoEncoder().to(device)
    criterion = SlotSetLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 ** (s / 100000))
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(args.epochs):
        train_epoch(model, loader, optimizer, scaler, criterion, scheduler, epoch, device)
        torch.save(model.state_dict(), "slot_ae.pt")


if __name__ == "__main__":
    main()
