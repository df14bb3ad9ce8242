"""Reward-model training for RLHF on pairwise preference data (Anthropic-HH style).

A100/H100 runs use bf16 autocast without loss scaling; the V100 path uses fp16 with a
GradScaler. Reward statistics for PPO normalisation are computed in fp32.
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModel


class RewardModel(nn.Module):
    def __init__(self, name, pooling="last"):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name)
        self.v_head = nn.Linear(self.backbone.config.hidden_size, 1, bias=False)
        self.pooling = pooling

    def forward(self, input_ids, attention_mask):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        values = self.v_head(hidden).squeeze(-1)
        if self.pooling == "max":
            values = values.masked_fill(attention_mask == 0, -1e9)  # expect: AMP007
            return values.amax(dim=1)
        last = attention_mask.sum(dim=1).long() - 1
        return values.gather(1, last[:, None]).squeeze(1)


def pairwise_loss(r_chosen, r_rejected, margin=None):
    diff = r_chosen.float() - r_rejected.float()
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def stack_pair(batch):
    ids = torch.cat([batch["chosen_ids"], batch["rejected_ids"]]).cuda(non_blocking=True)
    mask = torch.cat([batch["chosen_mask"], batch["rejected_mask"]]).cuda(non_blocking=True)
    return ids, mask


def train_reward_model(model, loader, args):
    """A100/H100 path: bf16 autocast, no loss scaling."""
    if args.pure_bf16:
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    for step, batch in enumerate(loader):
        ids, mask = stack_pair(batch)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            rewards = model(ids, mask)
            r_chosen, r_rejected = rewards.chunk(2)
            if args.loss == "bce":
                diff = (r_chosen - r_rejected).float()
                loss = F.binary_cross_entropy_with_logits(diff, torch.ones_like(diff))
            else:
                loss = pairwise_loss(r_chosen, r_rejected, batch.get("margin"))
            if args.center_coef > 0:
                loss = loss + args.center_coef * rewards.mean() ** 2  # expect: AMP004
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            acc = (r_chosen > r_rejected).float().mean().item()
            margin = (r_chosen.float() - r_rejected.float()).mean().item()
        if step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f} acc {acc:.3f} margin {margin:.3f}")
    return model


def train_reward_model_fp16(model, loader, args):
    """V100 path: fp16 autocast with dynamic loss scaling."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda")
    model.train()
    skipped = 0
    for step, batch in enumerate(loader):
        ids, mask = stack_pair(batch)
        with torch.autocast("cuda", dtype=torch.float16):
            r_chosen, r_rejected = model(ids, mask).chunk(2)
            p_chosen = torch.sigmoid(r_chosen - r_rejected)
            nll = -torch.log(p_chosen + 1e-8)  # expect: AMP011
            loss = nll.float().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if torch.isfinite(grad_norm):
            scaler.step(optimizer)  # expect: AMP006
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f} gnorm {grad_norm:.2f} skipped {skipped}")
    return model


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    correct = total = 0
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            r_c = model(batch["chosen_ids"].cuda(), batch["chosen_mask"].cuda())
            r_r = model(batch["rejected_ids"].cuda(), batch["rejected_mask"].cuda())
        correct += (r_c > r_r).sum().item()
        total += r_c.numel()
    model.train()
    return correct / max(1, total)


@torch.inference_mode()
def reward_statistics(model, loader):
    """Mean/std of rewards on a reference set, used to normalise rewards during PPO."""
    model.eval()
    rewards = []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            rewards.append(model(batch["ids"].cuda(), batch["mask"].cuda()).float())
    rewards = torch.cat(rewards)
    return rewards.mean().item(), rewards.std().item()


def normalise_rewards(r, mean, std):
    return (r - mean) / (std + torch.finfo(r.dtype).eps)


def export_for_ppo(model, out_dir, mean, std):
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.half() for k, v in model.state_dict().items()}
    torch.save({"model": state, "reward_mean": mean, "reward_std": std}, os.path.join(out_dir, "rm_fp16.pt"))


@torch.inference_mode()
def score_responses(model, tokenizer, prompts, responses, device="cuda"):
    serve_model = model.half().eval()
    enc = tokenizer([p + r for p, r in zip(prompts, responses)], return_tensors="pt", padding=True).to(device)
    return serve_model(enc["input_ids"], enc["attention_mask"]).float().tolist()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="EleutherAI/pythia-1.4b")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--pure-bf16", action="store_true")
    parser.add_argument("--pooling", choices=["last", "max"], default="last")
    parser.add_argument("--loss", choices=["bt", "bce"], default="bt")
    parser.add_argument("--lr", type=float, default=9e-6)
    parser.add_argument("--center-coef", type=float, default=0.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--out", default="rm-out")
    args = parser.parse_args()

    model = RewardModel(args.model, pooling=args.pooling).cuda()
    train_loader, val_loader, ref_loader = build_preference_loaders(args)  # noqa: F821  (project helper)
    best_acc = float("-inf")
    for epoch in range(2):
        if args.dtype == "bf16":
            model = train_reward_model(model, train_loader, args)
        else:
            model = train_reward_model_fp16(model, train_loader, args)
        acc = evaluate(model, val_loader)
        print(f"epoch {epoch}: preference accuracy {acc:.3f}")
        best_acc = max(best_acc, acc)
    mean, std = reward_statistics(model, ref_loader)
    export_for_ppo(model, args.out, mean, std)


if __name__ == "__main__":
    main()
