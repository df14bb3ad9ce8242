"""
Fine-tune a Conformer-CTC acoustic model on a character vocabulary.

    python b62_asr_ctc_finetune.py --train manifests/train.jsonl --dev manifests/dev.jsonl \
        --init-from pretrained/encoder.pt --accum-steps 4 --batch-size 16

SpecAugment on log-mel features, CTC loss, gradient accumulation, tri-stage LR schedule.
Mixed precision uses torch.amp (the recipe this replaces used torch.cuda.amp.autocast).
"""
import argparse
import copy
import json
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

BLANK = 0


class ManifestDataset(Dataset):
    def __init__(self, manifest, vocab, n_mels=80, sample_rate=16000):
        with open(manifest) as f:
            self.items = [json.loads(line) for line in f]
        self.vocab = vocab
        self.melspec = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=400, hop_length=160, n_mels=n_mels)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = self.items[i]
        wav, _ = torchaudio.load(item["audio"])
        feats = torch.log(self.melspec(wav.mean(0)) + 1e-10).T
        ids = torch.tensor([self.vocab[c] for c in item["text"].lower() if c in self.vocab])
        return feats, ids, item["text"]


def collate(batch):
    feats, ids, texts = zip(*batch)
    return {"feats": pad_sequence(feats, batch_first=True),
            "feat_lens": torch.tensor([f.size(0) for f in feats]),
            "targets": torch.cat(ids),
            "target_lens": torch.tensor([len(t) for t in ids]),
            "texts": texts}


class SpecAugment(nn.Module):
    def __init__(self, freq_mask=27, time_mask=100, n_freq=2, n_time=10, max_ratio=0.05):
        super().__init__()
        self.freq_mask, self.time_mask = freq_mask, time_mask
        self.n_freq, self.n_time, self.max_ratio = n_freq, n_time, max_ratio

    def forward(self, x, lens):
        if not self.training:
            return x
        x = x.clone()
        n_feat = x.size(2)
        for b in range(x.size(0)):
            for _ in range(self.n_freq):
                f = random.randint(0, self.freq_mask)
                f0 = random.randint(0, n_feat - f)
                x[b, :, f0:f0 + f] = 0.0
            max_t = min(self.time_mask, int(self.max_ratio * lens[b]))
            for _ in range(self.n_time):
                t = random.randint(0, max_t)
                t0 = random.randint(0, max(0, int(lens[b]) - t))
                x[b, t0:t0 + t, :] = 0.0
        return x


class Conv2dSubsampling(nn.Module):
    def __init__(self, idim, odim):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x, lens):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        return self.out(x.transpose(1, 2).reshape(b, t, c * f)), ((lens - 1) // 2 - 1) // 2


class MHSA(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads, self.scale = heads, (d // heads) ** -0.5
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(pad_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = self.drop(scores.softmax(dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(B, T, C))


class ConformerBlock(nn.Module):
    def __init__(self, d, heads, dropout, kernel=31):
        super().__init__()
        ff = lambda: nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(dropout),  # noqa: E731
                                   nn.Linear(4 * d, d), nn.Dropout(dropout))
        self.ff1, self.ff2 = ff(), ff()
        self.norm_att, self.att = nn.LayerNorm(d), MHSA(d, heads, dropout)
        self.norm_conv = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.bn = nn.BatchNorm1d(d)
        self.pw2 = nn.Conv1d(d, d, 1)
        self.norm_out = nn.LayerNorm(d)

    def forward(self, x, pad_mask):
        x = x + 0.5 * self.ff1(x)
        x = x + self.att(self.norm_att(x), pad_mask)
        y = self.norm_conv(x).masked_fill(pad_mask[..., None], 0.0).transpose(1, 2)
        y = F.glu(self.pw1(y), dim=1)
        y = self.pw2(F.silu(self.bn(self.dw(y))))
        x = x + y.transpose(1, 2)
        x = x + 0.5 * self.ff2(x)
        return self.norm_out(x)


class CTCModel(nn.Module):
    def __init__(self, n_mels, d_model, heads, layers, vocab_size, dropout=0.1):
        super().__init__()
        self.subsample = Conv2dSubsampling(n_mels, d_model)
        self.layers = nn.ModuleList([ConformerBlock(d_model, heads, dropout) for _ in range(layers)])
        self.ctc_head = nn.Linear(d_model, vocab_size)

    def forward(self, feats, feat_lens):
        x, lens = self.subsample(feats, feat_lens)
        pad_mask = torch.arange(x.size(1), device=x.device)[None, :] >= lens[:, None]
        for layer in self.layers:
            x = layer(x, pad_mask)
        return self.ctc_head(x), lens


def cmvn(feats):
    return (feats - feats.mean(dim=1, keepdim=True)) / (feats.std(dim=1, keepdim=True) + 1e-5)


def tri_stage_lambda(warmup, hold, decay, init_scale=0.01, final_scale=0.05):
    def fn(step):
        if step < warmup:
            return init_scale + (1 - init_scale) * step / max(1, warmup)
        if step < warmup + hold:
            return 1.0
        return math.exp(math.log(final_scale) * min(1.0, (step - warmup - hold) / max(1, decay)))
    return fn


def greedy_decode(log_probs, lens, itos):
    best = log_probs.argmax(-1).cpu()
    out = []
    for seq, n in zip(best, lens.tolist()):
        ids = torch.unique_consecutive(seq[:n]).tolist()
        out.append("".join(itos[i] for i in ids if i != BLANK))
    return out


def edit_distance(a, b):
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
    return d[len(b)]


def to_device(batch):
    return [batch[k].cuda(non_blocking=True) for k in ("feats", "feat_lens", "targets", "target_lens")]


def train_one_epoch(model, loader, optimizer, scheduler, scaler, spec_aug, args, update):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    running, n = 0.0, 0
    for step, batch in enumerate(loader):
        feats, feat_lens, targets, target_lens = to_device(batch)
        feats = spec_aug(cmvn(feats), feat_lens)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, out_lens = model(feats, feat_lens)
        log_probs = logits.log_softmax(dim=-1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, targets, out_lens, target_lens, blank=BLANK, zero_infinity=True)  # expect: AMP002
        running, n = running + loss.item(), n + 1
        blank_ratio = (log_probs.argmax(-1) == BLANK).float().mean().item()
        loss = loss / args.accum_steps
        loss = scaler.scale(loss)
        loss.backward()
        if (step + 1) % args.accum_steps == 0:
            update += 1
            if update == args.freeze_encoder_updates:
                model.subsample.requires_grad_(True)
            optimizer.step()  # expect: AMP006
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if step % args.log_interval == 0:
            print(f"step {step} update {update} loss {running / n:.3f} blank {blank_ratio:.2f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} scale {scaler.get_scale():.0f}")
    return running / max(n, 1), update


@torch.no_grad()
def evaluate(model, loader, itos):
    model.eval()
    total, errs, words = 0.0, 0, 0
    for batch in loader:
        feats, feat_lens, targets, target_lens = to_device(batch)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, out_lens = model(cmvn(feats), feat_lens)
        log_probs = logits.float().log_softmax(dim=-1)
        total += F.ctc_loss(log_probs.transpose(0, 1), targets, out_lens, target_lens, blank=BLANK,
                            zero_infinity=True).item()
        for hyp, ref in zip(greedy_decode(log_probs, out_lens, itos), batch["texts"]):
            errs += edit_distance(hyp.split(), ref.lower().split())
            words += len(ref.split())
    model.train()
    return total / max(len(loader), 1), errs / max(words, 1)


def export_for_inference(model, path):
    """TorchScript an fp16 copy for the streaming server."""
    scripted = torch.jit.script(copy.deepcopy(model).eval().half())
    scripted.save(path)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--vocab", default="vocab.txt")
    p.add_argument("--init-from", default="")
    p.add_argument("--out", default="exp/conformer_ctc")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=1e-3)
    p.add_argument("--freeze-encoder-updates", type=int, default=2000)
    p.add_argument("--log-interval", type=int, default=100)
    return p.parse_args()


def main():
    args = get_args()
    torch.manual_seed(0)
    with open(args.vocab) as f:
        itos = ["<blank>"] + [line.rstrip("\n") for line in f]
    stoi = {c: i for i, c in enumerate(itos)}
    train_loader = DataLoader(ManifestDataset(args.train, stoi), batch_size=args.batch_size, shuffle=True,
                              num_workers=8, collate_fn=collate, drop_last=True)
    dev_loader = DataLoader(ManifestDataset(args.dev, stoi), batch_size=32, num_workers=4, collate_fn=collate)

    model = CTCModel(80, 256, 4, 12, len(itos)).cuda()
    if args.init_from:
        state = torch.load(args.init_from, map_location="cpu")
        missing, _ = model.load_state_dict(state, strict=False)
        print(f"initialised from {args.init_from}, new: {missing}")
    model.subsample.requires_grad_(False)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name or "bn" in name else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    total_updates = args.epochs * len(train_loader) // args.accum_steps
    fn = tri_stage_lambda(int(0.1 * total_updates), int(0.4 * total_updates), int(0.5 * total_updates))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
    scaler = torch.amp.GradScaler("cuda")
    spec_aug = SpecAugment()

    best_wer, update = float("inf"), 0
    for epoch in range(args.epochs):
        train_loss, update = train_one_epoch(model, train_loader, optimizer, scheduler, scaler, spec_aug,
                                             args, update)
        dev_loss, wer = evaluate(model, dev_loader, itos)
        print(f"epoch {epoch}: train {train_loss:.3f} dev {dev_loss:.3f} WER {wer * 100:.2f}")
        ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "epoch": epoch, "update": update, "wer": wer}
        torch.save(ckpt, f"{args.out}/last.pt")
        if wer < best_wer:
            best_wer = wer
            torch.save(ckpt, f"{args.out}/best.pt")
    export_for_inference(model, f"{args.out}/model_fp16.ts")


if __name__ == "__main__":
    main()
