"""Fine-tune Whisper on a speech corpus, with fp32 / fp16 / bf16 training.

Adapted from a community fine-tuning script. fp16 runs with a GradScaler, bf16 runs
with autocast only. Older releases used torch.cuda.amp.autocast; this one uses
torch.amp, with a fallback for torch < 2.3 in build_scaler().
"""
import argparse
import contextlib
import copy
import os

import torch
import torch.nn.functional as F
from transformers import WhisperForConditionalGeneration, WhisperProcessor

N_FFT = 400
HOP_LENGTH = 160
SAMPLE_RATE = 16000


def build_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(enabled=enabled)


def get_autocast(precision):
    if precision == "fp16":
        return torch.amp.autocast("cuda", dtype=torch.float16)
    if precision == "bf16":
        return torch.amp.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def log_mel_spectrogram(audio, mel_filters):
    window = torch.hann_window(N_FFT, device=audio.device)
    stft = torch.stft(audio.float(), N_FFT, HOP_LENGTH, window=window, return_complex=True)
    magnitudes = stft[..., :-1].abs() ** 2
    mel_spec = mel_filters.float() @ magnitudes
    log_spec = torch.clamp(mel_spec, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def spec_augment(feats, max_time=40, max_freq=15):
    b, f, t = feats.shape
    idx = torch.arange(t, device=feats.device)[None]
    t0 = torch.randint(0, max(1, t - max_time), (b, 1), device=feats.device)
    width = torch.randint(0, max_time, (b, 1), device=feats.device)
    feats = feats.masked_fill(((idx >= t0) & (idx < t0 + width))[:, None, :], 0.0)
    fidx = torch.arange(f, device=feats.device)[None]
    f0 = torch.randint(0, f - max_freq, (b, 1), device=feats.device)
    return feats.masked_fill(((fidx >= f0) & (fidx < f0 + max_freq))[:, :, None], 0.0)


class LabelSmoothedCrossEntropy(torch.nn.Module):
    def __init__(self, epsilon=0.1, ignore_index=-100):
        super().__init__()
        self.epsilon = epsilon
        self.ignore_index = ignore_index

    def forward(self, logits, labels):
        lprobs = F.log_softmax(logits.float(), dim=-1)
        pad = labels.eq(self.ignore_index)
        nll = -lprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        smooth = -lprobs.sum(dim=-1)
        nll = nll.masked_fill(pad, 0.0)
        smooth = smooth.masked_fill(pad, 0.0)
        n_tok = (~pad).sum().clamp(min=1)
        eps_i = self.epsilon / lprobs.size(-1)
        return ((1.0 - self.epsilon) * nll.sum() + eps_i * smooth.sum()) / n_tok


def train_one_epoch(model, loader, optimizer, scheduler, scaler, args, epoch):
    model.train()
    criterion = LabelSmoothedCrossEntropy(args.label_smoothing)
    amp_ctx = get_autocast(args.precision)
    optimizer.zero_grad(set_to_none=True)
    for step, batch in enumerate(loader):
        feats = batch["input_features"].to(args.device, non_blocking=True)
        labels = batch["labels"].to(args.device, non_blocking=True)
        dec_in = batch["decoder_input_ids"].to(args.device, non_blocking=True)
        if args.spec_augment:
            feats = spec_augment(feats)
        with amp_ctx:
            out = model(input_features=feats, decoder_input_ids=dec_in)
            loss = criterion(out.logits, labels)
        loss = loss / args.grad_accum
        scaler.scale(loss).backward()
        if (step + 1) % args.grad_accum != 0:
            continue
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0:
            print(f"epoch {epoch} step {step} loss {loss.item() * args.grad_accum:.4f} "
                  f"gnorm {grad_norm:.2f} scale {scaler.get_scale():.0f}")


def finetune_decoder_only(model, loader, args):
    """Second stage: freeze the encoder and adapt the decoder to the target domain."""
    model.model.encoder.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr * 0.1, weight_decay=0.0)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    model.train()
    for step, batch in enumerate(loader):
        feats = batch["input_features"].to(args.device)
        labels = batch["labels"].to(args.device)
        dec_in = batch["decoder_input_ids"].to(args.device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(input_features=feats, decoder_input_ids=dec_in).logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)  # expect: AMP002
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        if step >= args.stage2_steps:
            break


def word_error_rate(hyps, refs):
    errors, words = 0, 0
    for h, r in zip(hyps, refs):
        h, r = h.split(), r.split()
        d = list(range(len(r) + 1))
        for i in range(1, len(h) + 1):
            prev, d[0] = d[0], i
            for j in range(1, len(r) + 1):
                cur = min(d[j] + 1, d[j - 1] + 1, prev + (h[i - 1] != r[j - 1]))
                prev, d[j] = d[j], cur
        errors += d[len(r)]
        words += len(r)
    return errors / max(1, words)


@torch.no_grad()
def evaluate(model, loader, processor, args):
    model.eval()
    amp_ctx = get_autocast(args.precision)
    total_loss, n_batches, hyps, refs = 0.0, 0, [], []
    for batch in loader:
        feats = batch["input_features"].to(args.device)
        labels = batch["labels"].to(args.device)
        with amp_ctx:
            out = model(input_features=feats, labels=labels)
            generated = model.generate(feats, max_new_tokens=args.max_new_tokens)
        total_loss += out.loss.item()
        n_batches += 1
        hyps += processor.batch_decode(generated, skip_special_tokens=True)
        labels = labels.masked_fill(labels == -100, processor.tokenizer.pad_token_id)
        refs += processor.batch_decode(labels, skip_special_tokens=True)
    model.train()
    return total_loss / max(1, n_batches), word_error_rate(hyps, refs)


@torch.inference_mode()
def transcribe(model, processor, audio, device):
    feats = processor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    feats = feats.to(device).half()
    ids = model.generate(feats)
    return processor.batch_decode(ids, skip_special_tokens=True)[0]


def export_fp16_checkpoint(model, processor, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    model_fp16 = copy.deepcopy(model).half().eval()
    model_fp16.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="openai/whisper-small")
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="bf16")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--spec-augment", action="store_true")
    parser.add_argument("--stage2-steps", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=225)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--out", default="whisper-ft")
    args = parser.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"

    processor = WhisperProcessor.from_pretrained(args.model)
    model = WhisperForConditionalGeneration.from_pretrained(args.model).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 500))
    scaler = build_scaler(enabled=args.precision == "fp16")
    train_loader, val_loader = build_loaders(processor, args)  # noqa: F821  (project helper)

    best_wer = 1e9
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, optimizer, scheduler, scaler, args, epoch)
        val_loss, wer = evaluate(model, val_loader, processor, args)
        print(f"epoch {epoch}: val loss {val_loss:.4f} WER {wer:.3f}")
        if wer < best_wer:
            best_wer = wer
            torch.save({"model": model.state_dict(), "wer": wer}, os.path.join(args.out, "best.pt"))
    if args.stage2_steps:
        finetune_decoder_only(model, train_loader, args)
    export_fp16_checkpoint(model, processor, os.path.join(args.out, "fp16"))


if __name__ == "__main__":
    main()
