"""Recurrent and state-space sequence mixers for character-level classification.

Three interchangeable mixers share one residual backbone:
  * ``mingru``  - minGRU with the log-space parallel scan (Feng et al., 2024)
  * ``lnlstm``  - stacked LSTM with layer-normalised gates
  * ``s4d``     - diagonal state-space layer with an FFT convolution

Trained on CPU nodes with bf16 autocast.
"""
import argparse
import logging
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from charseq.data import make_loaders
from charseq.checkpoint import save_checkpoint

log = logging.getLogger("charseq")


def g(x):
    return torch.where(x >= 0, x + 0.5, x.sigmoid())


def log_g(x):
    return torch.where(x >= 0, (F.relu(x) + 0.5).log(), -F.softplus(-x))


def parallel_scan_log(log_coeffs, log_values):
    # log_coeffs: (b, t, d), log_values: (b, t + 1, d)
    a_star = F.pad(torch.cumsum(log_coeffs, dim=1), (0, 0, 1, 0))  # expect: AMP004
    log_h0_plus_b_star = torch.logcumsumexp(log_values - a_star, dim=1)
    log_h = a_star + log_h0_plus_b_star
    return torch.exp(log_h)[:, 1:]


class MinGRU(nn.Module):
    def __init__(self, dim, hidden_dim=None):
        super().__init__()
        hidden_dim = hidden_dim or dim
        self.to_hidden_and_gate = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.to_out = nn.Linear(hidden_dim, dim, bias=False) if hidden_dim != dim else nn.Identity()

    def forward(self, x, prev_hidden=None):
        seq_len = x.size(1)
        hidden, gate = self.to_hidden_and_gate(x).chunk(2, dim=-1)
        if seq_len == 1:
            hidden = g(hidden)
            gate = gate.sigmoid()
            out = torch.lerp(prev_hidden, hidden, gate) if prev_hidden is not None else hidden * gate
        else:
            log_coeffs = -F.softplus(gate)
            log_z = -F.softplus(-gate)
            log_values = log_z + log_g(hidden)
            if prev_hidden is not None:
                log_values = torch.cat((log_g(prev_hidden), log_values), dim=1)
            else:
                log_values = F.pad(log_values, (0, 0, 1, 0), value=-math.inf)
            out = parallel_scan_log(log_coeffs, log_values)
            out = out[:, -seq_len:]
        next_hidden = out[:, -1:]
        return self.to_out(out), next_hidden


class LayerNormLSTMCell(nn.Module):
    def __init__(self, input_size, hidden_size, forget_bias=1.0, eps=1e-5):
        super().__init__()
        self.hidden_size = hidden_size
        self.forget_bias = forget_bias
        self.eps = eps
        self.ih = nn.Linear(input_size, 4 * hidden_size, bias=False)
        self.hh = nn.Linear(hidden_size, 4 * hidden_size)
        self.gamma = nn.Parameter(torch.ones(4 * hidden_size))
        self.beta = nn.Parameter(torch.zeros(4 * hidden_size))
        self.ln_c = nn.LayerNorm(hidden_size)

    def _layer_norm(self, gates):
        mu = gates.mean(dim=-1, keepdim=True)  # expect: AMP004
        sigma = gates.std(dim=-1, keepdim=True, unbiased=False)  # expect: AMP004
        return (gates - mu) / (sigma + self.eps) * self.gamma + self.beta

    def forward(self, x, state):
        h, c = state
        gates = self._layer_norm(self.ih(x) + self.hh(h))
        i, f, z, o = gates.chunk(4, dim=1)
        i = torch.sigmoid(i)
        f = torch.sigmoid(f + self.forget_bias)
        z = torch.tanh(z)
        o = torch.sigmoid(o)
        c = f * c + i * z
        h = o * torch.tanh(self.ln_c(c))
        return h, c


class StackedLNLSTM(nn.Module):
    def __init__(self, dim, hidden_size, num_layers=2, dropout=0.1):
        super().__init__()
        sizes = [dim] + [hidden_size] * num_layers
        self.cells = nn.ModuleList(LayerNormLSTMCell(sizes[i], sizes[i + 1]) for i in range(num_layers))
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(hidden_size, dim)
        self.hidden_size = hidden_size

    def forward(self, x, state=None):
        b, t, _ = x.shape
        if state is None:
            state = [(x.new_zeros(b, self.hidden_size), x.new_zeros(b, self.hidden_size)) for _ in self.cells]
        new_state = []
        layer_input = x
        for cell, (h, c) in zip(self.cells, state):
            outputs = []
            for step in range(t):
                h, c = cell(layer_input[:, step], (h, c))
                outputs.append(h)
            layer_input = self.dropout(torch.stack(outputs, dim=1))
            new_state.append((h, c))
        return self.out(layer_input), new_state


class S4DLayer(nn.Module):
    """Real-valued diagonal SSM; the kernel and the convolution run in fp32."""

    def __init__(self, dim, state_dim=64, dt_min=1e-3, dt_max=1e-1, dropout=0.0):
        super().__init__()
        log_dt = torch.rand(dim) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        self.log_dt = nn.Parameter(log_dt)
        self.log_A = nn.Parameter(torch.log(0.5 * torch.ones(dim, state_dim)))
        self.B = nn.Parameter(torch.randn(dim, state_dim) / math.sqrt(state_dim))
        self.C = nn.Parameter(torch.randn(dim, state_dim) / math.sqrt(state_dim))
        self.D = nn.Parameter(torch.randn(dim))
        self.activation = nn.GELU()
        self.dropout = nn.Dropout(dropout)
        self.output_linear = nn.Linear(dim, dim)

    def kernel(self, length):
        dt = torch.exp(self.log_dt)
        A = -torch.exp(self.log_A)
        dtA = dt[:, None] * A
        steps = torch.arange(length, device=A.device, dtype=A.dtype)
        weights = self.C * (torch.exp(dtA) - 1.0) / A * self.B
        return (weights[..., None] * torch.exp(dtA[..., None] * steps)).sum(dim=1)

    def forward(self, u, state=None):
        length = u.size(1)
        with torch.autocast("cpu", enabled=False):
            k = self.kernel(length)
            u32 = u.float().transpose(1, 2)
            k_f = torch.fft.rfft(k, n=2 * length)
            u_f = torch.fft.rfft(u32, n=2 * length)
            y = torch.fft.irfft(u_f * k_f, n=2 * length)[..., :length]
            y = y + u32 * self.D[:, None]
        y = self.dropout(self.activation(y.transpose(1, 2)))
        return self.output_linear(y), state


SEQUENCE_MIXERS = {
    "mingru": lambda cfg: MinGRU(cfg.dim, cfg.hidden_dim),
    "lnlstm": lambda cfg: StackedLNLSTM(cfg.dim, cfg.hidden_dim, num_layers=1, dropout=cfg.dropout),
    "s4d": lambda cfg: S4DLayer(cfg.dim, cfg.state_dim, dropout=cfg.dropout),
}


class RecurrentClassifier(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.in_proj = nn.Linear(cfg.dim, cfg.dim)
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.dim) for _ in range(cfg.depth))
        self.mixers = nn.ModuleList(SEQUENCE_MIXERS[cfg.mixer](cfg) for _ in range(cfg.depth))
        self.out_proj = nn.Linear(cfg.dim, cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, tokens, lengths):
        x = self.in_proj(self.embed(tokens))
        for norm, mixer in zip(self.norms, self.mixers):
            y, _ = mixer(norm(x))
            x = x + y
        feats = self.out_proj(x)
        mask = torch.arange(tokens.size(1), device=tokens.device)[None, :] < lengths[:, None]
        m = mask.unsqueeze(-1).to(feats.dtype)
        summed = (feats * m).sum(dim=1)  # expect: AMP004
        denom = lengths.to(summed.dtype).unsqueeze(-1)
        pooled = summed / (denom + 1e-8)
        return self.head(pooled)


def build_model(args):
    return RecurrentClassifier(args)


def train(args):
    train_loader, val_loader = make_loaders(args.data, args.batch_size, args.max_len)
    model = build_model(args)
    if args.bf16_weights:
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)  # expect: AMP010

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for tokens, lengths, labels in train_loader:
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=args.amp):
                logits = model(tokens, lengths)
                loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if step % args.log_every == 0:
                with torch.no_grad():
                    stats = {
                        "loss": loss.item(),
                        "grad_norm": grad_norm.item(),
                        "logit_std": logits.detach().std().item(),  # expect: AMP004
                        "logit_absmax": logits.detach().abs().max().item(),
                    }
                log.info("epoch %d step %d %s (%.1fs)", epoch, step, stats, time.time() - t0)
        val_loss, val_acc = evaluate(model, val_loader, args)
        log.info("epoch %d val_loss %.4f val_acc %.4f", epoch, val_loss, val_acc)
        save_checkpoint(args.out_dir, epoch, model=model, optimizer=optimizer, scaler=scaler)


@torch.no_grad()
def evaluate(model, loader, args):
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for tokens, lengths, labels in loader:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=args.amp):
            logits = model(tokens, lengths)
        total_loss += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
        count += labels.numel()
    return total_loss / count, correct / count


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out-dir", default="runs/charseq")
    p.add_argument("--mixer", choices=sorted(SEQUENCE_MIXERS), default="mingru")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--num-classes", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden-dim", type=int, default=384)
    p.add_argument("--state-dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--bf16-weights", action="store_true", help="keep the weights themselves in bf16")
    return p.parse_args()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train(parse_args())
