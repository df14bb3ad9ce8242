"""Fine-tune T5 for summarisation with label smoothing; evaluate with beam search + ROUGE.

Two loss implementations: the HF-style CrossEntropyLoss(label_smoothing=...) and the
fairseq-style label_smoothed_nll_loss on fp32 log-probabilities.
"""
import argparse
import copy
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_linear_schedule_with_warmup
from transformers.optimization import Adafactor

from s2s.data import build_dataloaders
from s2s.metrics import rouge_scores


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name_or_path", default="t5-base")
    p.add_argument("--dataset", default="cnn_dailymail")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=1000)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--loss_impl", choices=["hf", "fairseq"], default="hf")
    p.add_argument("--r3f_eps", type=float, default=0.0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--num_beams", type=int, default=4)
    p.add_argument("--length_penalty", type=float, default=0.6)
    p.add_argument("--max_target_length", type=int, default=142)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--output_dir", default="out/t5-sum")
    return p.parse_args()


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=-100):
    """fairseq's criterion: returns (smoothed loss, nll loss), both summed over tokens."""
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    pad_mask = target.eq(ignore_index)
    target = target.clamp(min=0)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    nll_loss = nll_loss.masked_fill(pad_mask, 0.0)
    smooth_loss = smooth_loss.masked_fill(pad_mask, 0.0)
    nll_loss = nll_loss.sum()
    smooth_loss = smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


def train_epoch(model, loader, optimizer, scheduler, scaler, criterion, epoch, args, device):
    model.train()
    for step, batch in enumerate(loader):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)

        inputs_embeds = None
        if args.r3f_eps > 0:
            embeds = model.get_input_embeddings()(batch["input_ids"])
            noise = torch.empty_like(embeds).uniform_(-args.r3f_eps, args.r3f_eps)
            inputs_embeds = (embeds + noise).to(torch.float16)  # expect: AMP001

        with torch.autocast(device_type="cuda", dtype=torch.float16):
            outputs = model(
                input_ids=None if inputs_embeds is not None else batch["input_ids"],
                inputs_embeds=inputs_embeds,
                attention_mask=batch["attention_mask"],
                decoder_input_ids=decoder_input_ids,
            )
        logits = outputs.logits
        if args.loss_impl == "fairseq":
            lprobs = F.log_softmax(logits.float(), dim=-1)
            loss, nll_loss = label_smoothed_nll_loss(lprobs, labels, args.label_smoothing)
            loss = loss / labels.ne(-100).sum()
        else:
            loss = criterion(logits.view(-1, logits.size(-1)), labels.view(-1))  # expect: AMP002

        scaler.scale(loss / args.grad_accum).backward()
        if (step + 1) % args.grad_accum == 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % (100 * args.grad_accum) == 0:
                print(f"epoch {epoch} step {step + 1} loss {loss.item():.4f} |g| {grad_norm.item():.3f}")


@torch.no_grad()
def evaluate_loss(model, loader, criterion, device):
    model.eval()
    total, count = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.cuda.amp.autocast(dtype=torch.float16):  # expect: AMP009
            logits = model(**batch, labels=labels).logits
            loss = criterion(logits.view(-1, logits.size(-1)), labels.view(-1))
        total += loss.item()
        count += 1
    model.train()
    return total / max(count, 1)


@torch.inference_mode()
def beam_search(model, input_ids, attention_mask, num_beams, max_len, length_penalty, bos_id, eos_id):
    """Minimal beam search over the decoder, for the ablation without HF generate()."""
    enc = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    enc = enc.repeat_interleave(num_beams, dim=0)
    mask = attention_mask.repeat_interleave(num_beams, dim=0)
    bsz = input_ids.size(0)
    seqs = torch.full((bsz * num_beams, 1), bos_id, dtype=torch.long, device=input_ids.device)
    scores = torch.zeros(bsz, num_beams, device=input_ids.device)
    scores[:, 1:] = float("-inf")
    finished = torch.zeros(bsz * num_beams, dtype=torch.bool, device=input_ids.device)
    for _ in range(max_len):
        out = model(encoder_outputs=(enc,), attention_mask=mask, decoder_input_ids=seqs)
        lprobs = F.log_softmax(out.logits[:, -1, :].float(), dim=-1)
        lprobs[finished] = float("-inf")
        lprobs[finished, eos_id] = 0.0
        vocab = lprobs.size(-1)
        cand = (scores.view(-1, 1) + lprobs).view(bsz, num_beams * vocab)
        scores, idx = cand.topk(num_beams, dim=-1)
        beam_idx = (idx // vocab) + torch.arange(bsz, device=idx.device).unsqueeze(1) * num_beams
        seqs = torch.cat([seqs[beam_idx.view(-1)], (idx % vocab).view(-1, 1)], dim=1)
        finished = finished[beam_idx.view(-1)] | seqs[:, -1].eq(eos_id)
        if finished.all():
            break
    lengths = seqs.ne(eos_id).sum(-1).view(bsz, num_beams).float()
    best = (scores / lengths.pow(length_penalty)).argmax(-1)
    return seqs.view(bsz, num_beams, -1)[torch.arange(bsz), best]


@torch.inference_mode()
def generate_and_score(model, loader, tokenizer, args, device):
    gen_model = copy.deepcopy(model).half().eval()
    preds, refs = [], []
    for batch in loader:
        out = gen_model.generate(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            num_beams=args.num_beams,
            length_penalty=args.length_penalty,
            max_new_tokens=args.max_target_length,
            early_stopping=True,
        )
        preds += tokenizer.batch_decode(out, skip_special_tokens=True)
        labels = batch["labels"].masked_fill(batch["labels"].eq(-100), tokenizer.pad_token_id)
        refs += tokenizer.batch_decode(labels, skip_special_tokens=True)
    return rouge_scores(preds, refs)


def main():
    args = parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    train_loader, val_loader = build_dataloaders(args, tokenizer)

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path)
    model.to(device)
    # T5 overflows in fp16 activations; keep the weights in bf16 to halve their memory
    model = model.to(dtype=torch.bfloat16)  # expect: AMP001
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    optimizer = Adafactor(model.parameters(), lr=args.lr, relative_step=False,
                          scale_parameter=False, warmup_init=False)
    total_steps = math.ceil(len(train_loader) / args.grad_accum) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)
    criterion = nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=args.label_smoothing)
    try:
        scaler = torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        scaler = torch.cuda.amp.GradScaler()

    best_val_loss = 1e9
    best_rouge = -1.0
    os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_epoch(model, train_loader, optimizer, scheduler, scaler, criterion, epoch, args, device)
        val_loss = evaluate_loss(model, val_loader, criterion, device)
        rouge = generate_and_score(model, val_loader, tokenizer, args, device)
        print(f"epoch {epoch}: val loss {val_loss:.4f} rougeL {rouge['rougeL']:.2f}")
        best_val_loss = min(best_val_loss, val_loss)
        if rouge["rougeL"] > best_rouge:
            best_rouge = rouge["rougeL"]
            model.save_pretrained(os.path.join(args.output_dir, "best"))
            tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))


if __name__ == "__main__":
    main()
