"""Pointer-generator decoder with coverage, plus beam search (summarisation model code)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class BahdanauAttention(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.W_h = nn.Linear(2 * hidden, 2 * hidden, bias=False)
        self.W_s = nn.Linear(2 * hidden, 2 * hidden)
        self.w_c = nn.Linear(1, 2 * hidden, bias=False)
        self.v = nn.Linear(2 * hidden, 1, bias=False)
        self.neg_inf = -1e12

    def forward(self, enc_out, enc_feats, s_t, enc_mask, coverage):
        att = self.W_h(enc_out) + self.W_s(s_t).unsqueeze(1) + self.w_c(coverage.unsqueeze(-1))
        scores = self.v(torch.tanh(att)).squeeze(-1)
        scores.masked_fill_(~enc_mask, self.neg_inf)  # expect: AMP007
        attn = F.softmax(scores, dim=-1)
        context = torch.bmm(attn.unsqueeze(1), enc_out).squeeze(1)
        return context, attn, coverage + attn


class CopyGate(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.p_gen = nn.Linear(4 * hidden + hidden, 1)
        self.out = nn.Linear(3 * hidden, vocab)

    def forward(self, context, s_t, x_t, attn, enc_ids, extra_zeros):
        p_gen = torch.sigmoid(self.p_gen(torch.cat([context, s_t, x_t], -1)))
        vocab_dist = F.softmax(self.out(torch.cat([s_t, context], -1)), dim=-1) * p_gen
        if extra_zeros is not None:
            vocab_dist = torch.cat([vocab_dist, extra_zeros], 1)
        return vocab_dist.scatter_add(1, enc_ids, (1 - p_gen) * attn)


def length_penalty(length, alpha=0.6):
    return ((5 + length) / 6) ** alpha


def beam_search(model, enc_out, enc_mask, bos, eos, beam=4, max_len=100):
    device = enc_out.device
    scores = torch.full((beam,), -1e9, device=device)
    scores[0] = 0.0
    seqs = torch.full((beam, 1), bos, dtype=torch.long, device=device)
    finished = []
    state = model.init_state(enc_out)
    for step in range(max_len):
        log_probs, state = model.decode_step(seqs[:, -1], state, enc_out, enc_mask)
        log_probs = log_probs.float()
        log_probs[:, eos] = torch.where(torch.tensor(step < 5, device=device), torch.tensor(-1e9, device=device),
                                        log_probs[:, eos])
        cand = (scores[:, None] + log_probs).view(-1)
        top, idx = cand.topk(beam)
        seqs = torch.cat([seqs[idx // log_probs.size(1)], (idx % log_probs.size(1))[:, None]], 1)
        scores = top
        done = seqs[:, -1] == eos
        for b in done.nonzero().flatten().tolist():
            finished.append((scores[b].item() / length_penalty(step + 1), seqs[b]))
        scores = scores.masked_fill(done, -1e9)
        if len(finished) >= beam:
            break
    return max(finished, key=lambda t: t[0])[1] if finished else seqs[0]


class BlockedNgramLogits(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.n = n

    def forward(self, logits, prev_tokens):
        banned = prev_tokens[:, -self.n + 1 :]
        return logits.scatter(1, banned, torch.full_like(banned, -100000, dtype=logits.dtype))  # expect: AMP007


class FinalLogits(nn.Module):
    def forward(self, hidden, weight, vocab_mask):
        logits = F.linear(hidden, weight)
        return logits.masked_fill(~vocab_mask, float("-inf"))
