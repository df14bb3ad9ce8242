"""RLHF toolkit: pairwise reward-model training and DPO fine-tuning of a causal LM, hand-written loops with fp16 AMP."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM, get_cosine_schedule_with_warmup

HALF = torch.float16


class RewardModel(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base
        self.v_head = nn.Linear(base.config.hidden_size, 1, bias=False)

    def last_hidden(self, input_ids, attention_mask):
        h = self.base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(dim=1) - 1
        return h[torch.arange(h.size(0), device=h.device), last]


def train_reward_model(cfg, loader):
    rm = RewardModel(AutoModel.from_pretrained(cfg.base_path)).cuda()
    optimizer = torch.optim.AdamW(rm.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup, cfg.total_steps)
    scaler = torch.amp.GradScaler("cuda")
    rm.train()
    for step, batch in enumerate(loader):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            h_c = rm.last_hidden(batch["chosen_ids"], batch["chosen_mask"])
            h_r = rm.last_hidden(batch["rejected_ids"], batch["rejected_mask"])
            r_c = rm.v_head(h_c).squeeze(-1)
            r_r = rm.v_head(h_r).squeeze(-1)
        loss = -F.logsigmoid(r_c - r_r).mean()  # expect: AMP004
        acc = (r_c > r_r).float().mean()

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(rm.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.step()  # expect: AMP006
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"rm step {step} loss {loss.item():.4f} acc {acc.item():.3f}")
    return rm


def get_batch_logps(logits, labels, average_log_prob=False):
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels[labels == -100] = 0
    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    if average_log_prob:
        return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token_logps * loss_mask).sum(-1)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1, label_smoothing=0.0):
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


@torch.no_grad()
def reference_logps(reference, batch):
    logits = reference(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return get_batch_logps(logits, batch["labels"]).chunk(2)


def train_dpo(cfg, loader):
    policy = AutoModelForCausalLM.from_pretrained(cfg.sft_path)
    reference = AutoModelForCausalLM.from_pretrained(cfg.sft_path)
    reference.requires_grad_(False)
    reference = reference.eval().to("cuda", dtype=HALF)
    policy = policy.to("cuda", HALF)  # expect: AMP001
    policy.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, eps=1e-8)  # expect: AMP011
    scaler = torch.amp.GradScaler("cuda")

    policy.train()
    for step, batch in enumerate(loader):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            all_logits = policy(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            pc, pr = get_batch_logps(all_logits, batch["labels"]).chunk(2)
            rc, rr = reference_logps(reference, batch)
            losses, chosen_r, rejected_r = dpo_loss(pc, pr, rc, rr, cfg.beta, cfg.label_smoothing)
            loss = losses.mean() / cfg.accum
            torch.autograd.backward(scaler.scale(loss))  # expect: AMP008

        if (step + 1) % cfg.accum == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0:
            margin = (chosen_r - rejected_r).mean().item()
            print(f"dpo step {step} loss {loss.item() * cfg.accum:.4f} reward margin {margin:.3f}")
    return policy
