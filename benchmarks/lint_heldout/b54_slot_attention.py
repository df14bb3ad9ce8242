"""Object-centric autoencoder: CNN encoder -> Slot Attention (Locatello et al., 2020) with
invariant-slot-attention style slot positions and scales (Biza et al., 2023) -> spatial
broadcast decoder with softmax alpha compositing.  CLEVR6, fp16 autocast."""
import argparse
import glob
import math
import os
from collections import namedtuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

SlotOutput = namedtuple("SlotOutput", ["recon", "recons", "masks", "slots", "attn", "slot_pos", "slot_scales", "ortho"])


def build_grid(resolution):
    ranges = [np.linspace(0.0, 1.0, num=res) for res in resolution]
    grid = np.stack(np.meshgrid(*ranges, sparse=False, indexing="ij"), axis=-1)
    grid = grid.reshape(resolution[0], resolution[1], -1)[None].astype(np.float32)
    return torch.from_numpy(np.concatenate([grid, 1.0 - grid], axis=-1))


class SoftPositionEmbed(nn.Module):
    def __init__(self, hidden_size, resolution):
        super().__init__()
        self.dense = nn.Linear(4, hidden_size)
        self.register_buffer("grid", build_grid(resolution), persistent=False)

    def forward(self, inputs):
        return inputs + self.dense(self.grid)


def conv_stack(channels, kernel=5, stride=1, final_act=True):
    layers = []
    for i, (cin, cout) in enumerate(zip(channels[:-1], channels[1:])):
        layers.append(nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2))
        if final_act or i < len(channels) - 2:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class SlotAttention(nn.Module):
    def __init__(self, num_slots, dim, iters=3, hidden_dim=128):
        super().__init__()
        self.num_slots, self.iters, self.scale = num_slots, iters, dim ** -0.5
        self.slots_mu = nn.Parameter(torch.randn(1, 1, dim))
        self.slots_logsigma = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.xavier_uniform_(self.slots_logsigma)
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.gru = nn.GRUCell(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, dim))
        self.norm_input, self.norm_slots, self.norm_pre_ff = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, inputs, grid, num_slots=None, slot_mask=None):
        b, n, d = inputs.shape
        n_s = num_slots if num_slots is not None else self.num_slots
        mu = self.slots_mu.expand(b, n_s, -1)
        sigma = self.slots_logsigma.exp().expand(b, n_s, -1)
        slots = mu + sigma * torch.randn(mu.shape, device=inputs.device)
        inputs = self.norm_input(inputs)
        k, v = self.to_k(inputs), self.to_v(inputs)
        for _ in range(self.iters):
            slots_prev = slots
            q = self.to_q(self.norm_slots(slots))
            dots = torch.matmul(q, k.transpose(1, 2)) * self.scale
            if slot_mask is not None:
                dots = dots.masked_fill(~slot_mask[:, :, None], -1e9)  # expect: AMP007
            attn = dots.softmax(dim=1) + 1e-8
            attn = attn / attn.sum(dim=-1, keepdim=True)
            updates = torch.matmul(attn, v)
            slots = self.gru(updates.reshape(-1, d), slots_prev.reshape(-1, d)).reshape(b, -1, d)
            slots = slots + self.mlp(self.norm_pre_ff(slots))
        slot_pos = torch.matmul(attn, grid)
        rel = grid.unsqueeze(1) - slot_pos.unsqueeze(2)
        var = torch.matmul(attn.unsqueeze(2), rel ** 2).squeeze(2)
        slot_scales = torch.sqrt(var + 1e-8)  # expect: AMP011
        return slots, attn, slot_pos, slot_scales


class SlotAttentionAutoEncoder(nn.Module):
    def __init__(self, resolution=(128, 128), num_slots=7, num_iters=3, hid=64, dec_init=(8, 8)):
        super().__init__()
        self.resolution, self.dec_init, self.hid = resolution, dec_init, hid
        self.encoder_cnn = conv_stack([3, hid, hid, hid, hid])
        self.encoder_pos = SoftPositionEmbed(hid, resolution)
        self.layer_norm = nn.LayerNorm(hid)
        self.mlp = nn.Sequential(nn.Linear(hid, hid), nn.ReLU(inplace=True), nn.Linear(hid, hid))
        self.slot_attention = SlotAttention(num_slots, hid, num_iters, hidden_dim=128)
        self.decoder_pos = SoftPositionEmbed(hid, dec_init)
        ups = [nn.ConvTranspose2d(hid, hid, 5, stride=2, padding=2, output_padding=1) for _ in range(4)]
        self.decoder_cnn = nn.Sequential(*[m for up in ups for m in (up, nn.ReLU(inplace=True))],
                                         nn.ConvTranspose2d(hid, hid, 5, padding=2), nn.ReLU(inplace=True),
                                         nn.ConvTranspose2d(hid, 4, 3, padding=1))
        gy, gx = torch.meshgrid(torch.linspace(-1, 1, resolution[0]), torch.linspace(-1, 1, resolution[1]), indexing="ij")
        self.register_buffer("grid_flat", torch.stack([gx, gy], -1).view(1, -1, 2), persistent=False)

    def decode(self, slots):
        b, k, d = slots.shape
        x = slots.reshape(b * k, 1, 1, d).expand(-1, *self.dec_init, -1)
        x = self.decoder_pos(x).permute(0, 3, 1, 2)
        x = self.decoder_cnn(x).permute(0, 2, 3, 1).reshape(b, k, *self.resolution, 4)
        recons, masks = x.split([3, 1], dim=-1)
        masks = masks.softmax(dim=1)
        recon = (recons * masks).sum(dim=1)
        return recon.permute(0, 3, 1, 2), recons, masks

    def forward(self, image, num_slots=None, num_objects=None):
        """num_objects (b,), when known, switches off the surplus slots of each image."""
        x = self.encoder_cnn(image).permute(0, 2, 3, 1)
        x = self.encoder_pos(x)
        x = self.mlp(self.layer_norm(x.flatten(1, 2)))
        slot_mask = None
        if num_objects is not None:
            n_s = num_slots or self.slot_attention.num_slots
            slot_mask = torch.arange(n_s, device=image.device)[None] < (num_objects[:, None] + 1)
        slots, attn, slot_pos, slot_scales = self.slot_attention(x, self.grid_flat, num_slots, slot_mask)
        recon, recons, masks = self.decode(slots)
        slots_n = F.normalize(slots, dim=-1)
        sim = torch.matmul(slots_n, slots_n.transpose(1, 2))
        off_diag = sim - torch.diag_embed(torch.diagonal(sim, dim1=1, dim2=2))
        ortho = off_diag.abs().mean()  # expect: AMP004
        return SlotOutput(recon, recons, masks, slots, attn, slot_pos, slot_scales, ortho)


class CLEVRImages(Dataset):
    def __init__(self, root, split="train", resolution=(128, 128)):
        self.files = sorted(glob.glob(os.path.join(root, "images", split, "*.png")))
        self.resolution = resolution

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        img = Image.open(self.files[idx]).convert("RGB").crop((64, 29, 256, 221)).resize(self.resolution)
        img = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return img * 2.0 - 1.0


@torch.no_grad()
def fg_ari(true_masks, pred_masks):
    """Foreground ARI; masks are one-hot (b, n_points, n_groups) float tensors."""
    n_points = true_masks.sum(dim=(1, 2))
    nij = torch.einsum("bji,bjk->bki", pred_masks, true_masks)
    a, b = nij.sum(dim=1), nij.sum(dim=2)
    rindex = (nij * (nij - 1)).sum(dim=(1, 2))
    aindex, bindex = (a * (a - 1)).sum(dim=1), (b * (b - 1)).sum(dim=1)
    expected = aindex * bindex / (n_points * (n_points - 1) + 1e-10)
    max_index = (aindex + bindex) / 2
    return (rindex - expected) / (max_index - expected + 1e-10)


@torch.no_grad()
def evaluate(model, loader, true_mask_fn):
    model.eval()
    scores = []
    for image in loader:
        out = model(image.cuda())
        pred = F.one_hot(out.masks.squeeze(-1).argmax(dim=1).flatten(1), out.masks.shape[1]).float()
        scores.append(fg_ari(true_mask_fn(image).cuda(), pred))
    model.train()
    return torch.cat(scores).mean().item()


def train(args):
    loader = DataLoader(CLEVRImages(args.data_root), batch_size=args.batch_size, shuffle=True,
                        num_workers=8, drop_last=True, pin_memory=True)
    model = SlotAttentionAutoEncoder((128, 128), args.num_slots, args.num_iterations).cuda()
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    step = 0
    while step < args.num_train_steps:
        for image in loader:
            image = image.cuda(non_blocking=True)
            warm = min(1.0, step / args.warmup_steps)
            lr = args.learning_rate * warm * args.decay_rate ** (step / args.decay_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                out = model(image)
                loss_recon = F.mse_loss(out.recon, image)
                scale_reg = (out.slot_scales - args.target_scale).abs().mean()  # expect: AMP004
                spread = out.slot_pos.std(dim=1)  # expect: AMP004
                spread_reg = F.relu(args.min_spread - spread).mean()  # expect: AMP004
                loss = (loss_recon + args.ortho_weight * out.ortho + args.scale_weight * scale_reg
                        + args.spread_weight * spread_reg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            if step % 100 == 0:
                usage = out.masks.detach().float().mean(dim=(0, 2, 3, 4))
                print(f"step {step} lr {lr:.2e} recon {loss_recon.item():.5f} ortho {out.ortho.item():.4f} "
                      f"slot usage {usage.cpu().numpy().round(3)}")
            if step % args.ckpt_every == 0:
                torch.save({"model": model.state_dict(), "step": step}, os.path.join(args.out_dir, "slot_ae.pt"))
            step += 1
            if step >= args.num_train_steps:
                break


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", default="./CLEVR_v1.0")
    p.add_argument("--out_dir", default="./ckpt")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--num_slots", type=int, default=7)
    p.add_argument("--num_iterations", type=int, default=3)
    p.add_argument("--learning_rate", type=float, default=4e-4)
    p.add_argument("--warmup_steps", type=int, default=10000)
    p.add_argument("--decay_rate", type=float, default=0.5)
    p.add_argument("--decay_steps", type=int, default=100000)
    p.add_argument("--num_train_steps", type=int, default=500000)
    p.add_argument("--ortho_weight", type=float, default=0.01)
    p.add_argument("--scale_weight", type=float, default=0.1)
    p.add_argument("--target_scale", type=float, default=0.1)
    p.add_argument("--min_spread", type=float, default=0.3)
    p.add_argument("--spread_weight", type=float, default=0.01)
    p.add_argument("--ckpt_every", type=int, default=10000)
    p.add_argument("--compile", action="store_true")
    train(p.parse_args())
