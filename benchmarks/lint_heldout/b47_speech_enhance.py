"""Waveform speech enhancement (DEMUCS-style U-Net with an attention bottleneck).

Trained with SI-SNR + multi-resolution STFT losses on DNS-challenge mixtures, then
fine-tuned on real recordings and distilled into a small causal student.
"""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        eps = 1e-5 if x.dtype in (torch.float16, torch.bfloat16) else 1e-8
        rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return (x.float() * rms).to(x.dtype) * self.weight


class ChunkedSelfAttention(nn.Module):
    def __init__(self, dim, heads=4, chunk=None):
        super().__init__()
        self.heads, self.chunk = heads, chunk
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        if pad_mask is not None:
            scores = scores.masked_fill(pad_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        if self.chunk is not None:
            idx = torch.arange(T, device=x.device) // self.chunk
            scores = scores.masked_fill(idx[None, :] > idx[:, None], -1e5)  # expect: AMP007
        probs = scores.softmax(dim=-1)
        return self.proj((probs @ v).transpose(1, 2).reshape(B, T, C))


class DemucsLite(nn.Module):
    def __init__(self, hidden=48, depth=4, kernel=8, stride=4, chunk=None):
        super().__init__()
        self.kernel, self.stride, self.depth = kernel, stride, depth
        self.encoder, self.decoder = nn.ModuleList(), nn.ModuleList()
        ch = 1
        for i in range(depth):
            self.encoder.append(nn.Sequential(nn.Conv1d(ch, hidden, kernel, stride), nn.ReLU(),
                                              nn.Conv1d(hidden, 2 * hidden, 1), nn.GLU(1)))
            dec = [nn.Conv1d(hidden, 2 * hidden, 1), nn.GLU(1), nn.ConvTranspose1d(hidden, ch, kernel, stride)]
            self.decoder.insert(0, nn.Sequential(*dec, nn.ReLU()) if i > 0 else nn.Sequential(*dec))
            ch, hidden = hidden, 2 * hidden
        self.norm = RMSNorm(ch)
        self.attn = ChunkedSelfAttention(ch, chunk=chunk)

    def valid_length(self, length):
        for _ in range(self.depth):
            length = max(1, -(-(length - self.kernel) // self.stride) + 1)
        for _ in range(self.depth):
            length = (length - 1) * self.stride + self.kernel
        return length

    def forward(self, noisy):
        x = F.pad(noisy, (0, self.valid_length(noisy.shape[-1]) - noisy.shape[-1]))
        skips = []
        for enc in self.encoder:
            x = enc(x)
            skips.append(x)
        h = x.transpose(1, 2)
        x = (h + self.attn(self.norm(h))).transpose(1, 2)
        for dec in self.decoder:
            skip = skips.pop(-1)
            x = dec(x + skip[..., : x.shape[-1]])
        return x[..., : noisy.shape[-1]]


def si_snr_loss(est, ref, eps=1e-6):
    est = est - est.mean(dim=-1, keepdim=True)
    ref = ref - ref.mean(dim=-1, keepdim=True)
    proj = (est * ref).sum(dim=-1, keepdim=True) * ref / (ref.pow(2).sum(dim=-1, keepdim=True) + eps)
    noise = est - proj
    ratio = proj.pow(2).sum(dim=-1) / (noise.pow(2).sum(dim=-1) + eps)
    return -10 * torch.log10(ratio + eps).mean()


def multi_res_stft_loss(est, ref, resolutions=((512, 128), (1024, 256), (2048, 512))):
    loss = 0.0
    for n_fft, hop in resolutions:
        window = torch.hann_window(n_fft, device=est.device)
        E = torch.stft(est.float().squeeze(1), n_fft, hop, window=window, return_complex=True).abs()
        R = torch.stft(ref.float().squeeze(1), n_fft, hop, window=window, return_complex=True).abs()
        sc = torch.norm(R - E, p="fro") / torch.norm(R, p="fro").clamp(min=1e-5)
        mag = F.l1_loss(torch.log(E.clamp(min=1e-5)), torch.log(R.clamp(min=1e-5)))
        loss = loss + sc + mag
    return loss / len(resolutions)


def train_epoch(model, loader, optimizer, scaler, args):
    amp_dtype = torch.bfloat16 if args.amp_dtype == "bf16" else torch.float16
    model.train()
    for step, (noisy, clean) in enumerate(loader):
        noisy, clean = noisy.cuda(non_blocking=True), clean.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=amp_dtype, enabled=args.amp):
            est = model(noisy)
            loss = si_snr_loss(est.float(), clean) + args.stft_weight * multi_res_stft_loss(est, clean)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f} grad {grad_norm:.2f}")


def finetune_real(model, loader, args):
    """Stage 2: a few thousand steps on real recordings with pseudo-clean targets."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * 0.1, betas=(0.9, 0.999))
    scaler = torch.amp.GradScaler("cuda")
    model.train()
    for noisy, pseudo_clean in loader:
        noisy, pseudo_clean = noisy.cuda(non_blocking=True), pseudo_clean.cuda(non_blocking=True)
        with torch.cuda.amp.autocast():  # expect: AMP009
            est = model(noisy)
            loss = si_snr_loss(est.float(), pseudo_clean.float())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()


def distill_student(student, teacher, loader, args):
    """Distil the non-causal teacher into a chunked-attention student for streaming."""
    teacher.requires_grad_(False)
    teacher = teacher.half().eval()
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, eps=1e-8)
    amp_dtype = torch.bfloat16 if args.amp_dtype == "bf16" else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    student.train()
    for noisy, _ in loader:
        noisy = noisy.cuda(non_blocking=True)
        with torch.no_grad():
            target = teacher(noisy.half()).float()
        with torch.autocast("cuda", dtype=amp_dtype):
            est = student(noisy)
        loss = si_snr_loss(est, target)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(student.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total, n = 0.0, 0
    for noisy, clean in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            est = model(noisy.cuda())
        total += -si_snr_loss(est.float(), clean.cuda()).item() * noisy.shape[0]
        n += noisy.shape[0]
    model.train()
    return total / max(1, n)


@torch.inference_mode()
def enhance_file(model, wav, device="cuda"):
    scale = wav.abs().amax().clamp(min=1e-4)
    est = model.half()(wav.to(device).half()[None, None] / scale)
    return (est.float() * scale).squeeze().cpu()


def export_torchscript(model, path):
    torch.jit.script(copy.deepcopy(model).half().eval()).save(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--amp-dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--clip", type=float, default=5.0)
    parser.add_argument("--stft-weight", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args()
    model = DemucsLite().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp and args.amp_dtype == "fp16")
    loaders = build_loaders(args)  # noqa: F821  (project helper)
    best = float("-inf")
    for _ in range(args.epochs):
        train_epoch(model, loaders["synthetic"], optimizer, scaler, args)
        best = max(best, evaluate(model, loaders["valid"]))
    finetune_real(model, loaders["real"], args)
    student = DemucsLite(hidden=32, chunk=25).cuda()
    distill_student(student, model, loaders["synthetic"], args)
    export_torchscript(student, "demucs_student_fp16.pt")


if __name__ == "__main__":
    main()
