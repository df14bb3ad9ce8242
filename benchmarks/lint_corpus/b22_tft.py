"""Temporal Fusion Transformer for multi-horizon quantile forecasting: gated residual
networks, variable selection networks, LSTM seq2seq layer and interpretable attention."""
import math

import torch
import torch.nn.functional as F
from torch import nn


class GatedLinearUnit(nn.Module):
    def __init__(self, d_in, d_out, dropout=0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(d_in, 2 * d_out)

    def forward(self, x):
        return F.glu(self.fc(self.dropout(x)), dim=-1)


class AddNorm(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x, skip):
        return self.norm(x + skip)


class GatedResidualNetwork(nn.Module):
    def __init__(self, d_in, d_hidden, d_out, d_context=None, dropout=0.1):
        super().__init__()
        self.skip = nn.Linear(d_in, d_out) if d_in != d_out else None
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.context = nn.Linear(d_context, d_hidden, bias=False) if d_context else None
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.glu = GatedLinearUnit(d_hidden, d_out, dropout)
        self.add_norm = AddNorm(d_out)

    def forward(self, x, context=None):
        residual = self.skip(x) if self.skip is not None else x
        h = self.fc1(x)
        if context is not None:
            h = h + self.context(context)
        h = self.fc2(F.elu(h))
        return self.add_norm(self.glu(h), residual)


class VariableSelectionNetwork(nn.Module):
    def __init__(self, n_vars, d_model, d_context=None, dropout=0.1):
        super().__init__()
        self.flat_grn = GatedResidualNetwork(n_vars * d_model, d_model, n_vars, d_context, dropout)
        self.var_grns = nn.ModuleList(
            [GatedResidualNetwork(d_model, d_model, d_model, None, dropout) for _ in range(n_vars)])

    def forward(self, embeddings, context=None):
        weights = torch.softmax(self.flat_grn(embeddings.flatten(-2), context), dim=-1)
        processed = torch.stack([grn(embeddings[..., i, :]) for i, grn in enumerate(self.var_grns)], dim=-1)
        combined = (processed * weights.unsqueeze(-2)).sum(dim=-1)
        return combined, weights


class ScaledDotProductAttention(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        attn = torch.bmm(q, k.permute(0, 2, 1)) / math.sqrt(k.size(-1))
        if mask is not None:
            attn = attn.masked_fill(mask, -1e9)  # expect: AMP007
        attn = torch.softmax(attn, dim=-1)
        output = torch.bmm(self.dropout(attn), v)
        return output, attn


class InterpretableMultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, dropout=0.1):
        super().__init__()
        self.n_head = n_head
        self.d_k = d_model // n_head
        self.q_layers = nn.ModuleList([nn.Linear(d_model, self.d_k) for _ in range(n_head)])
        self.k_layers = nn.ModuleList([nn.Linear(d_model, self.d_k) for _ in range(n_head)])
        self.v_layer = nn.Linear(d_model, self.d_k)
        self.attention = ScaledDotProductAttention(dropout)
        self.w_h = nn.Linear(self.d_k, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        heads, attns = [], []
        vs = self.v_layer(v)
        for i in range(self.n_head):
            head, attn = self.attention(self.q_layers[i](q), self.k_layers[i](k), vs, mask)
            heads.append(head)
            attns.append(attn)
        head_stack = torch.stack(heads, dim=2)
        attn_stack = torch.stack(attns, dim=2)
        outputs = torch.mean(head_stack, dim=2)  # expect: AMP004
        outputs = self.dropout(self.w_h(outputs))
        return outputs, attn_stack.mean(dim=2)


class TemporalFusionTransformer(nn.Module):
    def __init__(self, n_static_cat, cat_cardinalities, n_past_real, n_future_real,
                 d_model=64, n_head=4, n_quantiles=3, dropout=0.1):
        super().__init__()
        self.static_embeddings = nn.ModuleList([nn.Embedding(c, d_model) for c in cat_cardinalities])
        self.past_proj = nn.ModuleList([nn.Linear(1, d_model) for _ in range(n_past_real)])
        self.future_proj = nn.ModuleList([nn.Linear(1, d_model) for _ in range(n_future_real)])
        self.static_vsn = VariableSelectionNetwork(n_static_cat, d_model, None, dropout)
        self.encoder_vsn = VariableSelectionNetwork(n_past_real, d_model, d_model, dropout)
        self.decoder_vsn = VariableSelectionNetwork(n_future_real, d_model, d_model, dropout)
        self.static_ctx_vs = GatedResidualNetwork(d_model, d_model, d_model, None, dropout)
        self.static_ctx_enrich = GatedResidualNetwork(d_model, d_model, d_model, None, dropout)
        self.static_ctx_h = GatedResidualNetwork(d_model, d_model, d_model, None, dropout)
        self.static_ctx_c = GatedResidualNetwork(d_model, d_model, d_model, None, dropout)
        self.lstm_encoder = nn.LSTM(d_model, d_model, batch_first=True)
        self.lstm_decoder = nn.LSTM(d_model, d_model, batch_first=True)
        self.post_lstm_gate = GatedLinearUnit(d_model, d_model, dropout)
        self.post_lstm_norm = AddNorm(d_model)
        self.static_enrichment = GatedResidualNetwork(d_model, d_model, d_model, d_model, dropout)
        self.attention = InterpretableMultiHeadAttention(n_head, d_model, dropout)
        self.post_attn_gate = GatedLinearUnit(d_model, d_model, dropout)
        self.post_attn_norm = AddNorm(d_model)
        self.pos_wise_ff = GatedResidualNetwork(d_model, d_model, d_model, None, dropout)
        self.pre_output_gate = GatedLinearUnit(d_model, d_model, 0.0)
        self.pre_output_norm = AddNorm(d_model)
        self.output_layer = nn.Linear(d_model, n_quantiles)

    @staticmethod
    def causal_mask(enc_len, dec_len, device):
        total = enc_len + dec_len
        future = torch.ones(dec_len, total, dtype=torch.bool, device=device).triu(enc_len + 1)
        return future

    def forward(self, batch):
        static = torch.stack([emb(batch["static_cat"][:, i]) for i, emb in enumerate(self.static_embeddings)], 1)
        past = torch.stack([p(batch["past_real"][..., i:i + 1]) for i, p in enumerate(self.past_proj)], -2)
        future = torch.stack([p(batch["future_real"][..., i:i + 1]) for i, p in enumerate(self.future_proj)], -2)
        static_vec, static_weights = self.static_vsn(static)
        ctx_vs = self.static_ctx_vs(static_vec)
        enc_in, enc_weights = self.encoder_vsn(past, ctx_vs[:, None].expand(-1, past.size(1), -1))
        dec_in, dec_weights = self.decoder_vsn(future, ctx_vs[:, None].expand(-1, future.size(1), -1))
        h0 = self.static_ctx_h(static_vec).unsqueeze(0)
        c0 = self.static_ctx_c(static_vec).unsqueeze(0)
        enc_out, (h, c) = self.lstm_encoder(enc_in, (h0, c0))
        dec_out, _ = self.lstm_decoder(dec_in, (h, c))
        lstm_in = torch.cat([enc_in, dec_in], dim=1)
        lstm_out = self.post_lstm_norm(self.post_lstm_gate(torch.cat([enc_out, dec_out], dim=1)), lstm_in)
        ctx_enrich = self.static_ctx_enrich(static_vec)[:, None].expand(-1, lstm_out.size(1), -1)
        enriched = self.static_enrichment(lstm_out, ctx_enrich)
        enc_len, dec_len = enc_in.size(1), dec_in.size(1)
        mask = self.causal_mask(enc_len, dec_len, enriched.device).expand(enriched.size(0), -1, -1)
        attn_out, attn_weights = self.attention(enriched[:, enc_len:], enriched, enriched, mask)
        attn_out = self.post_attn_norm(self.post_attn_gate(attn_out), enriched[:, enc_len:])
        out = self.pos_wise_ff(attn_out)
        out = self.pre_output_norm(self.pre_output_gate(out), lstm_out[:, enc_len:])
        return {
            "prediction": self.output_layer(out),
            "attention": attn_weights,
            "static_weights": static_weights,
            "encoder_weights": enc_weights.mean(dim=(0, 1)),
            "decoder_weights": dec_weights.mean(dim=(0, 1)),
        }


class QuantileLoss(nn.Module):
    def __init__(self, quantiles=(0.1, 0.5, 0.9)):
        super().__init__()
        self.register_buffer("q", torch.tensor(quantiles))

    def forward(self, y_pred, target):
        errors = target.unsqueeze(-1) - y_pred
        loss = torch.max((self.q - 1) * errors, self.q * errors)
        return loss.sum(dim=-1).mean()


def train_epoch(model, loader, criterion, optimizer, scaler, accum_steps=2, device="cuda"):
    model.train()
    total = 0.0
    for step, batch in enumerate(loader):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(batch)
        loss = criterion(out["prediction"], batch["target"])  # expect: AMP002
        scaled = scaler.scale(loss / accum_steps)
        scaled.backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()  # expect: AMP006
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        total += loss.item()
    return total / max(len(loader), 1)


@torch.no_grad()
def evaluate(model, loader, criterion, device="cuda"):
    model.eval()
    losses, q_risk = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(batch)
            losses.append(criterion(out["prediction"], batch["target"]).item())
        pred = out["prediction"].float()[..., 1]
        q_risk.append(((pred - batch["target"]).abs().sum() / batch["target"].abs().sum()).item())
    return sum(losses) / len(losses), sum(q_risk) / len(q_risk)


def main(train_loader, val_loader, meta, epochs=30, lr=1e-3, device="cuda"):
    model = TemporalFusionTransformer(**meta).to(device)
    criterion = QuantileLoss().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cuda")
    best_val, patience = 1e9, 0
    for epoch in range(epochs):
        train_loss = train_epoch(model, train_loader, criterion, optimizer, scaler, device=device)
        val_loss, q50 = evaluate(model, val_loader, criterion, device)
        if val_loss < best_val:
            best_val, patience = val_loss, 0
            torch.save(model.state_dict(), "tft_best.pt")
        else:
            patience += 1
            if patience >= 5:
                break
        print(f"epoch {epoch}: train {train_loss:.4f} val {val_loss:.4f} q50-risk {q50:.4f}")
