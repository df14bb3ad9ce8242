"""Fine-tune a Whisper-style encoder-decoder on a speech corpus.

The model code mirrors openai/whisper: LayerNorm computed in fp32, Linear/Conv1d layers
that follow the input dtype, attention logits upcast before the softmax, and a causal
mask filled with -inf. Training uses fp16 autocast with a GradScaler; decoding runs a
half-precision copy under ``torch.inference_mode``, and the export is an fp16 checkpoint.
"""
import argparse
import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

SAMPLE_RATE, N_FFT, HOP_LENGTH, N_MELS = 16000, 400, 160, 80
SOT, EOT, NO_SPEECH, TIMESTAMP_BEGIN = 50258, 50257, 50362, 50364


def log_mel_spectrogram(audio: Tensor, filters: Tensor) -> Tensor:
    window = torch.hann_window(N_FFT, device=audio.device)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    magnitudes = stft[..., :-1].abs() ** 2
    mel_spec = filters @ magnitudes
    log_spec = torch.clamp(mel_spec, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def normalize_waveform(audio: np.ndarray) -> np.ndarray:
    audio = audio.astype(np.float32)
    return audio / (np.abs(audio).max() + 1e-8)


def spec_augment(features: Tensor, n_freq_masks=2, freq_width=27, n_time_masks=2, time_width=100) -> Tensor:
    features = features.clone()
    fill = features.mean()
    for _ in range(n_freq_masks):
        f0 = np.random.randint(0, features.shape[-2] - freq_width)
        features[..., f0 : f0 + np.random.randint(0, freq_width), :] = fill
    for _ in range(n_time_masks):
        t0 = np.random.randint(0, features.shape[-1] - time_width)
        features[..., t0 : t0 + np.random.randint(0, time_width)] = fill
    return features


class LayerNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.float()).type(x.dtype)


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def sinusoids(length, channels, max_timescale=10000):
    log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, np.newaxis] * inv_timescales[np.newaxis, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)

    def forward(self, x, xa=None, mask=None, key_padding_mask=None):
        q = self.query(x)
        k = self.key(x if xa is None else xa)
        v = self.value(x if xa is None else xa)
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3) * scale
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 3, 1) * scale
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = q @ k
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        if key_padding_mask is not None:
            qk = qk.masked_fill(key_padding_mask[:, None, None, :], -1e4)
        w = F.softmax(qk.float(), dim=-1).to(q.dtype)
        return self.out((w @ v).permute(0, 2, 1, 3).flatten(start_dim=2))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, cross_attention: bool = False):
        super().__init__()
        self.attn, self.attn_ln = MultiHeadAttention(n_state, n_head), LayerNorm(n_state)
        self.cross_attn = MultiHeadAttention(n_state, n_head) if cross_attention else None
        self.cross_attn_ln = LayerNorm(n_state) if cross_attention else None
        self.mlp = nn.Sequential(Linear(n_state, n_state * 4), nn.GELU(), Linear(n_state * 4, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x, xa=None, mask=None, audio_padding_mask=None):
        x = x + self.attn(self.attn_ln(x), mask=mask)
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.cross_attn_ln(x), xa, key_padding_mask=audio_padding_mask)
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self, n_mels, n_ctx, n_state, n_head, n_layer):
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, n_state, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(n_state, n_state, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(n_ctx, n_state))
        self.blocks = nn.ModuleList([ResidualAttentionBlock(n_state, n_head) for _ in range(n_layer)])
        self.ln_post = LayerNorm(n_state)

    def forward(self, x: Tensor) -> Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).permute(0, 2, 1)
        x = (x + self.positional_embedding[: x.shape[1]]).to(x.dtype)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)


class TextDecoder(nn.Module):
    def __init__(self, n_vocab, n_ctx, n_state, n_head, n_layer):
        super().__init__()
        self.token_embedding = nn.Embedding(n_vocab, n_state)
        self.positional_embedding = nn.Parameter(torch.empty(n_ctx, n_state))
        self.blocks = nn.ModuleList([ResidualAttentionBlock(n_state, n_head, cross_attention=True) for _ in range(n_layer)])
        self.ln = LayerNorm(n_state)
        mask = torch.empty(n_ctx, n_ctx).fill_(-np.inf).triu_(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: Tensor, xa: Tensor, audio_padding_mask=None) -> Tensor:
        x = self.token_embedding(tokens) + self.positional_embedding[: tokens.shape[-1]]
        x = x.to(xa.dtype)
        for block in self.blocks:
            x = block(x, xa, mask=self.mask, audio_padding_mask=audio_padding_mask)
        x = self.ln(x)
        return (x @ torch.transpose(self.token_embedding.weight.to(x.dtype), 0, 1)).float()


class Whisper(nn.Module):
    def __init__(self, n_vocab=51865, n_audio_ctx=1500, n_text_ctx=448, n_state=768, n_head=12, n_layer=12):
        super().__init__()
        self.encoder = AudioEncoder(N_MELS, n_audio_ctx, n_state, n_head, n_layer)
        self.decoder = TextDecoder(n_vocab, n_text_ctx, n_state, n_head, n_layer)

    def forward(self, mel, tokens, labels=None, audio_padding_mask=None):
        logits = self.decoder(tokens, self.encoder(mel), audio_padding_mask)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return out


@torch.inference_mode()
def greedy_decode(model, mel, max_len=224):
    audio_features = model.encoder(mel)
    tokens = torch.full((mel.shape[0], 1), SOT, dtype=torch.long, device=mel.device)
    sum_logprobs = torch.zeros(mel.shape[0], device=mel.device)
    for _ in range(max_len):
        logits = model.decoder(tokens, audio_features)[:, -1].float()
        logits[:, TIMESTAMP_BEGIN:] = -1e9
        logits[:, NO_SPEECH] = -np.inf
        logprobs = F.log_softmax(logits, dim=-1)
        next_tokens = logits.argmax(dim=-1)
        sum_logprobs += logprobs.gather(1, next_tokens[:, None]).squeeze(1)
        tokens = torch.cat([tokens, next_tokens[:, None]], dim=-1)
        if (next_tokens == EOT).all():
            break
    return tokens, sum_logprobs / tokens.shape[1]


@torch.inference_mode()
def evaluate(model, loader, decode_fn):
    fp16_model = copy.deepcopy(model).half().eval()
    errors, words = 0, 0
    for batch in loader:
        tokens, _ = greedy_decode(fp16_model, batch["input_features"].cuda().half())
        for hyp, ref in zip(decode_fn(tokens), batch["text"]):
            errors += edit_distance(hyp.split(), ref.split())
            words += max(1, len(ref.split()))
    return errors / words


def edit_distance(a, b):
    d = np.arange(len(b) + 1)
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
    return int(d[len(b)])


def export_fp16(model, path):
    torch.save({"dims": {"n_state": 768}, "model_state_dict": model.half().state_dict()}, path)


def warmup_adapters(model, loader, optimizer, scaler, steps):
    """Short warm-up of the freshly added decoder layers before the main fine-tune."""
    model.train()
    for step, batch in zip(range(steps), loader):
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            out = model(batch["input_features"].cuda(), batch["decoder_input_ids"].cuda(), labels=batch["labels"].cuda())
        loss = out["loss"]
        loss = scaler.scale(loss)
        loss.backward()
        optimizer.step()  # expect: AMP006
        optimizer.zero_grad(set_to_none=True)


def train(args, model, train_loader, eval_loader, decode_fn):
    if args.freeze_encoder:
        model.encoder.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, eps=1e-8)
    total = args.epochs * len(train_loader) // args.grad_accum
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / 500) * max(0.0, 1 - s / total))
    scaler = torch.amp.GradScaler("cuda")
    if args.adapter_warmup_steps:
        warmup_adapters(model, train_loader, optimizer, scaler, args.adapter_warmup_steps)

    best_wer = 1e9
    model.train()
    for epoch in range(args.epochs):
        for step, batch in enumerate(train_loader):
            mel = batch["input_features"].cuda(non_blocking=True)
            if args.spec_augment:
                mel = spec_augment(mel)
            tokens, labels = batch["decoder_input_ids"].cuda(), batch["labels"].cuda()
            is_silence = batch["is_silence"].cuda().float()
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                out = model(mel, tokens, labels=labels, audio_padding_mask=batch.get("audio_padding_mask"))
                loss = out["loss"]
                if args.vad_weight > 0:
                    no_speech_prob = torch.sigmoid(out["logits"][:, 0, NO_SPEECH])
                    loss = loss + args.vad_weight * F.binary_cross_entropy(no_speech_prob, is_silence)  # expect: AMP003
                loss = loss / args.grad_accum
            scaler.scale(loss).backward()
            if (step + 1) % args.grad_accum == 0:
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                if not math.isfinite(grad_norm.item()):
                    print(f"step {step}: overflow, loss scale now {scaler.get_scale()}")
        wer = evaluate(model, eval_loader, decode_fn)
        if wer < best_wer:
            best_wer = wer
            torch.save({k: v.half() for k, v in model.state_dict().items()}, f"{args.output_dir}/best.pt")
        print(f"epoch {epoch}: WER {wer:.3%} (best {best_wer:.3%})")
    export_fp16(model, f"{args.output_dir}/whisper-ft-fp16.pt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="whisper-ft")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--vad_weight", type=float, default=0.1)
    parser.add_argument("--adapter_warmup_steps", type=int, default=0)
    parser.add_argument("--freeze_encoder", action="store_true")
    parser.add_argument("--spec_augment", action="store_true")
    train(parser.parse_args(), Whisper().cuda(), train_loader=[], eval_loader=[], decode_fn=lambda t: [])
