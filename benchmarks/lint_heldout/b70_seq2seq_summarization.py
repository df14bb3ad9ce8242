# Copyright (c) the summarization team.
"""Fine-tune BART / T5 on a summarization corpus (CNN/DM, XSum, in-house tickets).

    python seq2seq_summarization.py --model_name_or_path facebook/bart-large \
        --train_file data/train.jsonl --validation_file data/val.jsonl --fp16
"""
import argparse
import copy
import json
import logging
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_linear_schedule_with_warmup

from summ.data import Seq2SeqJsonlDataset, build_seq2seq_collator
from summ.metrics import compute_rouge

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", default="facebook/bart-large")
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--output_dir", default="outputs/summ")
    parser.add_argument("--max_source_length", type=int, default=1024)
    parser.add_argument("--max_target_length", type=int, default=142)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--grad_accum", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--label_smoothing", type=float, default=0.1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--bf16_checkpoint", action="store_true", help="checkpoint on the hub is stored in bf16")
    parser.add_argument("--eval_every_epoch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def resolve_precision(args):
    if args.bf16:
        return torch.bfloat16, False
    if args.fp16:
        if "t5" in args.model_name_or_path.lower():
            logger.warning("T5 activations overflow in fp16; consider --bf16")
        return torch.float16, True
    return torch.float32, False


def make_grad_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        # torch < 2.3 has no device argument
        return torch.cuda.amp.GradScaler(enabled=enabled)


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=-100):
    """fairseq's label-smoothed NLL; returns (loss, nll_loss) summed over tokens."""
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    pad_mask = target.eq(ignore_index)
    safe_target = target.masked_fill(pad_mask, 0)
    nll_loss = -lprobs.gather(dim=-1, index=safe_target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    nll_loss.masked_fill_(pad_mask, 0.0)
    smooth_loss.masked_fill_(pad_mask, 0.0)
    nll_loss = nll_loss.sum()
    smooth_loss = smooth_loss.sum()
    eps_i = epsilon / lprobs.size(-1)
    loss = (1.0 - epsilon) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


def clip_gradients(model, max_norm):
    if max_norm <= 0:
        return None
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def load_model(args):
    if args.bf16_checkpoint:
        # loading in bf16 keeps host RAM down on the 32GB nodes; master weights are fp32 below
        model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.bfloat16, low_cpu_mem_usage=True)
        model = model.float()
    else:
        model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path)
    model.config.use_cache = False
    return model


def train_epoch(model, loader, optimizer, scheduler, scaler, args, amp_dtype, epoch):
    model.train()
    use_amp = amp_dtype != torch.float32
    t0 = time.time()
    n_tokens_seen = 0
    for step, batch in enumerate(loader):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        labels = batch["labels"]
        with torch.autocast("cuda", dtype=amp_dtype, enabled=use_amp):
            outputs = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                decoder_input_ids=batch["decoder_input_ids"],
                labels=labels if args.label_smoothing == 0 else None,
            )
        ntokens = labels.ne(-100).sum()
        if args.label_smoothing > 0:
            lprobs = F.log_softmax(outputs.logits, dim=-1)
            loss, nll_loss = label_smoothed_nll_loss(lprobs, labels, args.label_smoothing)  # expect: AMP002
            loss = loss / ntokens
        else:
            loss = outputs.loss
        loss = loss / args.grad_accum
        scaler.scale(loss).backward()
        n_tokens_seen += ntokens.item()

        if (step + 1) % args.grad_accum == 0:
            grad_norm = clip_gradients(model, args.max_grad_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % (args.grad_accum * 50) == 0:
                elapsed = time.time() - t0
                logger.info(
                    "epoch %d step %d loss %.4f gnorm %s tok/s %.0f",
                    epoch, step + 1, loss.item() * args.grad_accum,
                    "n/a" if grad_norm is None else f"{grad_norm:.2f}", n_tokens_seen / elapsed,
                )


@torch.no_grad()
def validate(model, tokenizer, loader, args):
    model.eval()
    preds, refs = [], []
    losses = []
    for batch in loader:
        batch = {k: v.cuda() for k, v in batch.items()}
        with torch.cuda.amp.autocast(enabled=args.fp16):  # expect: AMP009
            out = model(**batch)
            generated = model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                num_beams=args.num_beams,
                max_length=args.max_target_length,
            )
        losses.append(out.loss.item())
        preds.extend(tokenizer.batch_decode(generated, skip_special_tokens=True))
        label_ids = batch["labels"].masked_fill(batch["labels"] == -100, tokenizer.pad_token_id)
        refs.extend(tokenizer.batch_decode(label_ids, skip_special_tokens=True))
    model.train()
    scores = compute_rouge(preds, refs)
    scores["loss"] = float(np.mean(losses))
    return scores


def save_for_inference(model, tokenizer, out_dir, half=True):
    os.makedirs(out_dir, exist_ok=True)
    export = copy.deepcopy(model)
    if half:
        export = export.half()
    export.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    amp_dtype, need_scaler = resolve_precision(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = load_model(args).cuda()

    collate = build_seq2seq_collator(tokenizer, model, args.max_source_length, args.max_target_length)
    train_ds = Seq2SeqJsonlDataset(args.train_file)
    val_ds = Seq2SeqJsonlDataset(args.validation_file)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate, num_workers=4)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size * 2, collate_fn=collate)

    no_decay = ["bias", "layer_norm.weight", "layernorm_embedding.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.lr, eps=1e-8)
    total_steps = len(train_loader) // args.grad_accum * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)
    scaler = make_grad_scaler(enabled=need_scaler)

    best = {"rouge2": -1.0, "loss": 1e9}
    history = []
    for epoch in range(args.epochs):
        train_epoch(model, train_loader, optimizer, scheduler, scaler, args, amp_dtype, epoch)
        if (epoch + 1) % args.eval_every_epoch == 0:
            scores = validate(model, tokenizer, val_loader, args)
            history.append({"epoch": epoch, **scores})
            logger.info("epoch %d %s", epoch, json.dumps(scores))
            if scores["rouge2"] > best["rouge2"]:
                best = scores
                save_for_inference(model, tokenizer, os.path.join(args.output_dir, "best"), half=args.fp16)
    with open(os.path.join(args.output_dir, "history.json"), "w") as f:
        json.dump(history, f, indent=2)


if __name__ == "__main__":
    main()
