"""BYOL for Audio (BYOL-A) pre-training, plain PyTorch loop (no Lightning).

Ported from the official repo's train.py + byol_a/models.py + byol_a/augmentations.py
so it runs on our cluster without lightning. Only AudioNTT2020 encoder.

    python train_byola.py --data_dir /data/audioset_lms --epochs 100 --bs 256 --amp

TODO: multi-gpu (DDP) -- for now single GPU only
"""
import argparse
import copy
import logging
import math
import os
import random
from functools import wraps
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
log = logging.getLogger("byola")


# ---------------------------------------------------------------------------
# common utils (copied from byol_a/common.py)
# ---------------------------------------------------------------------------
def seed_everything(seed=42):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def get_timestamp():
    import datetime
    return datetime.datetime.now().strftime("%y%m%d%H%M")


def load_yaml_config(path_to_config):
    import yaml
    from easydict import EasyDict
    with open(path_to_config) as f:
        cfg = yaml.safe_load(f)
    return EasyDict(cfg)


# ---------------------------------------------------------------------------
# augmentations
# ---------------------------------------------------------------------------
def log_mixup_exp(xa, xb, alpha):
    xa = xa.exp()
    xb = xb.exp()
    x = alpha * xa + (1. - alpha) * xb
    return torch.log(x + torch.finfo(x.dtype).eps)


class MixupBYOLA(nn.Module):
    """Mixup for BYOL-A: mixes the input with past inputs kept in a memory bank."""

    def __init__(self, ratio=0.4, n_memory=2048, log_mixup_exp=True):
        super().__init__()
        self.ratio = ratio
        self.n = n_memory
        self.log_mixup_exp = log_mixup_exp
        self.memory_bank = []

    def forward(self, x):
        alpha = self.ratio * np.random.random()
        if self.memory_bank:
            z = self.memory_bank[np.random.randint(len(self.memory_bank))]
            mixed = log_mixup_exp(x, z, 1. - alpha) if self.log_mixup_exp \
                else alpha * z + (1. - alpha) * x
        else:
            mixed = x
        self.memory_bank = (self.memory_bank + [x])[-self.n:]
        return mixed


class RandomResizeCrop(nn.Module):
    def __init__(self, virtual_crop_scale=(1.0, 1.5), freq_scale=(0.6, 1.5), time_scale=(0.6, 1.5)):
        super().__init__()
        self.virtual_crop_scale = virtual_crop_scale
        self.freq_scale = freq_scale
        self.time_scale = time_scale
        self.interpolation = "bicubic"
        assert time_scale[1] >= 1.0 and freq_scale[1] >= 1.0

    @staticmethod
    def get_params(virtual_crop_size, in_size, time_scale, freq_scale):
        canvas_h, canvas_w = virtual_crop_size
        src_h, src_w = in_size
        h = np.clip(int(np.random.uniform(*freq_scale) * src_h), 1, canvas_h)
        w = np.clip(int(np.random.uniform(*time_scale) * src_w), 1, canvas_w)
        i = random.randint(0, canvas_h - h) if canvas_h > h else 0
        j = random.randint(0, canvas_w - w) if canvas_w > w else 0
        return i, j, h, w

    def forward(self, lms):
        virtual_crop_size = [int(s * c) for s, c in zip(lms.shape[-2:], self.virtual_crop_scale)]
        virtual_crop_area = (torch.zeros((lms.shape[0], virtual_crop_size[0], virtual_crop_size[1]))
                             .to(torch.float).to(lms.device))
        _, lh, lw = virtual_crop_area.shape
        c, h, w = lms.shape
        x, y = (lw - w) // 2, (lh - h) // 2
        virtual_crop_area[:, y:y + h, x:x + w] = lms
        i, j, h, w = self.get_params(virtual_crop_area.shape[-2:], lms.shape[-2:], self.time_scale, self.freq_scale)
        crop = virtual_crop_area[:, i:i + h, j:j + w]
        lms = F.interpolate(crop.unsqueeze(0), size=lms.shape[-2:],
                            mode=self.interpolation, align_corners=True).squeeze(0)
        return lms.to(torch.float)


class PrecomputedNorm(nn.Module):
    def __init__(self, stats, axis=[1, 2]):
        super().__init__()
        self.axis = axis
        self.mean, self.std = stats

    def forward(self, X):
        return (X - self.mean) / self.std


class AugmentationModule:
    def __init__(self, size, epoch_samples, log_mixup_exp=True, mixup_ratio=0.4):
        self.train_transform = nn.Sequential(
            MixupBYOLA(ratio=mixup_ratio, log_mixup_exp=log_mixup_exp),
            RandomResizeCrop(virtual_crop_scale=(1.0, 1.5), freq_scale=(0.6, 1.5), time_scale=(0.6, 1.5)),
        )
        self.pre_norm = None

    def __call__(self, x):
        x = self.pre_norm(x)
        return self.train_transform(x), self.train_transform(x)


class LmsDataset(Dataset):
    def __init__(self, files, crop_frames=96, tfms=None):
        self.files = files
        self.crop_frames = crop_frames
        self.tfms = tfms

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        lms = torch.tensor(np.load(self.files[idx]))  # (1, F, T) log-mel, fp32
        t = lms.shape[-1]
        if t > self.crop_frames:
            start = random.randint(0, t - self.crop_frames)
            lms = lms[..., start:start + self.crop_frames]
        elif t < self.crop_frames:
            lms = F.pad(lms, (0, self.crop_frames - t))
        return self.tfms(lms) if self.tfms else lms


def calc_norm_stats(files, n_stats=10000):
    """mean/std over a subset of the dataset, fp32, on cpu"""
    files = random.sample(files, min(n_stats, len(files)))
    X = [np.load(f) for f in files]
    X = np.hstack([x.reshape(-1) for x in X])
    return [X.mean(), X.std()]


# ---------------------------------------------------------------------------
# model (byol_a/models.py)
# ---------------------------------------------------------------------------
class NetworkCommonMixIn():
    def load_weight(self, weight_file, device):
        state_dict = torch.load(weight_file, map_location=device)
        if "state_dict" in state_dict:
            state_dict = state_dict["state_dict"]
        weights = {}
        for k in state_dict:
            m = __import__("re").search(r"(^fc\.|\.fc\.|^features\.|\.features\.)", k)
            if m is None:
                continue
            new_k = k[m.start():]
            new_k = new_k[1:] if new_k[0] == "." else new_k
            weights[new_k] = state_dict[k]
        self.load_state_dict(weights)
        self.eval()
        return self


class AudioNTT2020Task6(nn.Module, NetworkCommonMixIn):
    def __init__(self, n_mels, d):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 64, 3, stride=1, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2, stride=2),

            nn.Conv2d(64, 64, 3, stride=1, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2, stride=2),

            nn.Conv2d(64, 64, 3, stride=1, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2, stride=2),
        )
        self.fc = nn.Sequential(
            nn.Linear(64 * (n_mels // (2**3)), d),
            nn.ReLU(),
            nn.Dropout(p=0.3),
            nn.Linear(d, d),
            nn.ReLU(),
        )
        self.d = d

    def forward(self, x):
        x = self.features(x)       # (batch, ch, mel, time)
        x = x.permute(0, 3, 2, 1)  # (batch, time, mel, ch)
        B, T, D, C = x.shape
        x = x.reshape((B, T, C * D))  # (batch, time, mel*ch)
        x = self.fc(x)
        return x


class AudioNTT2020(AudioNTT2020Task6):
    def __init__(self, n_mels=64, d=512):
        super().__init__(n_mels=n_mels, d=d)

    def forward(self, x):
        x = super().forward(x)
        (x1, _) = torch.max(x, dim=1)
        x2 = torch.mean(x, dim=1)  # expect: AMP004
        x = x1 + x2
        assert x.shape[1] == self.d and x.ndim == 2
        return x


# ---------------------------------------------------------------------------
# BYOL learner (adapted from lucidrains/byol-pytorch)
# ---------------------------------------------------------------------------
def singleton(cache_key):
    def inner_fn(fn):
        @wraps(fn)
        def wrapper(self, *args, **kwargs):
            instance = getattr(self, cache_key)
            if instance is not None:
                return instance
            instance = fn(self, *args, **kwargs)
            setattr(self, cache_key, instance)
            return instance
        return wrapper
    return inner_fn


def set_requires_grad(model, val):
    for p in model.parameters():
        p.requires_grad = val


def loss_fn(x, y):
    x = F.normalize(x, dim=-1, p=2)
    y = F.normalize(y, dim=-1, p=2)
    return 2 - 2 * (x * y).sum(dim=-1)


class EMA():
    def __init__(self, beta):
        super().__init__()
        self.beta = beta

    def update_average(self, old, new):
        if old is None:
            return new
        return old * self.beta + (1 - self.beta) * new


def update_moving_average(ema_updater, ma_model, current_model):
    for current_params, ma_params in zip(current_model.parameters(), ma_model.parameters()):
        old_weight, up_weight = ma_params.data, current_params.data
        ma_params.data = ema_updater.update_average(old_weight, up_weight)


class MLP(nn.Module):
    def __init__(self, dim, projection_size, hidden_size=4096):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden_size),
            nn.BatchNorm1d(hidden_size),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_size, projection_size)
        )

    def forward(self, x):
        return self.net(x)


class NetWrapper(nn.Module):
    def __init__(self, net, projection_size, projection_hidden_size):
        super().__init__()
        self.net = net
        self.projector = None
        self.projection_size = projection_size
        self.projection_hidden_size = projection_hidden_size

    @singleton('projector')
    def _get_projector(self, hidden):
        _, dim = hidden.shape
        projector = MLP(dim, self.projection_size, self.projection_hidden_size)
        return projector.to(hidden)

    def get_representation(self, x):
        return self.net(x)

    def forward(self, x):
        representation = self.get_representation(x)
        projector = self._get_projector(representation)
        projection = projector(representation)
        return projection


class BYOL(nn.Module):
    def __init__(self, net, image_size, hidden_layer=-1, projection_size=256,
                 projection_hidden_size=4096, moving_average_decay=0.99, use_momentum=True):
        super().__init__()
        self.net = net
        self.online_encoder = NetWrapper(net, projection_size, projection_hidden_size)
        self.use_momentum = use_momentum
        self.target_encoder = None
        self.target_ema_updater = EMA(moving_average_decay)
        self.online_predictor = MLP(projection_size, projection_size, projection_hidden_size)

        device = next(net.parameters()).device
        self.to(device)
        # send a mock image tensor to instantiate singleton parameters
        with torch.no_grad():
            self.forward(torch.randn(2, 1, image_size[0], image_size[1], device=device),
                         torch.randn(2, 1, image_size[0], image_size[1], device=device))

    @singleton('target_encoder')
    def _get_target_encoder(self):
        target_encoder = copy.deepcopy(self.online_encoder)
        set_requires_grad(target_encoder, False)
        return target_encoder

    def reset_moving_average(self):
        del self.target_encoder
        self.target_encoder = None

    def update_moving_average(self):
        assert self.use_momentum, 'you do not need to update the moving average'
        assert self.target_encoder is not None, 'target encoder has not been created yet'
        update_moving_average(self.target_ema_updater, self.target_encoder, self.online_encoder)

    def forward(self, image_one, image_two):
        online_proj_one = self.online_encoder(image_one)
        online_proj_two = self.online_encoder(image_two)

        online_pred_one = self.online_predictor(online_proj_one)
        online_pred_two = self.online_predictor(online_proj_two)

        with torch.no_grad():
            target_encoder = self._get_target_encoder() if self.use_momentum else self.online_encoder
            target_proj_one = target_encoder(image_one)
            target_proj_two = target_encoder(image_two)
            target_proj_one.detach_()
            target_proj_two.detach_()

        loss_one = loss_fn(online_pred_one, target_proj_two.detach())
        loss_two = loss_fn(online_pred_two, target_proj_one.detach())

        loss = loss_one + loss_two
        return loss.mean()


# ---------------------------------------------------------------------------
# train utils
# ---------------------------------------------------------------------------
def optimizer_step(model, optimizer, scaler, max_norm):
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # expect: AMP005
    scaler.step(optimizer)  # expect: AMP006
    optimizer.zero_grad(set_to_none=True)


def save_checkpoint(learner, path, epoch, half=False):
    net = learner.net
    if half:
        # smaller files for the downstream eval sweep; eval code casts back to fp32
        net = copy.deepcopy(net).half()
    torch.save({"epoch": epoch, "state_dict": net.state_dict()}, path)


def export_encoder(learner, out_file):
    enc = copy.deepcopy(learner.net).half().eval()
    scripted = torch.jit.script(enc)
    scripted.save(out_file)


def train_linear_probe(encoder, probe_loader, n_classes, device, epochs=20, use_amp=True):
    """quick sanity check during pretraining: linear classifier on frozen embeddings (ESC-50 fold 1)"""
    clf = nn.Linear(encoder.d, n_classes).to(device)
    opt = torch.optim.Adam(clf.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    encoder.eval()
    for ep in range(epochs):
        correct, total = 0, 0
        for x, y in probe_loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
                with torch.no_grad():
                    z = encoder(x)
                logits = clf(z)
                loss = F.cross_entropy(logits, y)
                scaler.scale(loss).backward()  # expect: AMP008
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            correct += (logits.argmax(-1) == y).sum().item()
            total += y.numel()
    encoder.train()
    return correct / max(total, 1)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="/data/audioset_lms")
    p.add_argument("--out_dir", default="checkpoints")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--feature_d", type=int, default=2048)
    p.add_argument("--n_mels", type=int, default=64)
    p.add_argument("--crop_frames", type=int, default=96)
    p.add_argument("--proj_size", type=int, default=256)
    p.add_argument("--proj_dim", type=int, default=4096)
    p.add_argument("--ema_decay", type=float, default=0.99)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--save_half", action="store_true")
    p.add_argument("--probe_npz", default="", help="ESC-50 log-mel npz for the linear probe")
    p.add_argument("--probe_every", type=int, default=10)
    return p.parse_args()


def main():
    args = parse_args()
    seed_everything(args.seed)
    device = torch.device("cuda")

    files = sorted(str(f) for f in Path(args.data_dir).glob("**/*.npy"))
    log.info(f"{len(files)} files")
    tfms = AugmentationModule((args.n_mels, args.crop_frames), 2 * len(files))
    stats = calc_norm_stats(files)
    tfms.pre_norm = PrecomputedNorm(stats)
    ds = LmsDataset(files, crop_frames=args.crop_frames, tfms=tfms)
    dl = DataLoader(ds, batch_size=args.bs, num_workers=args.workers, pin_memory=True,
                    shuffle=True, drop_last=True)

    model = AudioNTT2020(n_mels=args.n_mels, d=args.feature_d).to(device)
    learner = BYOL(model, image_size=(args.n_mels, args.crop_frames),
                   projection_size=args.proj_size, projection_hidden_size=args.proj_dim,
                   moving_average_decay=args.ema_decay)
    optimizer = torch.optim.Adam(learner.parameters(), lr=args.lr)

    # fp16 went NaN after ~30 epochs (BN in the projector?), A100 -> bf16
    amp_dtype = torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)  # expect: AMP010

    out_dir = Path(args.out_dir) / f"AudioNTT2020-BYOLA-{get_timestamp()}"
    out_dir.mkdir(parents=True, exist_ok=True)
    best = 1e9
    step = 0
    for epoch in range(args.epochs):
        learner.train()
        running = 0.0
        for i, (x1, x2) in enumerate(dl):
            x1 = x1.to(device, non_blocking=True)
            x2 = x2.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=amp_dtype, enabled=args.amp):
                loss = learner(x1, x2)
            scaler.scale(loss).backward()
            optimizer_step(learner, optimizer, scaler, args.clip)
            learner.update_moving_average()
            running += loss.item()
            step += 1
            if i % 50 == 0:
                log.info(f"ep {epoch} it {i} loss {loss.item():.5f}")
        epoch_loss = running / max(1, len(dl))
        log.info(f"epoch {epoch} loss {epoch_loss:.5f}")
        if epoch_loss < best:
            best = epoch_loss
            save_checkpoint(learner, out_dir / "best.pth", epoch, half=args.save_half)
        save_checkpoint(learner, out_dir / "last.pth", epoch, half=args.save_half)
        if args.probe_npz and (epoch + 1) % args.probe_every == 0:
            probe = np.load(args.probe_npz)
            probe_ds = torch.utils.data.TensorDataset(
                tfms.pre_norm(torch.from_numpy(probe["lms"]).float()), torch.from_numpy(probe["label"]).long())
            probe_loader = DataLoader(probe_ds, batch_size=128, shuffle=True)
            acc = train_linear_probe(model, probe_loader, 50, device, use_amp=args.amp)
            log.info(f"epoch {epoch} linear probe acc {acc:.4f}")

    export_encoder(learner, str(out_dir / "encoder.pt"))


if __name__ == "__main__":
    main()
