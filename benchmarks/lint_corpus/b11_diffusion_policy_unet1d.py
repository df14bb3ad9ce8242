"""Diffusion Policy (CNN / UNet1D) on our pick-and-place demos.

Stripped down from diffusion_policy/workspace/train_diffusion_unet_image_workspace.py,
no hydra, one file so it is easy to scp onto the robot PC. Two wrist+front cameras,
obs horizon 2, action horizon 8, pred horizon 16.

    python train_dp.py --zarr data/pick_place_v3.zarr --precision bf16 --epochs 3000
"""
import argparse
import copy
import math
import os
import pathlib
import random
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import tqdm
import zarr

# import wandb

OBS_HORIZON = 2
ACTION_HORIZON = 8
PRED_HORIZON = 16
ACTION_DIM = 7
LOWDIM = 9


# =============================================================================
# normalizer (from diffusion_policy.model.common.normalizer, simplified)
# =============================================================================
class LinearNormalizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.params = nn.ParameterDict()

    @torch.no_grad()
    def fit(self, data: dict, output_max=1., output_min=-1., range_eps=1e-4):
        for key, value in data.items():
            value = torch.as_tensor(value, dtype=torch.float32).reshape(-1, value.shape[-1])
            input_max = value.max(dim=0).values
            input_min = value.min(dim=0).values
            input_range = input_max - input_min
            ignore_dim = input_range < range_eps
            input_range[ignore_dim] = output_max - output_min
            scale = (output_max - output_min) / (input_range + 1e-12)
            offset = output_min - scale * input_min
            offset[ignore_dim] = (output_max + output_min) / 2 - input_min[ignore_dim]
            self.params[key] = nn.ParameterDict({
                "scale": nn.Parameter(scale, requires_grad=False),
                "offset": nn.Parameter(offset, requires_grad=False),
            })

    def normalize(self, key, x):
        p = self.params[key]
        return x * p["scale"] + p["offset"]

    def unnormalize(self, key, x):
        p = self.params[key]
        return (x - p["offset"]) / p["scale"]


# =============================================================================
# networks
# =============================================================================
class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        device = x.device
        half_dim = self.dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, device=device) * -emb)
        emb = x[:, None] * emb[None, :]
        emb = torch.cat((emb.sin(), emb.cos()), dim=-1)
        return emb


class Conv1dBlock(nn.Module):
    def __init__(self, inp_channels, out_channels, kernel_size, n_groups=8):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv1d(inp_channels, out_channels, kernel_size, padding=kernel_size // 2),
            nn.GroupNorm(n_groups, out_channels),
            nn.Mish(),
        )

    def forward(self, x):
        return self.block(x)


class ConditionalResidualBlock1D(nn.Module):
    def __init__(self, in_channels, out_channels, cond_dim, kernel_size=3, n_groups=8):
        super().__init__()
        self.blocks = nn.ModuleList([
            Conv1dBlock(in_channels, out_channels, kernel_size, n_groups=n_groups),
            Conv1dBlock(out_channels, out_channels, kernel_size, n_groups=n_groups),
        ])
        # FiLM modulation https://arxiv.org/abs/1709.07871
        cond_channels = out_channels * 2
        self.out_channels = out_channels
        self.cond_encoder = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, cond_channels), nn.Unflatten(-1, (-1, 1)))
        self.residual_conv = nn.Conv1d(in_channels, out_channels, 1) \
            if in_channels != out_channels else nn.Identity()

    def forward(self, x, cond):
        out = self.blocks[0](x)
        embed = self.cond_encoder(cond)
        embed = embed.reshape(embed.shape[0], 2, self.out_channels, 1)
        scale = embed[:, 0, ...]
        bias = embed[:, 1, ...]
        out = scale * out + bias
        out = self.blocks[1](out)
        out = out + self.residual_conv(x)
        return out


class ConditionalUnet1D(nn.Module):
    def __init__(self, input_dim, global_cond_dim, diffusion_step_embed_dim=256,
                 down_dims=(256, 512, 1024), kernel_size=5, n_groups=8):
        super().__init__()
        all_dims = [input_dim] + list(down_dims)
        start_dim = down_dims[0]

        dsed = diffusion_step_embed_dim
        self.diffusion_step_encoder = nn.Sequential(
            SinusoidalPosEmb(dsed),
            nn.Linear(dsed, dsed * 4),
            nn.Mish(),
            nn.Linear(dsed * 4, dsed),
        )
        cond_dim = dsed + global_cond_dim

        in_out = list(zip(all_dims[:-1], all_dims[1:]))
        mid_dim = all_dims[-1]
        self.mid_modules = nn.ModuleList([
            ConditionalResidualBlock1D(mid_dim, mid_dim, cond_dim, kernel_size=kernel_size, n_groups=n_groups),
            ConditionalResidualBlock1D(mid_dim, mid_dim, cond_dim, kernel_size=kernel_size, n_groups=n_groups),
        ])

        down_modules = nn.ModuleList([])
        for ind, (dim_in, dim_out) in enumerate(in_out):
            is_last = ind >= (len(in_out) - 1)
            down_modules.append(nn.ModuleList([
                ConditionalResidualBlock1D(dim_in, dim_out, cond_dim, kernel_size=kernel_size, n_groups=n_groups),
                ConditionalResidualBlock1D(dim_out, dim_out, cond_dim, kernel_size=kernel_size, n_groups=n_groups),
                nn.Conv1d(dim_out, dim_out, 3, 2, 1) if not is_last else nn.Identity(),
            ]))

        up_modules = nn.ModuleList([])
        for ind, (dim_in, dim_out) in enumerate(reversed(in_out[1:])):
            is_last = ind >= (len(in_out) - 1)
            up_modules.append(nn.ModuleList([
                ConditionalResidualBlock1D(dim_out * 2, dim_in, cond_dim, kernel_size=kernel_size, n_groups=n_groups),
                ConditionalResidualBlock1D(dim_in, dim_in, cond_dim, kernel_size=kernel_size, n_groups=n_groups),
                nn.ConvTranspose1d(dim_in, dim_in, 4, 2, 1) if not is_last else nn.Identity(),
            ]))

        final_conv = nn.Sequential(
            Conv1dBlock(start_dim, start_dim, kernel_size=kernel_size),
            nn.Conv1d(start_dim, input_dim, 1),
        )

        self.up_modules = up_modules
        self.down_modules = down_modules
        self.final_conv = final_conv
        print("number of parameters: {:e}".format(sum(p.numel() for p in self.parameters())))

    def forward(self, sample, timestep, global_cond=None):
        # (B, T, C) -> (B, C, T)
        sample = sample.moveaxis(-1, -2)
        timesteps = timestep
        if not torch.is_tensor(timesteps):
            timesteps = torch.tensor([timesteps], dtype=torch.long, device=sample.device)
        elif torch.is_tensor(timesteps) and len(timesteps.shape) == 0:
            timesteps = timesteps[None].to(sample.device)
        timesteps = timesteps.expand(sample.shape[0])

        global_feature = self.diffusion_step_encoder(timesteps)
        if global_cond is not None:
            global_feature = torch.cat([global_feature, global_cond], axis=-1)

        x = sample
        h = []
        for idx, (resnet, resnet2, downsample) in enumerate(self.down_modules):
            x = resnet(x, global_feature)
            x = resnet2(x, global_feature)
            h.append(x)
            x = downsample(x)

        for mid_module in self.mid_modules:
            x = mid_module(x, global_feature)

        for idx, (resnet, resnet2, upsample) in enumerate(self.up_modules):
            x = torch.cat((x, h.pop()), dim=1)
            x = resnet(x, global_feature)
            x = resnet2(x, global_feature)
            x = upsample(x)

        x = self.final_conv(x)
        x = x.moveaxis(-1, -2)
        return x


def replace_bn_with_gn(root_module, features_per_group=16):
    for name, module in list(root_module.named_children()):
        if isinstance(module, nn.BatchNorm2d):
            setattr(root_module, name, nn.GroupNorm(module.num_features // features_per_group, module.num_features))
        else:
            replace_bn_with_gn(module, features_per_group)
    return root_module


class CameraEncoder(nn.Module):
    """resnet18 trunk (GroupNorm), global average pool, linear"""

    def __init__(self, out_dim=256):
        super().__init__()
        resnet = torchvision.models.resnet18(weights=None)
        resnet = replace_bn_with_gn(resnet)
        self.trunk = nn.Sequential(
            resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool,
            resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4,
        )
        self.conv_out = nn.Conv2d(512, out_dim, kernel_size=1)

    def forward(self, img):
        x = self.trunk(img)
        x = self.conv_out(x)
        x = x.mean(dim=[-2, -1])  # expect: AMP004
        return x


class MultiCamObsEncoder(nn.Module):
    """one encoder per camera, then attention over (cams x obs_horizon) tokens, query = proprio"""

    def __init__(self, cams=("front", "wrist"), feat_dim=256, lowdim=LOWDIM, n_heads=4):
        super().__init__()
        self.cams = cams
        self.enc = nn.ModuleDict({c: CameraEncoder(feat_dim) for c in cams})
        self.q = nn.Linear(lowdim, feat_dim)
        self.k = nn.Linear(feat_dim, feat_dim)
        self.v = nn.Linear(feat_dim, feat_dim)
        self.n_heads = n_heads
        self.out_dim = feat_dim + lowdim * OBS_HORIZON

    def forward(self, obs, cam_valid=None):
        # obs[c]: (B, To, 3, H, W); obs["agent_pos"]: (B, To, lowdim); cam_valid: (B, n_cam*To) bool
        B = obs["agent_pos"].shape[0]
        tokens = []
        for c in self.cams:
            img = obs[c].flatten(end_dim=1)
            tokens.append(self.enc[c](img).reshape(B, -1, self.k.in_features))
        tokens = torch.cat(tokens, dim=1)  # (B, n_cam*To, D)
        q = self.q(obs["agent_pos"][:, -1])  # (B, D)
        k = self.k(tokens)
        v = self.v(tokens)
        att = torch.einsum("bd,bnd->bn", q, k) / math.sqrt(k.shape[-1])
        if cam_valid is not None:
            # a camera that dropped frames gets masked out
            att = att.masked_fill(~cam_valid, -1e9)  # expect: AMP007
        att = att.softmax(dim=-1)
        feat = torch.einsum("bn,bnd->bd", att, v)
        return torch.cat([feat, obs["agent_pos"].flatten(start_dim=1)], dim=-1)


# =============================================================================
# DDPM scheduler (squaredcos_cap_v2), minimal
# =============================================================================
class DDPMScheduler:
    def __init__(self, num_train_timesteps=100, clip_sample=True):
        self.num_train_timesteps = num_train_timesteps
        self.clip_sample = clip_sample
        steps = num_train_timesteps + 1
        t = torch.linspace(0, num_train_timesteps, steps, dtype=torch.float64) / num_train_timesteps
        alphas_cumprod = torch.cos((t + 0.008) / 1.008 * math.pi * 0.5) ** 2
        alphas_cumprod = alphas_cumprod / alphas_cumprod[0]
        betas = 1 - (alphas_cumprod[1:] / alphas_cumprod[:-1])
        self.betas = torch.clip(betas, 0, 0.999).float()
        self.alphas = 1.0 - self.betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)
        self.timesteps = torch.arange(0, num_train_timesteps).flip(0)

    def add_noise(self, original, noise, timesteps):
        acp = self.alphas_cumprod.to(device=original.device, dtype=original.dtype)
        sqrt_alpha_prod = acp[timesteps] ** 0.5
        sqrt_one_minus_alpha_prod = (1 - acp[timesteps]) ** 0.5
        while len(sqrt_alpha_prod.shape) < len(original.shape):
            sqrt_alpha_prod = sqrt_alpha_prod.unsqueeze(-1)
            sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.unsqueeze(-1)
        return sqrt_alpha_prod * original + sqrt_one_minus_alpha_prod * noise

    def step(self, model_output, t, sample):
        acp = self.alphas_cumprod.to(sample.device)
        alpha_prod_t = acp[t]
        alpha_prod_t_prev = acp[t - 1] if t > 0 else torch.tensor(1.0, device=sample.device)
        beta_prod_t = 1 - alpha_prod_t
        beta_prod_t_prev = 1 - alpha_prod_t_prev
        pred_original = (sample - beta_prod_t ** 0.5 * model_output) / alpha_prod_t ** 0.5
        if self.clip_sample:
            pred_original = pred_original.clamp(-1, 1)
        coef_orig = (alpha_prod_t_prev ** 0.5 * self.betas[t].to(sample.device)) / beta_prod_t
        coef_cur = self.alphas[t].to(sample.device) ** 0.5 * beta_prod_t_prev / beta_prod_t
        prev = coef_orig * pred_original + coef_cur * sample
        if t > 0:
            var = (1 - alpha_prod_t_prev) / (1 - alpha_prod_t) * self.betas[t].to(sample.device)
            prev = prev + var.clamp(min=1e-20) ** 0.5 * torch.randn_like(sample)
        return prev


class EMAModel:
    def __init__(self, model, power=0.75, max_value=0.9999):
        self.averaged_model = copy.deepcopy(model).eval()
        self.averaged_model.requires_grad_(False)
        self.power = power
        self.max_value = max_value
        self.optimization_step = 0

    def get_decay(self, step):
        value = 1 - (1 + step) ** -self.power
        return max(0.0, min(value, self.max_value))

    @torch.no_grad()
    def step(self, new_model):
        decay = self.get_decay(self.optimization_step)
        for ema_p, p in zip(self.averaged_model.parameters(), new_model.parameters()):
            ema_p.mul_(decay).add_(p.detach().to(ema_p.dtype), alpha=1 - decay)
        self.optimization_step += 1


# =============================================================================
# policy
# =============================================================================
class DiffusionUnetImagePolicy(nn.Module):
    def __init__(self, obs_encoder, noise_pred_net, scheduler, normalizer):
        super().__init__()
        self.obs_encoder = obs_encoder
        self.model = noise_pred_net
        self.noise_scheduler = scheduler
        self.normalizer = normalizer

    def compute_loss(self, batch):
        nobs = {k: v for k, v in batch["obs"].items()}
        nobs["agent_pos"] = self.normalizer.normalize("agent_pos", nobs["agent_pos"])
        nactions = self.normalizer.normalize("action", batch["action"])
        global_cond = self.obs_encoder(nobs, batch.get("cam_valid"))

        noise = torch.randn(nactions.shape, device=nactions.device)
        bsz = nactions.shape[0]
        timesteps = torch.randint(0, self.noise_scheduler.num_train_timesteps, (bsz,), device=nactions.device).long()
        noisy_actions = self.noise_scheduler.add_noise(nactions, noise, timesteps)
        pred = self.model(noisy_actions, timesteps, global_cond=global_cond)
        loss = F.mse_loss(pred, noise, reduction="none")
        loss = loss.reshape(bsz, -1).mean(dim=-1)
        return loss.mean()

    @torch.no_grad()
    def predict_action(self, obs):
        nobs = dict(obs)
        nobs["agent_pos"] = self.normalizer.normalize("agent_pos", nobs["agent_pos"])
        global_cond = self.obs_encoder(nobs)
        B = global_cond.shape[0]
        naction = torch.randn((B, PRED_HORIZON, ACTION_DIM), device=global_cond.device, dtype=global_cond.dtype)
        for k in self.noise_scheduler.timesteps:
            noise_pred = self.model(naction, k, global_cond=global_cond)
            naction = self.noise_scheduler.step(noise_pred, k, naction)
        action_pred = self.normalizer.unnormalize("action", naction)
        start = OBS_HORIZON - 1
        return action_pred[:, start:start + ACTION_HORIZON]


# =============================================================================
# data
# =============================================================================
class ZarrSeqDataset(torch.utils.data.Dataset):
    def __init__(self, path):
        root = zarr.open(path, "r")
        self.front = root["data/front_img"]
        self.wrist = root["data/wrist_img"]
        self.agent_pos = root["data/agent_pos"][:]
        self.action = root["data/action"][:]
        self.episode_ends = root["meta/episode_ends"][:]
        self.indices = self._make_indices()

    def _make_indices(self):
        idx = []
        start = 0
        for end in self.episode_ends:
            for i in range(start, end - PRED_HORIZON + 1):
                idx.append(i)
            start = end
        return np.array(idx)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        s = self.indices[i]
        obs = {
            "front": torch.from_numpy(self.front[s:s + OBS_HORIZON]).permute(0, 3, 1, 2).float() / 255.0,
            "wrist": torch.from_numpy(self.wrist[s:s + OBS_HORIZON]).permute(0, 3, 1, 2).float() / 255.0,
            "agent_pos": torch.from_numpy(self.agent_pos[s:s + OBS_HORIZON]).float(),
        }
        return {"obs": obs, "action": torch.from_numpy(self.action[s:s + PRED_HORIZON]).float()}


def dict_apply(x, func):
    result = dict()
    for key, value in x.items():
        if isinstance(value, dict):
            result[key] = dict_apply(value, func)
        else:
            result[key] = func(value)
    return result


# =============================================================================
# train
# =============================================================================
def train(args):
    seed = args.seed
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    device = torch.device(args.device)

    dataset = ZarrSeqDataset(args.zarr)
    normalizer = LinearNormalizer()
    normalizer.fit({"agent_pos": dataset.agent_pos, "action": dataset.action})
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=8, shuffle=True,
                                         pin_memory=True, persistent_workers=True)

    obs_encoder = MultiCamObsEncoder()
    noise_pred_net = ConditionalUnet1D(input_dim=ACTION_DIM, global_cond_dim=obs_encoder.out_dim)
    policy = DiffusionUnetImagePolicy(obs_encoder, noise_pred_net, DDPMScheduler(100), normalizer).to(device)

    # two resnet18s at 240x320 do not fit next to the unet on the 4090 otherwise
    policy.obs_encoder.half()  # expect: AMP001
    ema = EMAModel(policy)

    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.95, 0.999), eps=1e-6, weight_decay=1e-6)
    total = len(loader) * args.epochs // args.grad_accum
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total,
                                                       pct_start=500 / total)

    match args.precision:
        case "bf16":
            amp_ctx = torch.autocast("cuda", dtype=torch.bfloat16)
        case "fp16":
            amp_ctx = torch.autocast("cuda", dtype=torch.float16)  # expect: AMP010
        case _:
            amp_ctx = nullcontext()

    ckpt_dir = pathlib.Path(args.out) / time.strftime("%Y.%m.%d-%H.%M.%S")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    global_step = 0
    best_train_loss = 1e10
    for epoch in range(args.epochs):
        policy.train()
        train_losses = []
        with tqdm.tqdm(loader, desc=f"epoch {epoch}", leave=False, mininterval=1.0) as tepoch:
            for batch_idx, batch in enumerate(tepoch):
                batch = dict_apply(batch, lambda x: x.to(device, non_blocking=True))

                with amp_ctx:
                    raw_loss = policy.compute_loss(batch)
                    loss = raw_loss / args.grad_accum
                    loss.backward()  # expect: AMP008

                if (batch_idx + 1) % args.grad_accum == 0:
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    lr_scheduler.step()
                    ema.step(policy)
                    global_step += 1

                raw_loss_cpu = raw_loss.item()
                tepoch.set_postfix(loss=raw_loss_cpu, refresh=False)
                train_losses.append(raw_loss_cpu)

        train_loss = float(np.mean(train_losses))
        print(f"epoch {epoch} train_loss {train_loss:.5f} lr {lr_scheduler.get_last_lr()[0]:.2e}")
        if train_loss < best_train_loss:
            best_train_loss = train_loss
        if (epoch + 1) % args.ckpt_every == 0:
            torch.save({
                "policy": policy.state_dict(),
                "ema": ema.averaged_model.state_dict(),
                "epoch": epoch,
            }, ckpt_dir / f"epoch={epoch:04d}-train_loss={train_loss:.3f}.ckpt")

        if (epoch + 1) % args.rollout_every == 0:
            rollout_sanity(ema.averaged_model, dataset, device)


def rollout_sanity(policy, dataset, device, n=8):
    """open-loop check on training samples: predicted vs recorded actions"""
    policy.eval()
    errs = []
    for i in np.random.choice(len(dataset), n, replace=False):
        sample = dataset[i]
        obs = dict_apply(sample["obs"], lambda x: x[None].to(device))
        with torch.autocast("cuda", dtype=torch.float16):
            pred = policy.predict_action(obs)
        gt = sample["action"][OBS_HORIZON - 1:OBS_HORIZON - 1 + ACTION_HORIZON].to(device)
        errs.append(F.mse_loss(pred.float(), gt[None]).item())
    print(f"open-loop action mse {np.mean(errs):.4f}")


def export_policy(ckpt_path, out_path):
    """half-precision ema weights for the on-robot runner"""
    ckpt = torch.load(ckpt_path, map_location="cpu")
    obs_encoder = MultiCamObsEncoder()
    net = ConditionalUnet1D(input_dim=ACTION_DIM, global_cond_dim=obs_encoder.out_dim)
    policy = DiffusionUnetImagePolicy(obs_encoder, net, DDPMScheduler(100), LinearNormalizer())
    policy.load_state_dict(ckpt["ema"], strict=False)
    policy = policy.half().eval()
    torch.save(policy.state_dict(), out_path)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--zarr", default="data/pick_place_v3.zarr")
    p.add_argument("--out", default="outputs/dp")
    p.add_argument("--epochs", type=int, default=3000)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--ckpt_every", type=int, default=50)
    p.add_argument("--rollout_every", type=int, default=50)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--seed", type=int, default=42)
    train(p.parse_args())
