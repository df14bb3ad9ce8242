"""Transformer-XL language model: relative positional attention with segment-level memory.

Word-level LM on a pre-tokenised corpus (``corpus.pt`` holds train/valid LongTensors).
The loss is computed inside ``forward`` (per token, not reduced) as in the original code.
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class PositionalEmbedding(nn.Module):
    def __init__(self, demb):
        super().__init__()
        inv_freq = 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, pos_seq):
        sinusoid = torch.outer(pos_seq, self.inv_freq)
        return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)[:, None, :]


class PositionwiseFF(nn.Module):
    def __init__(self, d_model, d_inner, dropout, act="ReLU"):
        super().__init__()
        self.core = nn.Sequential(nn.Linear(d_model, d_inner), getattr(nn, act)(), nn.Dropout(dropout),
                                  nn.Linear(d_inner, d_model), nn.Dropout(dropout))
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, inp):
        return self.layer_norm(inp + self.core(inp))


class RelPartialLearnableMultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head, dropout, dropatt=0.0):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        self.layer_norm = nn.LayerNorm(d_model)
        self.scale = 1 / math.sqrt(d_head)

    @staticmethod
    def _rel_shift(x):
        b, h, q, k = x.size()
        x_padded = torch.cat([x.new_zeros(b, h, q, 1), x], dim=-1).view(b, h, k + 1, q)
        return x_padded[:, :, 1:].reshape(b, h, q, k)

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask, mems=None):
        qlen, bsz = w.size(0), w.size(1)
        cat = torch.cat([mems, w], 0) if mems is not None and mems.numel() else w
        w_head_q, w_head_k, w_head_v = self.qkv_net(cat).chunk(3, dim=-1)
        klen = w_head_k.size(0)
        q = w_head_q[-qlen:].view(qlen, bsz, self.n_head, self.d_head).permute(1, 2, 0, 3)
        k = w_head_k.view(klen, bsz, self.n_head, self.d_head).permute(1, 2, 3, 0)
        v = w_head_v.view(klen, bsz, self.n_head, self.d_head).permute(1, 2, 0, 3)
        r_k = self.r_net(r).view(klen, self.n_head, self.d_head).permute(1, 2, 0)
        ac = torch.matmul(q + r_w_bias[:, None], k)
        bd = self._rel_shift(torch.matmul(q + r_r_bias[:, None], r_k))
        attn_score = (ac + bd) * self.scale
        attn_score = attn_score.masked_fill(attn_mask[None, None], -1e30)  # expect: AMP007
        attn_prob = self.dropatt(F.softmax(attn_score, dim=-1))
        attn_vec = torch.matmul(attn_prob, v).permute(2, 0, 1, 3).reshape(qlen, bsz, -1)
        return self.layer_norm(w + self.drop(self.o_net(attn_vec)))


class DecoderLayer(nn.Module):
    def __init__(self, n_head, d_model, d_head, d_inner, dropout, dropatt, act):
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(n_head, d_model, d_head, dropout, dropatt)
        self.pos_ff = PositionwiseFF(d_model, d_inner, dropout, act)

    def forward(self, dec_inp, r, r_w_bias, r_r_bias, attn_mask, mems=None):
        return self.pos_ff(self.dec_attn(dec_inp, r, r_w_bias, r_r_bias, attn_mask, mems))


class MemTransformerLM(nn.Module):
    def __init__(self, n_token, n_layer=16, n_head=10, d_model=410, d_head=41, d_inner=2100, dropout=0.1,
                 dropatt=0.0, mem_len=150, act="ReLU"):
        super().__init__()
        self.n_layer, self.mem_len, self.d_model = n_layer, mem_len, d_model
        self.word_emb = nn.Embedding(n_token, d_model)
        self.emb_scale = d_model ** 0.5
        self.pos_emb = PositionalEmbedding(d_model)
        self.r_w_bias = nn.Parameter(torch.zeros(n_head, d_head))
        self.r_r_bias = nn.Parameter(torch.zeros(n_head, d_head))
        self.layers = nn.ModuleList(
            [DecoderLayer(n_head, d_model, d_head, d_inner, dropout, dropatt, act) for _ in range(n_layer)]
        )
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(d_model, n_token)
        self.out.weight = self.word_emb.weight

    def init_mems(self, device):
        return [torch.empty(0, device=device) for _ in range(self.n_layer + 1)]

    @torch.no_grad()
    def _update_mems(self, hids, mems, qlen, mlen):
        end_idx = mlen + qlen
        beg_idx = max(0, end_idx - self.mem_len)
        return [torch.cat([m, h], dim=0)[beg_idx:end_idx].detach() if m.numel() else h[-self.mem_len:].detach()
                for h, m in zip(hids, mems)]

    def forward(self, data, target, *mems):
        qlen, bsz = data.size()
        mlen = mems[0].size(0) if mems[0].numel() else 0
        klen = mlen + qlen
        word_emb = self.word_emb(data) * self.emb_scale
        attn_mask = torch.triu(torch.ones(qlen, klen, dtype=torch.bool, device=data.device), diagonal=1 + mlen)
        pos_seq = torch.arange(klen - 1, -1, -1.0, device=data.device)
        pos_emb = self.drop(self.pos_emb(pos_seq))
        core_out = self.drop(word_emb)
        hids = [core_out]
        for i, layer in enumerate(self.layers):
            core_out = layer(core_out, pos_emb, self.r_w_bias, self.r_r_bias, attn_mask, mems[i])
            hids.append(core_out)
        new_mems = self._update_mems(hids, mems, qlen, mlen)
        logits = self.out(self.drop(core_out))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.reshape(-1), reduction="none")
        return loss.view(qlen, bsz), new_mems


def lm_batches(tokens, bsz, bptt, device):
    n = tokens.size(0) // bsz
    data = tokens[: n * bsz].view(bsz, n).t().contiguous().to(device)
    for i in range(0, n - 1, bptt):
        seq_len = min(bptt, n - 1 - i)
        yield data[i : i + seq_len], data[i + 1 : i + 1 + seq_len], seq_len


def train_epoch(model, batches, optimizer, scheduler, scaler, args):
    model.train()
    mems = model.init_mems(args.device)
    log_loss, n = 0.0, 0
    for step, (data, target, _) in enumerate(batches):
        with torch.autocast("cuda", dtype=torch.float16):
            loss, mems = model(data, target, *mems)
            loss = loss.float().mean()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        log_loss, n = log_loss + loss.item(), n + 1
        if step % args.log_interval == 0:
            with torch.no_grad():
                mem_rms = torch.stack([m.float().pow(2).mean().sqrt() for m in mems if m.numel()])
            print(f"step {step} ppl {math.exp(log_loss / n):.2f} mem-rms {mem_rms.mean().item():.3f}")
            log_loss, n = 0.0, 0


def evaluate(model, batches, args):
    model.eval()
    mems = model.init_mems(args.device)
    total_loss, total_len = 0.0, 0
    with torch.no_grad():
        for data, target, seq_len in batches:
            with torch.cuda.amp.autocast(enabled=args.amp):  # expect: AMP009
                loss, mems = model(data, target, *mems)
            total_loss += seq_len * loss.float().mean().item()
            total_len += seq_len
    model.train()
    return total_loss / total_len


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", default="data/wt103/corpus.pt")
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--tgt-len", type=int, default=150)
    p.add_argument("--mem-len", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=60)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--max-step", type=int, default=200000)
    p.add_argument("--clip", type=float, default=0.25)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--log-interval", type=int, default=200)
    p.add_argument("--amp", action="store_true")
    args = p.parse_args()
    args.device = torch.device("cuda")
    corpus = torch.load(args.corpus)
    model = MemTransformerLM(corpus["n_token"], n_layer=args.n_layer, mem_len=args.mem_len)
    model = model.to(args.device)
    model = model.half()  # expect: AMP001
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # expect: AMP011
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.max_step, eta_min=0.0)
    scaler = torch.amp.GradScaler("cuda")
    best_val = 1e9
    for epoch in range(args.epochs):
        train_epoch(model, lm_batches(corpus["train"], args.batch_size, args.tgt_len, args.device),
                    optimizer, scheduler, scaler, args)
        val_loss = evaluate(model, lm_batches(corpus["valid"], 10, args.tgt_len, args.device), args)
        print(f"epoch {epoch} valid ppl {math.exp(val_loss):.2f}")
        if val_loss < best_val:
            best_val = val_loss
            torch.save(model.state_dict(), "txl_best.pt")


if __name__ == "__main__":
    main()
