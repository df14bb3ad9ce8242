"""RLHF in one file: Bradley-Terry reward model, then PPO with a KL penalty to the SFT policy.

Follows the "N implementation details of RLHF with PPO" recipe: per-token KL reward, GAE,
whitened advantages, clipped value loss, several PPO epochs over each rollout batch.
"""
import copy
import os
import time
from functools import partial

import torch as th
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

CFG = {
    "policy_model": "EleutherAI/pythia-1b-deduped",  # SFT checkpoint
    "reward_model": "EleutherAI/pythia-410m-deduped",
    "device": "cuda",
    "fp16": True,
    "train_rm": True,
    "rm_lr": 1e-5, "rm_epochs": 1,
    "lr": 3e-6, "max_grad_norm": 1.0,
    "ppo_epochs": 4, "mini_batch_size": 8, "rollout_batch_size": 64,
    "max_new_tokens": 53, "temperature": 0.7,
    "kl_coef": 0.05, "gamma": 1.0, "lam": 0.95,
    "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1,
    "vf_warmup_steps": 20, "vf_warmup_lr": 1e-5,
    "gradient_checkpointing": True, "save_every": 50, "out_dir": "rlhf_out",
}


class PolicyWithValueHead(nn.Module):
    def __init__(self, base_model, true_vocab_size):
        super().__init__()
        self.base = base_model
        hidden = base_model.config.hidden_size
        self.v_head = nn.Sequential(nn.Dropout(0.1), nn.Linear(hidden, 1))
        padded = base_model.get_output_embeddings().weight.shape[0]
        # the output matrix is padded to a multiple of 128: those ids are not tokens
        self.register_buffer("vocab_pad_mask", th.arange(padded) >= true_vocab_size, persistent=False)

    def forward(self, input_ids, attention_mask):
        out = self.base(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        logits = out.logits.masked_fill(self.vocab_pad_mask, -1e9)  # expect: AMP007
        values = self.v_head(out.hidden_states[-1]).squeeze(-1)
        return logits, values


class RewardModel(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.score = nn.Linear(backbone.config.hidden_size, 1, bias=False)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(dim=1) - 1
        return self.score(h[th.arange(h.size(0), device=h.device), last]).squeeze(-1)


def build_reward_model(cfg):
    rm = RewardModel(AutoModel.from_pretrained(cfg["reward_model"]))
    # scoring 64 x 512 tokens per rollout: bf16 halves the memory next to the policy
    return rm.to(cfg["device"], dtype=th.bfloat16)  # expect: AMP001


def logprobs_from_logits(logits, labels):
    logp = F.log_softmax(logits, dim=-1)
    return th.gather(logp, 2, labels.unsqueeze(-1)).squeeze(-1)


def masked_mean(x, mask, dim=None):
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, shift_mean=True):
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * th.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def ppo_policy_loss(logits, responses, old_logprobs, advantages, mask, cliprange):
    new_logprobs = logprobs_from_logits(logits, responses)
    ratio = th.exp(new_logprobs - old_logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * th.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(th.max(pg_losses, pg_losses2), mask)
    approx_kl = 0.5 * masked_mean((new_logprobs - old_logprobs) ** 2, mask)
    return pg_loss, approx_kl


def train_reward_model(cfg, pairs_loader):
    rm = build_reward_model(cfg)
    rm.train()
    optimizer = th.optim.AdamW(rm.parameters(), lr=cfg["rm_lr"], weight_decay=0.0)
    scaler = th.amp.GradScaler("cuda")  # expect: AMP010
    for epoch in range(cfg["rm_epochs"]):
        for step, batch in enumerate(pairs_loader):
            batch = {k: v.to(cfg["device"]) for k, v in batch.items()}
            with th.autocast("cuda", dtype=th.bfloat16):
                r_chosen = rm(batch["chosen_ids"], batch["chosen_mask"])
                r_rejected = rm(batch["rejected_ids"], batch["rejected_mask"])
                # Bradley-Terry: P(chosen preferred) = sigmoid(r_c - r_r), target is always 1
                p_chosen = th.sigmoid(r_chosen - r_rejected)
                loss = F.binary_cross_entropy(p_chosen, th.ones_like(p_chosen))  # expect: AMP003
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            th.nn.utils.clip_grad_norm_(rm.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            if step % 50 == 0:
                acc = (r_chosen > r_rejected).float().mean().item()
                print(f"rm epoch {epoch} step {step} loss {loss.item():.4f} acc {acc:.3f}")
    th.save(rm.state_dict(), os.path.join(cfg["out_dir"], "reward_model.pt"))


class PPOTrainer:
    def __init__(self, policy, ref_policy, reward_model, tokenizer, cfg):
        self.policy = policy
        self.ref_policy = ref_policy
        self.reward_model = reward_model
        self.tok = tokenizer
        self.cfg = cfg
        self.device = cfg["device"]
        self.optimizer = th.optim.AdamW(policy.parameters(), lr=cfg["lr"], eps=1e-5)
        self.scaler = th.amp.GradScaler("cuda", enabled=cfg["fp16"])
        self.amp_ctx = partial(th.autocast, device_type="cuda", dtype=th.float16, enabled=cfg["fp16"])

    @th.no_grad()
    def rollout(self, prompts):
        self.policy.eval()
        query = self.tok(prompts, return_tensors="pt", padding=True).to(self.device)
        ctx_len = query["input_ids"].shape[1]
        with self.amp_ctx():
            seq = self.policy.base.generate(**query, max_new_tokens=self.cfg["max_new_tokens"], do_sample=True,
                                            temperature=self.cfg["temperature"], top_k=0, top_p=1.0,
                                            pad_token_id=self.tok.pad_token_id)
            attn = (seq != self.tok.pad_token_id).long()
            logits, values = self.policy(seq, attn)
            ref_logits, _ = self.ref_policy(seq, attn)
            scores = self.reward_model(seq, attn)
        responses = seq[:, ctx_len:]
        logprobs = logprobs_from_logits(logits[:, ctx_len - 1:-1].float() / self.cfg["temperature"], responses)
        ref_logprobs = logprobs_from_logits(ref_logits[:, ctx_len - 1:-1].float() / self.cfg["temperature"], responses)
        values = values[:, ctx_len - 1:-1].float()
        mask = attn[:, ctx_len:].float()
        rewards = -self.cfg["kl_coef"] * (logprobs - ref_logprobs) * mask
        last = mask.sum(1).long() - 1
        rewards[th.arange(rewards.size(0), device=rewards.device), last] += scores.float()
        advantages, returns = self.compute_gae(values, rewards, mask)
        return {"seq": seq, "attn": attn, "responses": responses, "ctx_len": ctx_len, "logprobs": logprobs,
                "values": values, "advantages": advantages, "returns": returns, "mask": mask, "scores": scores.float()}

    def compute_gae(self, values, rewards, mask):
        lastgaelam, adv_rev = 0, []
        T = rewards.shape[1]
        for t in reversed(range(T)):
            nextvalues = values[:, t + 1] if t < T - 1 else 0.0
            delta = rewards[:, t] + self.cfg["gamma"] * nextvalues - values[:, t]
            lastgaelam = delta + self.cfg["gamma"] * self.cfg["lam"] * lastgaelam
            adv_rev.append(lastgaelam)
        advantages = th.stack(adv_rev[::-1], dim=1)
        returns = advantages + values
        return masked_whiten(advantages, mask).detach(), returns.detach()

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def optimizer_step(self):
        th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg["max_grad_norm"])  # expect: AMP005
        self.optimizer.step()  # expect: AMP006
        self.optimizer.zero_grad(set_to_none=True)

    def update(self, batch):
        self.policy.train()
        cfg, n, ctx_len = self.cfg, batch["seq"].shape[0], batch["ctx_len"]
        stats = []
        for _ in range(cfg["ppo_epochs"]):
            perm = th.randperm(n, device=self.device)
            for start in range(0, n, cfg["mini_batch_size"]):
                idx = perm[start:start + cfg["mini_batch_size"]]
                mask, old_values, returns = batch["mask"][idx], batch["values"][idx], batch["returns"][idx]
                with self.amp_ctx():
                    logits, vpred = self.policy(batch["seq"][idx], batch["attn"][idx])
                    vpred = vpred[:, ctx_len - 1:-1]
                    vpredclipped = old_values + th.clamp(vpred - old_values, -cfg["cliprange_value"], cfg["cliprange_value"])
                    vf_losses1 = (vpred - returns) ** 2
                    vf_losses2 = (vpredclipped - returns) ** 2
                    vf_loss = 0.5 * masked_mean(th.max(vf_losses1, vf_losses2), mask)
                logits = logits[:, ctx_len - 1:-1] / cfg["temperature"]
                pg_loss, approx_kl = ppo_policy_loss(logits, batch["responses"][idx], batch["logprobs"][idx], batch["advantages"][idx], mask, cfg["cliprange"])  # expect: AMP002
                loss = pg_loss + cfg["vf_coef"] * vf_loss
                self.backward(loss)
                self.optimizer_step()
                stats.append({"pg_loss": pg_loss.item(), "vf_loss": vf_loss.item(), "approx_kl": approx_kl.item()})
        return stats


def warmup_value_head(policy, rollouts, cfg):
    """Fit the value head alone on the first rollouts before PPO starts (keeps early KL small)."""
    v_opt = th.optim.Adam(policy.v_head.parameters(), lr=cfg["vf_warmup_lr"])
    scaler = th.amp.GradScaler("cuda")
    for _ in range(cfg["vf_warmup_steps"]):
        for batch in rollouts:
            ctx_len = batch["ctx_len"]
            with th.autocast("cuda", dtype=th.float16):
                _, vpred = policy(batch["seq"], batch["attn"])
                loss = 0.5 * masked_mean((vpred[:, ctx_len - 1:-1] - batch["returns"]) ** 2, batch["mask"])
            v_opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(v_opt)
            th.nn.utils.clip_grad_norm_(policy.v_head.parameters(), 1.0)
            v_opt.step()  # expect: AMP006
            scaler.update()


def main(cfg=CFG):
    os.makedirs(cfg["out_dir"], exist_ok=True)
    tok = AutoTokenizer.from_pretrained(cfg["policy_model"], padding_side="left")
    tok.pad_token = tok.eos_token
    from rlhf_data import pairs_dataset, prompts_dataset  # local: tokenized TL;DR preference pairs / prompts
    if cfg["train_rm"]:
        train_reward_model(cfg, DataLoader(pairs_dataset(tok), batch_size=8, shuffle=True))

    policy = PolicyWithValueHead(AutoModelForCausalLM.from_pretrained(cfg["policy_model"]), len(tok)).to(cfg["device"])
    if cfg["gradient_checkpointing"]:
        policy.base.gradient_checkpointing_enable()
    ref_policy = copy.deepcopy(policy).half().eval()
    ref_policy.requires_grad_(False)
    reward_model = build_reward_model(cfg)
    reward_model.load_state_dict(th.load(os.path.join(cfg["out_dir"], "reward_model.pt"), map_location=cfg["device"]))
    reward_model.requires_grad_(False)
    reward_model.eval()

    trainer = PPOTrainer(policy, ref_policy, reward_model, tok, cfg)
    prompt_loader = DataLoader(prompts_dataset(tok), batch_size=cfg["rollout_batch_size"], shuffle=True, collate_fn=list)
    for it, prompts in enumerate(prompt_loader):
        t0 = time.time()
        batch = trainer.rollout(prompts)
        if it == 0:
            warmup_value_head(policy, [batch], cfg)
        stats = trainer.update(batch)
        print(f"iter {it}: score {batch['scores'].mean().item():.3f} pg {stats[-1]['pg_loss']:.4f} "
              f"vf {stats[-1]['vf_loss']:.4f} kl {stats[-1]['approx_kl']:.4f} ({time.time() - t0:.1f}s)")
        if it % cfg["save_every"] == 0:
            th.save(policy.state_dict(), os.path.join(cfg["out_dir"], f"policy_{it}.pt"))


if __name__ == "__main__":
    main()
