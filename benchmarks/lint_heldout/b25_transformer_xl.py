"""Transformer-XL language model with relative positional attention, segment-level
recurrence and a small compressed-memory summary, trained on token streams."""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class PositionalEmbedding(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, pos_seq):
        sinusoid = torch.outer(pos_seq, self.inv_freq)
        return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)


class PositionwiseFF(nn.Module):
    def __init__(self, d_model, d_inner, dropout):
        super().__init__()
        self.core = nn.Sequential(
            nn.Linear(d_model, d_inner), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(d_inner, d_model), nn.Dropout(dropout),
        )
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, inp):
        return self.layer_norm(inp + self.core(inp))


class RelPartialLearnableMultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head, dropout):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.scale = 1.0 / math.sqrt(d_head)

    @staticmethod
    def _rel_shift(x):
        b, n, q, k = x.shape
        zero_pad = x.new_zeros((b, n, q, 1))
        x_padded = torch.cat([zero_pad, x], dim=-1).view(b, n, k + 1, q)
        return x_padded[:, :, 1:].view_as(x)

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask, mems=None):
        qlen, bsz = w.size(0), w.size(1)
        cat = torch.cat([mems, w], dim=0) if mems is not None else w
        w_heads = self.qkv_net(cat)
        r_head_k = self.r_net(r).view(r.size(0), self.n_head, self.d_head)
        q, k, v = torch.chunk(w_heads, 3, dim=-1)
        klen = k.size(0)
        q = q[-qlen:].view(qlen, bsz, self.n_head, self.d_head).permute(1, 2, 0, 3)
        k = k.view(klen, bsz, self.n_head, self.d_head).permute(1, 2, 3, 0)
        v = v.view(klen, bsz, self.n_head, self.d_head).permute(1, 2, 0, 3)

        ac = torch.matmul(q + r_w_bias[:, None, :], k)
        bd = torch.matmul(q + r_r_bias[:, None, :], r_head_k.permute(1, 2, 0)[None])
        attn_score = (ac + self._rel_shift(bd)) * self.scale
        if attn_mask.dim() == 2:
            attn_score = attn_score.masked_fill(attn_mask[None, None, :, :], -1e30)  # expect: AMP007
        else:
            fill = -65000.0 if attn_score.dtype == torch.float16 else -1e30
            attn_score = attn_score.masked_fill(attn_mask[:, None, :, :], fill)
        attn_prob = self.drop(F.softmax(attn_score, dim=-1))
        attn_vec = torch.matmul(attn_prob, v).permute(2, 0, 1, 3).reshape(qlen, bsz, -1)
        return self.layer_norm(w + self.drop(self.o_net(attn_vec)))


class RelDecoderLayer(nn.Module):
    def __init__(self, n_head, d_model, d_head, d_inner, dropout):
        super().__init__()
        self.attn = RelPartialLearnableMultiHeadAttn(n_head, d_model, d_head, dropout)
        self.ff = PositionwiseFF(d_model, d_inner, dropout)

    def forward(self, x, r, r_w_bias, r_r_bias, mask, mems=None):
        return self.ff(self.attn(x, r, r_w_bias, r_r_bias, mask, mems=mems))


class MemTransformerLM(nn.Module):
    def __init__(self, n_token, n_layer=6, n_head=8, d_model=512, d_head=64, d_inner=2048,
                 dropout=0.1, tgt_len=128, mem_len=128):
        super().__init__()
        self.n_layer, self.mem_len, self.d_model = n_layer, mem_len, d_model
        self.word_emb = nn.Embedding(n_token, d_model)
        self.pos_emb = PositionalEmbedding(d_model)
        self.r_w_bias = nn.Parameter(torch.zeros(n_head, d_head))
        self.r_r_bias = nn.Parameter(torch.zeros(n_head, d_head))
        self.layers = nn.ModuleList(
            [RelDecoderLayer(n_head, d_model, d_head, d_inner, dropout) for _ in range(n_layer)]
        )
        self.compress = nn.Linear(d_model, d_model)
        self.mem_gate = nn.Linear(d_model, 1)
        self.drop = nn.Dropout(dropout)
        self.out_layer = nn.Linear(d_model, n_token)

    def init_mems(self, device):
        return [torch.empty(0, device=device) for _ in range(self.n_layer + 1)]

    @torch.no_grad()
    def _update_mems(self, hids, mems, qlen, mlen):
        end_idx = mlen + qlen
        beg_idx = max(0, end_idx - self.mem_len)
        new_mems = []
        for hid, mem in zip(hids, mems):
            cat = torch.cat([mem, hid], dim=0) if mem.numel() else hid
            new_mems.append(cat[beg_idx:end_idx].detach())
        return new_mems

    def forward(self, data, mems):
        qlen, bsz = data.shape
        mlen = mems[0].size(0) if mems[0].numel() else 0
        klen = mlen + qlen
        word_emb = self.word_emb(data) * math.sqrt(self.d_model)
        if mlen > 0:
            comp = self.compress(mems[-1])
            summary = comp.mean(dim=0, keepdim=True)  # expect: AMP004
            word_emb = word_emb + summary
        mask = torch.triu(data.new_ones(qlen, klen), diagonal=1 + mlen).bool()
        pos_seq = torch.arange(klen - 1, -1, -1.0, device=data.device)
        r = self.drop(self.pos_emb(pos_seq))
        core_out = self.drop(word_emb)
        hids = [core_out]
        for i, layer in enumerate(self.layers):
            mem_i = mems[i] if mlen > 0 else None
            core_out = layer(core_out, r, self.r_w_bias, self.r_r_bias, mask, mems=mem_i)
            hids.append(core_out)
        gate = torch.sigmoid(self.mem_gate(core_out))
        aux = -(gate * torch.log(gate + 1e-10)).sum(-1).mean()  # expect: AMP011
        logits = self.out_layer(self.drop(core_out))
        new_mems = self._update_mems(hids, mems, qlen, mlen)
        return logits, new_mems, aux


def train_epoch(model, loader, optimizer, scheduler, scaler, clip=0.25, aux_weight=0.01):
    model.train()
    mems = model.init_mems(torch.device("cuda"))
    total, steps = 0.0, 0
    for data, target in loader:
        data, target = data.cuda(non_blocking=True), target.cuda(non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits, mems, aux = model(data, mems)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1))
            loss = loss + aux_weight * aux
            if scaler is not None:
                scaler.scale(loss).backward()  # expect: AMP008
            else:
                loss.backward()  # expect: AMP008
        if scaler is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()  # expect: AMP006
        scheduler.step()
        total += loss.item()
        steps += 1
    return total / max(steps, 1)


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    mems = model.init_mems(torch.device("cuda"))
    total_loss, total_len = 0.0, 0
    for data, target in loader:
        data, target = data.cuda(), target.cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            logits, mems, _ = model(data, mems)
        nll = F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.view(-1))
        total_loss += nll.item() * data.size(0)
        total_len += data.size(0)
    return math.exp(total_loss / max(total_len, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-token", type=int, default=267735)
    parser.add_argument("--lr", type=float, default=2.5e-4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--fp16", action="store_true")
    args = parser.parse_args()

    model = MemTransformerLM(args.n_token).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_loader = torch.load("wt103_train_batches.pt")
    valid_loader = torch.load("wt103_valid_batches.pt")
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler() if args.fp16 else None  # expect: AMP009
    best_ppl = float("inf")
    for epoch in range(args.epochs):
        train_loss = train_epoch(model, train_loader, optimizer, scheduler, scaler)
        ppl = evaluate(model, valid_loader)
        if ppl < best_ppl:
            best_ppl = ppl
            torch.save(model.state_dict(), "txl_best.pt")
        print(f"epoch {epoch} train {train_loss:.3f} valid ppl {ppl:.2f}")


if __name__ == "__main__":
    main()
