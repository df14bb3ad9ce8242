"""Preference tuning: pairwise reward model + DPO against a frozen reference policy.

    python dpo_reward.py --config configs/dpo_7b.yaml [--stage rm|dpo]
"""
import argparse
import copy
import dataclasses
import logging
import os
from typing import Optional

import torch as th
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from prefs.data import PairwiseDataset, PreferenceCollator
from prefs.logging_utils import WandbLogger

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PrefConfig:
    sft_path: str
    rm_base: str
    data_path: str
    ref_path: Optional[str] = None
    output_dir: str = "runs/pref"
    beta: float = 0.1
    label_smoothing: float = 0.0
    lr: float = 5e-7
    rm_lr: float = 1e-5
    batch_size: int = 4
    grad_accum: int = 16
    epochs: int = 1
    max_grad_norm: float = 10.0
    max_len: int = 1024
    precision: str = "bf16"  # one of fp32 / fp16 / bf16
    pure_bf16: bool = False
    log_every: int = 10

    @classmethod
    def from_yaml(cls, path, **overrides):
        with open(path) as f:
            raw = yaml.safe_load(f)
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**raw)


AMP_DTYPES = {"fp32": th.float32, "fp16": th.float16, "bf16": th.bfloat16}


def get_batch_logps(logits, labels, average_log_prob=False):
    """Sum (or mean) of per-token log-probs of `labels` under `logits`; -100 marks prompt tokens."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels[~loss_mask] = 0
    per_token = th.gather(logits.float().log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    if average_log_prob:
        return (per_token * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token * loss_mask).sum(-1)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, label_smoothing=0.0):
    pi_logratios = policy_chosen - policy_rejected
    ref_logratios = ref_chosen - ref_rejected
    logits = pi_logratios - ref_logratios
    losses = (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing)
        - F.logsigmoid(-beta * logits) * label_smoothing
    )
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def pairwise_ranking_loss(chosen_rewards, rejected_rewards, margin=None):
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def concat_pairs(batch, pad_token_id):
    """Stack chosen and rejected along the batch dim so one forward covers both."""
    max_len = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])

    def pad(t, value):
        return F.pad(t, (0, max_len - t.shape[1]), value=value)

    return {
        "input_ids": th.cat([pad(batch["chosen_input_ids"], pad_token_id), pad(batch["rejected_input_ids"], pad_token_id)]),
        "attention_mask": th.cat([pad(batch["chosen_attention_mask"], 0), pad(batch["rejected_attention_mask"], 0)]),
        "labels": th.cat([pad(batch["chosen_labels"], -100), pad(batch["rejected_labels"], -100)]),
    }


class DPOTrainer:
    def __init__(self, cfg, policy, ref_model, optimizer, scaler, tokenizer, logger=None):
        self.cfg = cfg
        self.policy = policy
        self.ref_model = ref_model
        self.optimizer = optimizer
        self.scaler = scaler
        self.tokenizer = tokenizer
        self.logger = logger
        self.amp_dtype = AMP_DTYPES[cfg.precision]
        self.use_amp = cfg.precision != "fp32"
        self.global_step = 0

    def concatenated_forward(self, model, batch):
        concat = concat_pairs(batch, self.tokenizer.pad_token_id)
        logits = model(input_ids=concat["input_ids"], attention_mask=concat["attention_mask"]).logits
        logps = get_batch_logps(logits, concat["labels"])
        n = batch["chosen_input_ids"].shape[0]
        return logps[:n], logps[n:]

    @th.no_grad()
    @th.cuda.amp.autocast(dtype=th.bfloat16)  # expect: AMP009
    def reference_logps(self, batch):
        return self.concatenated_forward(self.ref_model, batch)

    def train_step(self, batch, micro_step):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        ref_chosen, ref_rejected = self.reference_logps(batch)
        with th.autocast("cuda", dtype=self.amp_dtype, enabled=self.use_amp):
            pol_chosen, pol_rejected = self.concatenated_forward(self.policy, batch)
            losses, chosen_r, rejected_r = dpo_loss(
                pol_chosen, pol_rejected, ref_chosen, ref_rejected, self.cfg.beta, self.cfg.label_smoothing
            )
            loss = losses.mean() / self.cfg.grad_accum
        self.scaler.scale(loss).backward()

        stats = {
            "loss": loss.item() * self.cfg.grad_accum,
            "reward_acc": (chosen_r > rejected_r).float().mean().item(),
            "margin": (chosen_r - rejected_r).mean().item(),
        }
        if (micro_step + 1) % self.cfg.grad_accum == 0:
            self.scaler.unscale_(self.optimizer)
            stats["grad_norm"] = th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.max_grad_norm).item()
            self.optimizer.step()  # expect: AMP006
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_step += 1
        return stats

    def fit(self, loader):
        self.policy.train()
        for epoch in range(self.cfg.epochs):
            for i, batch in enumerate(loader):
                stats = self.train_step(batch, i)
                if self.logger is not None and self.global_step % self.cfg.log_every == 0:
                    self.logger.log(stats, step=self.global_step)
            self.save(f"epoch{epoch}")

    def save(self, tag):
        path = os.path.join(self.cfg.output_dir, tag)
        self.policy.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)


def train_reward_model(cfg, tokenizer):
    rm = AutoModelForSequenceClassification.from_pretrained(cfg.rm_base, num_labels=1, torch_dtype=th.float16)  # expect: AMP001
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm.cuda()
    optimizer = th.optim.AdamW(rm.parameters(), lr=cfg.rm_lr, weight_decay=0.0)  # expect: AMP011
    scaler = th.amp.GradScaler("cuda")
    ds = PairwiseDataset(cfg.data_path, tokenizer, max_len=cfg.max_len, split="train")
    loader = DataLoader(ds, batch_size=cfg.batch_size, shuffle=True, collate_fn=PreferenceCollator(tokenizer))
    rm.train()
    for epoch in range(cfg.epochs):
        for i, batch in enumerate(loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            with th.autocast("cuda", dtype=th.float16):
                chosen = rm(input_ids=batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]).logits.squeeze(-1)
                rejected = rm(input_ids=batch["rejected_input_ids"], attention_mask=batch["rejected_attention_mask"]).logits.squeeze(-1)
            loss = pairwise_ranking_loss(chosen, rejected)  # expect: AMP002
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            th.nn.utils.clip_grad_norm_(rm.parameters(), cfg.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if i % cfg.log_every == 0:
                acc = (chosen > rejected).float().mean().item()
                log.info("rm epoch %d it %d loss %.4f acc %.3f", epoch, i, loss.item(), acc)
    acc = evaluate_reward_model(rm, tokenizer, cfg)
    log.info("rm eval accuracy %.4f", acc)
    rm.save_pretrained(os.path.join(cfg.output_dir, "reward_model"))
    return rm


@th.no_grad()
def evaluate_reward_model(rm, tokenizer, cfg):
    rm.eval()
    ds = PairwiseDataset(cfg.data_path, tokenizer, max_len=cfg.max_len, split="test")
    loader = DataLoader(ds, batch_size=cfg.batch_size * 4, collate_fn=PreferenceCollator(tokenizer))
    correct, total = 0, 0
    for batch in loader:
        batch = {k: v.cuda() for k, v in batch.items()}
        with th.autocast("cuda", dtype=th.float16):
            chosen = rm(input_ids=batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]).logits
            rejected = rm(input_ids=batch["rejected_input_ids"], attention_mask=batch["rejected_attention_mask"]).logits
        correct += (chosen.float() > rejected.float()).sum().item()
        total += chosen.shape[0]
    rm.train()
    return correct / max(total, 1)


def train_dpo(cfg, tokenizer):
    policy_dtype = th.bfloat16 if cfg.pure_bf16 else th.float32
    policy = AutoModelForCausalLM.from_pretrained(cfg.sft_path, torch_dtype=policy_dtype)
    if cfg.ref_path is not None:
        ref_model = AutoModelForCausalLM.from_pretrained(cfg.ref_path, torch_dtype=th.bfloat16)
    else:
        ref_model = copy.deepcopy(policy).to(th.bfloat16)
    ref_model.eval()
    ref_model.requires_grad_(False)
    policy.gradient_checkpointing_enable()
    policy.cuda()
    ref_model.cuda()

    optimizer = th.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    scaler = th.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")
    ds = PairwiseDataset(cfg.data_path, tokenizer, max_len=cfg.max_len, split="train", with_labels=True)
    loader = DataLoader(ds, batch_size=cfg.batch_size, shuffle=True, collate_fn=PreferenceCollator(tokenizer))
    trainer = DPOTrainer(cfg, policy, ref_model, optimizer, scaler, tokenizer, logger=WandbLogger(project="dpo"))
    trainer.fit(loader)
    trainer.save("final")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--stage", choices=["rm", "dpo"], default="dpo")
    ap.add_argument("--precision", choices=list(AMP_DTYPES), default=None)
    args = ap.parse_args()
    cfg = PrefConfig.from_yaml(args.config, precision=args.precision)
    logging.basicConfig(level=logging.INFO)
    tokenizer = AutoTokenizer.from_pretrained(cfg.sft_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    os.makedirs(cfg.output_dir, exist_ok=True)
    if args.stage == "rm":
        train_reward_model(cfg, tokenizer)
    else:
        train_dpo(cfg, tokenizer)


if __name__ == "__main__":
    main()
