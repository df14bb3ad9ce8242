"""BERT pretraining (MLM + NSP) with the two-phase schedule of the NVIDIA recipe.

Phase 1 runs at sequence length 128 in the precision chosen on the command line,
phase 2 at 512 in fp16. LayerNorm always computes in fp32 (TF-BERT parity).
"""
import argparse
import copy
import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


class BertLayerNorm(nn.LayerNorm):
    def forward(self, x):
        out = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)


class BertEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position = nn.Embedding(cfg.max_len, cfg.hidden)
        self.token_type = nn.Embedding(2, cfg.hidden)
        self.norm = BertLayerNorm(cfg.hidden, eps=1e-12)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, input_ids, token_type_ids):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)[None]
        x = self.word(input_ids) + self.position(pos) + self.token_type(token_type_ids)
        return self.drop(self.norm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.window = cfg.window
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def _mask_scores(self, scores, attention_mask):
        extended = 1.0 - attention_mask[:, None, None, :].to(scores.dtype)
        return scores + extended * torch.finfo(scores.dtype).min

    def forward(self, x, attention_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)
        q, k, v = (torch.einsum("bthd->bhtd", t) for t in (q, k, v))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.head_dim)
        probs = self._mask_scores(scores, attention_mask).softmax(dim=-1)
        ctx = torch.einsum("bhqk,bhkd->bqhd", self.drop(probs), v).reshape(B, T, C)
        return self.out(ctx)


class LocalWindowAttention(BertSelfAttention):
    """Sliding-window layer copied from an older long-document model."""

    def _mask_scores(self, scores, attention_mask):
        idx = torch.arange(scores.size(-1), device=scores.device)
        window = (idx[None, :] - idx[:, None]).abs() <= self.window
        keep = window[None, None] & attention_mask[:, None, None, :].bool()
        return scores.masked_fill(~keep, -1e9)  # expect: AMP007


class BertLayer(nn.Module):
    def __init__(self, cfg, local=False):
        super().__init__()
        self.attn = LocalWindowAttention(cfg) if local else BertSelfAttention(cfg)
        self.norm1 = BertLayerNorm(cfg.hidden, eps=1e-12)
        self.ffn = nn.Sequential(nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.GELU(), nn.Linear(4 * cfg.hidden, cfg.hidden))
        self.norm2 = BertLayerNorm(cfg.hidden, eps=1e-12)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, attention_mask):
        x = self.norm1(x + self.drop(self.attn(x, attention_mask)))
        return self.norm2(x + self.drop(self.ffn(x)))


class BertForPreTraining(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList([BertLayer(cfg, local=i < cfg.local_layers) for i in range(cfg.layers)])
        self.mlm_transform = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.GELU(),
                                           BertLayerNorm(cfg.hidden, eps=1e-12))
        self.mlm_decoder = nn.Linear(cfg.hidden, cfg.vocab_size)
        self.mlm_decoder.weight = self.embeddings.word.weight
        self.nsp = nn.Linear(cfg.hidden, 2)
        self.register_buffer("special_tokens", torch.zeros(cfg.vocab_size, dtype=torch.bool), persistent=False)

    def forward(self, input_ids, token_type_ids, attention_mask):
        h = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            h = layer(h, attention_mask)
        mlm_scores = self.mlm_decoder(self.mlm_transform(h))
        mlm_scores = mlm_scores.masked_fill(self.special_tokens, -10000.0)
        return mlm_scores, self.nsp(torch.tanh(h[:, 0]))


class BertPretrainingCriterion(nn.Module):
    def __init__(self):
        super().__init__()
        self.ce = nn.CrossEntropyLoss(ignore_index=-1)

    def forward(self, mlm_scores, nsp_scores, mlm_labels, nsp_labels):
        mlm = self.ce(mlm_scores.view(-1, mlm_scores.size(-1)), mlm_labels.view(-1))
        return mlm + self.ce(nsp_scores.view(-1, 2), nsp_labels.view(-1))


def make_optimizer(model, lr, weight_decay=0.01):
    no_decay = ("bias", "norm")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-6)


def pretrain(model, loader, args):
    optimizer = make_optimizer(model, args.lr)
    criterion = BertPretrainingCriterion()
    use_amp = args.precision in ("fp16", "bf16")
    amp_dtype = torch.float16 if args.precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=args.precision == "fp16")
    model.train()
    for step, batch in enumerate(loader):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        if use_amp:
            with torch.autocast("cuda", dtype=amp_dtype):
                mlm_scores, nsp_scores = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
                loss = criterion(mlm_scores, nsp_scores, batch["mlm_labels"], batch["nsp_labels"])
        else:
            mlm_scores, nsp_scores = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
            loss = criterion(mlm_scores, nsp_scores, batch["mlm_labels"], batch["nsp_labels"])
        scaler.scale(loss / args.grad_accum).backward()
        if (step + 1) % args.grad_accum == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:
            print(f"phase1 step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")


def pretrain_phase2(model, loader, args):
    """Phase 2: sequence length 512, fp16 as in the original recipe."""
    optimizer = make_optimizer(model, args.lr_phase2)
    criterion = BertPretrainingCriterion()
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 14)
    model.train()
    for step, batch in enumerate(loader):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            mlm_scores, nsp_scores = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
            loss = criterion(mlm_scores, nsp_scores, batch["mlm_labels"], batch["nsp_labels"])
        loss = scaler.scale(loss / args.grad_accum)
        loss.backward()
        if (step + 1) % args.grad_accum == 0:
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)


def continue_pretraining_low_mem(model, loader, args):
    """Domain-adaptive pretraining on a 16 GB card: whole model in half precision."""
    model = model.half()  # expect: AMP001
    optimizer = make_optimizer(model, args.lr * 0.5)
    criterion = BertPretrainingCriterion()
    model.train()
    for batch in loader:
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        mlm_scores, nsp_scores = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        loss = criterion(mlm_scores.float(), nsp_scores.float(), batch["mlm_labels"], batch["nsp_labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate_mlm(model, loader):
    model.eval()
    total, count = 0.0, 0
    for batch in loader:
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            mlm_scores, _ = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        nll = F.cross_entropy(mlm_scores.float().view(-1, mlm_scores.size(-1)), batch["mlm_labels"].view(-1),
                              ignore_index=-1, reduction="sum")
        total += nll.item()
        count += int((batch["mlm_labels"] != -1).sum())
    model.train()
    return math.exp(total / max(1, count))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp16")
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--lr-phase2", type=float, default=4e-3)
    parser.add_argument("--grad-accum", type=int, default=8)
    parser.add_argument("--low-mem", action="store_true")
    args = parser.parse_args()
    cfg = SimpleNamespace(vocab_size=30522, hidden=768, heads=12, layers=12, max_len=512, dropout=0.1,
                          local_layers=2, window=128)
    model = BertForPreTraining(cfg).cuda()
    loaders = build_loaders(args)  # noqa: F821  (project helper)
    if args.low_mem:
        continue_pretraining_low_mem(model, loaders["domain"], args)
    else:
        pretrain(model, loaders["phase1"], args)
        pretrain_phase2(model, loaders["phase2"], args)
    print(f"MLM perplexity {evaluate_mlm(model, loaders['val']):.2f}")
    torch.save(copy.deepcopy(model).half().state_dict(), "bert_fp16.pt")


if __name__ == "__main__":
    main()
