"""Neural vocoder training script (flat script style, run with `python vocoder_train_script.py`)."""
import glob
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

DEVICE = "cuda"
LR = 2e-4
STEPS = 1_000_000
SEGMENT = 8192
FP16 = torch.float16


class WavDataset(Dataset):
    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "*.pt")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        item = torch.load(self.files[i])
        start = torch.randint(0, max(1, item["wav"].size(-1) - SEGMENT), (1,)).item()
        return item["mel"][:, start // 256 : start // 256 + SEGMENT // 256], item["wav"][start : start + SEGMENT]


class Generator(nn.Module):
    def __init__(self, n_mels=80, ch=512):
        super().__init__()
        self.pre = nn.Conv1d(n_mels, ch, 7, padding=3)
        self.ups = nn.ModuleList([nn.ConvTranspose1d(ch // 2 ** i, ch // 2 ** (i + 1), 16, 8, padding=4) for i in range(2)])
        self.ups.append(nn.ConvTranspose1d(ch // 4, ch // 8, 4, 2, padding=1))
        self.ups.append(nn.ConvTranspose1d(ch // 8, ch // 16, 4, 2, padding=1))
        self.post = nn.Conv1d(ch // 16, 1, 7, padding=3)

    def forward(self, mel):
        x = self.pre(mel)
        for up in self.ups:
            x = up(F.leaky_relu(x, 0.1))
        return torch.tanh(self.post(F.leaky_relu(x))).squeeze(1)


def stft_loss(pred, target, n_fft=1024, hop=256):
    window = torch.hann_window(n_fft, device=pred.device)
    p = torch.stft(pred.float(), n_fft, hop, window=window, return_complex=True).abs()
    t = torch.stft(target.float(), n_fft, hop, window=window, return_complex=True).abs()
    sc = torch.norm(t - p, p="fro") / torch.norm(t, p="fro")
    mag = F.l1_loss(torch.log(p.clamp(min=1e-5)), torch.log(t.clamp(min=1e-5)))
    return sc + mag


loader = DataLoader(WavDataset(sys.argv[1] if len(sys.argv) > 1 else "data"), batch_size=16, shuffle=True,
                    num_workers=4, drop_last=True)
generator = Generator().to(DEVICE)
generator = generator.to(FP16)  # expect: AMP001
optimizer = torch.optim.AdamW(generator.parameters(), LR, betas=(0.8, 0.99), eps=1e-6)

step = 0
while step < STEPS:
    for mel, wav in loader:
        mel = mel.to(DEVICE, FP16)  # expect: AMP001
        wav = wav.to(DEVICE)
        fake = generator(mel)
        loss = stft_loss(fake, wav)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 10000 == 0:
            torch.save({"generator": generator.state_dict(), "step": step}, f"g_{step:08d}.pt")
