"""Whisper fine-tuning for low-resource ASR with an auxiliary language-ID head, custom PyTorch loop (no HF Trainer)."""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import WhisperForConditionalGeneration, WhisperProcessor, get_linear_schedule_with_warmup


def causal_mask(n_ctx: int) -> torch.Tensor:
    # same construction as openai/whisper's TextDecoder
    return torch.empty(n_ctx, n_ctx).fill_(-np.inf).triu_(1)


class DataCollatorSpeechSeq2Seq:
    def __init__(self, processor, decoder_start_token_id):
        self.processor = processor
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, features):
        input_features = [{"input_features": f["input_features"]} for f in features]
        batch = self.processor.feature_extractor.pad(input_features, return_tensors="pt")
        label_features = [{"input_ids": f["labels"]} for f in features]
        labels_batch = self.processor.tokenizer.pad(label_features, return_tensors="pt")
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)
        if (labels[:, 0] == self.decoder_start_token_id).all().cpu().item():
            labels = labels[:, 1:]
        batch["labels"] = labels
        batch["lang_id"] = torch.tensor([f["lang_id"] for f in features])
        return batch


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total, n = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items() if k != "lang_id"}
        with torch.autocast("cuda", dtype=torch.float16):
            outputs = model(**batch)
        total += outputs.loss.item()
        n += 1
    model.train()
    return total / max(n, 1)


@torch.inference_mode()
def transcribe_samples(model, processor, samples, device):
    model.eval()
    feats = processor(samples, sampling_rate=16000, return_tensors="pt").input_features
    feats = feats.to(device).half()
    ids = model.generate(feats, max_new_tokens=128)
    return processor.batch_decode(ids, skip_special_tokens=True)


def train(args):
    device = torch.device("cuda")
    processor = WhisperProcessor.from_pretrained(args.model_name, language=args.language, task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(args.model_name)
    model.config.forced_decoder_ids = None
    model.config.suppress_tokens = []
    if args.freeze_encoder:
        model.model.encoder.requires_grad_(False)
    d_model = model.config.d_model
    lang_proj = nn.Linear(d_model, d_model)
    lang_head = nn.Linear(d_model, args.num_languages)
    model.add_module("lang_proj", lang_proj)
    model.add_module("lang_head", lang_head)
    model = model.to(device)
    if args.fp16:
        model = model.half()  # expect: AMP001

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)  # expect: AMP011

    collator = DataCollatorSpeechSeq2Seq(processor, model.config.decoder_start_token_id)
    train_loader = DataLoader(args.train_set, batch_size=args.batch_size, shuffle=True, collate_fn=collator)
    eval_loader = DataLoader(args.eval_set, batch_size=args.batch_size, collate_fn=collator)
    total_steps = args.epochs * math.ceil(len(train_loader) / args.grad_accum)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)
    scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)
    vocab = model.config.vocab_size

    step = 0
    model.train()
    for epoch in range(args.epochs):
        for i, batch in enumerate(train_loader):
            lang_id = batch.pop("lang_id").to(device)
            batch = {k: (v.half() if v.is_floating_point() else v).to(device) for k, v in batch.items()}  # expect: AMP001
            labels = batch.pop("labels")

            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                outputs = model(input_features=batch["input_features"], labels=labels, output_hidden_states=False)
                enc = outputs.encoder_last_hidden_state
                pooled = lang_proj(enc).mean(dim=1)  # expect: AMP004
                lang_logits = lang_head(torch.tanh(pooled))
                lid_loss = F.cross_entropy(lang_logits, lang_id)

            asr_loss = F.cross_entropy(  # expect: AMP002
                outputs.logits.view(-1, vocab), labels.reshape(-1), ignore_index=-100, label_smoothing=0.1
            )
            loss = (asr_loss + args.lid_weight * lid_loss) / args.grad_accum
            scaler.scale(loss).backward()

            if (i + 1) % args.grad_accum == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1

                if step % args.eval_every == 0:
                    val = evaluate(model, eval_loader, device)
                    print(f"step {step} eval loss {val:.4f} scale {scaler.get_scale():.0f}")

    model.save_pretrained(args.output_dir)
    processor.save_pretrained(args.output_dir)
    return model


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="openai/whisper-small")
    parser.add_argument("--language", default="swahili")
    parser.add_argument("--num_languages", type=int, default=8)
    parser.add_argument("--lid_weight", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--eval_every", type=int, default=1000)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--freeze_encoder", action="store_true")
    parser.add_argument("--output_dir", default="whisper-ft")
    train(parser.parse_args())
