"""Logit + hidden-state distillation of a 70B fp16 teacher into a ~1B student.

The teacher is sharded over the node with device_map="auto" and never trained; the student
trains on cuda:0 with autocast. Teacher vocab may be larger than the student's (extra
special tokens), so teacher logits are truncated to the student vocab.
"""
import argparse
import copy
import itertools
import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.utils import is_torch_npu_available

from distill.data import TokenizedShards, pad_collate

logger = logging.getLogger("distill")


def load_teacher(name):
    teacher = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.float16, device_map="auto")
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


class HiddenProjector(nn.Module):
    def __init__(self, d_student, d_teacher):
        super().__init__()
        self.proj = nn.Linear(d_student, d_teacher, bias=False)
        nn.init.normal_(self.proj.weight, std=d_student ** -0.5)

    def forward(self, h):
        return self.proj(h)


class Distiller:
    def __init__(self, student, teacher, projector, optimizer, lr_scheduler, scaler, args):
        self.student = student
        self.teacher = teacher
        self.projector = projector
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.temperature = args.temperature
        self.alpha_kd = args.alpha_kd
        self.alpha_hidden = args.alpha_hidden
        self.grad_accum = args.grad_accum
        self.max_grad_norm = args.max_grad_norm
        self.use_amp = args.fp16
        self.device = torch.device("cuda:0")
        self.step = 0

    @torch.no_grad()
    def teacher_forward(self, batch):
        out = self.teacher(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=self.alpha_hidden > 0,
        )
        logits = out.logits.float().to(self.device)
        hidden = out.hidden_states[-1].float().to(self.device) if self.alpha_hidden > 0 else None
        return logits, hidden

    def train_step(self, batch):
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        t_logits, t_hidden = self.teacher_forward(batch)
        mask = batch["attention_mask"].float()
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.use_amp):
            s_out = self.student(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                labels=batch["labels"],
                output_hidden_states=self.alpha_hidden > 0,
            )
            s_logits = s_out.logits
            hidden_loss = torch.zeros((), device=self.device)
            if t_hidden is not None:
                s_hidden = self.projector(s_out.hidden_states[-1])
                hidden_loss = F.mse_loss(s_hidden, t_hidden.to(s_hidden.dtype))
        ce_loss = s_out.loss
        T = self.temperature
        t_logits = t_logits[..., : s_logits.size(-1)]
        s_logp = F.log_softmax(s_logits / T, dim=-1)
        t_prob = F.softmax(t_logits / T, dim=-1)
        kd = F.kl_div(s_logp, t_prob, reduction="none").sum(-1)  # expect: AMP002
        kd_loss = (kd * mask).sum() / mask.sum().clamp(min=1.0) * (T ** 2)
        loss = self.alpha_kd * kd_loss + (1.0 - self.alpha_kd) * ce_loss + self.alpha_hidden * hidden_loss
        self.scaler.scale(loss / self.grad_accum).backward()
        return {"loss": loss.item(), "ce": ce_loss.item(), "kd": kd_loss.item(), "hidden": hidden_loss.item()}

    def optimizer_step(self):
        self.scaler.unscale_(self.optimizer)
        params = itertools.chain(self.student.parameters(), self.projector.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.scaler.step(self.optimizer)  # expect: AMP006
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return grad_norm

    def fit(self, loader, max_steps, log_every=10, eval_fn=None, eval_every=1000):
        self.student.train()
        t0 = time.time()
        micro = 0
        for batch in itertools.cycle(loader):
            stats = self.train_step(batch)
            micro += 1
            if micro % self.grad_accum != 0:
                continue
            grad_norm = self.optimizer_step()
            if self.step % log_every == 0:
                logger.info("step %d %s gnorm %.3f %.1fs", self.step,
                            " ".join(f"{k}={v:.4f}" for k, v in stats.items()), grad_norm, time.time() - t0)
                t0 = time.time()
            if eval_fn is not None and self.step % eval_every == 0:
                eval_fn(self.student)
                self.student.train()
            if self.step >= max_steps:
                break


@torch.no_grad()
def evaluate_student(student, loader, device, max_batches=100):
    student.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            out = student(**batch)
        total += out.loss.float().item()
        count += 1
    ppl = torch.exp(torch.tensor(total / max(count, 1))).item()
    logger.info("eval ppl %.3f", ppl)
    return ppl


@torch.no_grad()
def init_student_embeddings(student, teacher):
    """Copy the first d_student dims of the teacher's embeddings (works better than random init)."""
    s_emb = student.get_input_embeddings().weight
    t_emb = teacher.get_input_embeddings().weight
    rows = min(s_emb.size(0), t_emb.size(0))
    s_emb[:rows].copy_(t_emb[:rows, : s_emb.size(1)].float().to(s_emb.device))


def save_student(student, tokenizer, out_dir, fp16=False):
    os.makedirs(out_dir, exist_ok=True)
    to_save = copy.deepcopy(student).half() if fp16 else student
    to_save.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--teacher", required=True)
    p.add_argument("--student", required=True)
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", default="distill_out")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max_steps", type=int, default=20000)
    p.add_argument("--warmup_steps", type=int, default=500)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha_kd", type=float, default=0.9)
    p.add_argument("--alpha_hidden", type=float, default=0.0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--fp16", action="store_true", help="fp16 mixed precision for the student")
    p.add_argument("--init_from_teacher", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda:0")
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    teacher = load_teacher(args.teacher)
    student = AutoModelForCausalLM.from_pretrained(args.student, torch_dtype=torch.float32).to(device)
    if args.init_from_teacher:
        init_student_embeddings(student, teacher)
    if args.fp16:
        # the 1B student plus optimizer state does not fit next to the teacher shards otherwise
        student = student.half()  # expect: AMP001
    projector = HiddenProjector(student.config.hidden_size, teacher.config.hidden_size).to(device)

    params = [
        {"params": [p for n, p in student.named_parameters() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for n, p in student.named_parameters() if p.ndim < 2], "weight_decay": 0.0},
        {"params": projector.parameters(), "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-6)
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    if is_torch_npu_available():
        scaler = torch.npu.amp.GradScaler(enabled=args.fp16)
    else:
        scaler = torch.amp.GradScaler("cuda", enabled=args.fp16)

    train_loader = DataLoader(TokenizedShards(args.data_dir, split="train"), batch_size=args.batch_size,
                              collate_fn=pad_collate(tokenizer.pad_token_id), num_workers=4)
    val_loader = DataLoader(TokenizedShards(args.data_dir, split="val"), batch_size=args.batch_size,
                            collate_fn=pad_collate(tokenizer.pad_token_id))
    distiller = Distiller(student, teacher, projector, optimizer, lr_scheduler, scaler, args)
    distiller.fit(train_loader, args.max_steps,
                  eval_fn=lambda m: evaluate_student(m, val_loader, device))
    save_student(student, tokenizer, os.path.join(args.output_dir, "final"), fp16=args.fp16)


if __name__ == "__main__":
    main()
