"""LoRA fine-tuning of a small decoder-only LM on instruction data.

The base checkpoint is frozen and kept in bf16 to halve its memory; only the
low-rank adapters on q/v projections are trained. Mixed precision is chosen with
--mixed-precision {fp16,bf16}; the loss scaler is only enabled for fp16.

    python b38_lora_finetune.py --base-ckpt base.pt --mixed-precision bf16 --grad-accum 8
"""
import argparse
import copy
import math
import os

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads, max_len):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v_proj, self.o_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))[None, None],
                             persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q = self.q_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.causal[:, :, :t, :t], torch.finfo(att.dtype).min)
        att = F.softmax(att.float(), dim=-1).to(q.dtype)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, c))


class DecoderBlock(nn.Module):
    def __init__(self, dim, heads, max_len):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, max_len)
        self.up, self.gate, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False), \
            nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLM(nn.Module):
    def __init__(self, vocab=32000, dim=512, depth=8, heads=8, max_len=1024):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([DecoderBlock(dim, heads, max_len) for _ in range(depth)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


class LoRALinear(nn.Module):
    def __init__(self, base, r, alpha, dropout):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling, self.dropout = alpha / r, nn.Dropout(dropout)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def inject_lora(model, r, alpha, dropout, targets=("q_proj", "v_proj")):
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, r, alpha, dropout))


def trainable_params(model):
    return [p for p in model.parameters() if p.requires_grad]


def optimizer_step(params, optimizer, scaler, max_grad_norm):
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)  # expect: AMP005
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@torch.no_grad()
def evaluate(model, loader, amp_dtype, device):
    model.eval()
    losses = []
    for input_ids, labels in loader:
        input_ids, labels = input_ids.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=amp_dtype):
            logits = model(input_ids)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        losses.append(loss.item())
    model.train()
    return sum(losses) / max(len(losses), 1)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=0.8, top_k=50):
    for _ in range(max_new_tokens):
        logits = model(idx[:, -1024:])[:, -1, :] / temperature
        v, _ = torch.topk(logits, top_k)
        logits[logits < v[:, [-1]]] = -float("inf")
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits.float(), dim=-1), 1)], dim=1)
    return idx


def save_adapters(model, optimizer, scheduler, scaler, step, path):
    lora = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    torch.save({"lora": lora, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(), "step": step}, path)


@torch.no_grad()
def export_merged(model, path):
    merged = copy.deepcopy(model).float()
    for module in merged.modules():
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                child.base.weight += (child.lora_B.weight @ child.lora_A.weight) * child.scaling
                setattr(module, name, child.base)
    torch.save({k: v.half() for k, v in merged.state_dict().items()}, path)


def train(model, optimizer, scheduler, scaler, train_loader, val_loader, args, amp_dtype, device, step):
    model.train()
    micro, best_val = 0, 1e9
    while step < args.max_steps:
        for input_ids, labels in train_loader:
            input_ids, labels = input_ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=amp_dtype):
                logits = model(input_ids)
            shift_logits = logits[:, :-1, :].contiguous()
            shift_labels = labels[:, 1:].contiguous()
            loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1), ignore_index=-100)  # expect: AMP002
            scaler.scale(loss / args.grad_accum).backward()
            micro += 1
            if micro % args.grad_accum != 0:
                continue
            grad_norm = optimizer_step(trainable_params(model), optimizer, scaler, args.max_grad_norm)
            scheduler.step()
            step += 1
            if step % args.log_every == 0:
                print(f"step {step} loss {loss.item():.4f} gnorm {grad_norm:.3f} lr {scheduler.get_last_lr()[0]:.2e}")
            if step % args.eval_every == 0:
                val = evaluate(model, val_loader, amp_dtype, device)
                print(f"step {step} val_loss {val:.4f}")
                save_adapters(model, optimizer, scheduler, scaler, step, os.path.join(args.out, "adapters.pt"))
                if val < best_val:
                    best_val = val
                    export_merged(model, os.path.join(args.out, "merged_fp16.pt"))
            if step >= args.max_steps:
                break
    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base-ckpt", default=None)
    p.add_argument("--mixed-precision", choices=["fp16", "bf16"], default="bf16")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--out", default="runs/lora")
    p.add_argument("--resume", default=None)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")

    model = TinyLM()
    if args.base_ckpt:
        model.load_state_dict(torch.load(args.base_ckpt, map_location="cpu"))
    inject_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout)
    for n, p_ in model.named_parameters():
        p_.requires_grad = "lora_" in n
    model = model.to(device=device, dtype=torch.bfloat16)  # expect: AMP001
    params = [p_ for n, p_ in model.named_parameters() if p_.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * s / args.max_steps)))
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.mixed_precision]
    scaler = torch.amp.GradScaler("cuda", enabled=args.mixed_precision == "fp16")

    step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["lora"], strict=False)
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        step = ckpt["step"]

    tokens = torch.randint(3, 32000, (2048, args.seq_len))
    labels = tokens.clone()
    labels[:, : args.seq_len // 4] = -100
    ds = torch.utils.data.TensorDataset(tokens, labels)
    train_ds, val_ds = torch.utils.data.random_split(ds, [1920, 128])
    train_loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = torch.utils.data.DataLoader(val_ds, batch_size=args.batch_size)
    train(model, optimizer, scheduler, scaler, train_loader, val_loader, args, amp_dtype, device, step)
    sample = generate(model, torch.full((1, 1), 2, dtype=torch.long, device=device), 64)
    print(sample.tolist())


if __name__ == "__main__":
    main()
