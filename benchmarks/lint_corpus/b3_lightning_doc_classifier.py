"""LightningModule for long-document classification: GloVe embeddings, a small transformer encoder, optional KD."""
import copy
import math

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class MaskedSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.h = n_heads
        self.dk = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dk).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.dk)
        scores.masked_fill_(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.drop(F.softmax(scores, dim=-1))
        out = torch.matmul(attn, v).transpose(1, 2).reshape(B, T, -1)
        return self.out(out)


class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff=1024, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MaskedSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))

    def forward(self, x, pad_mask):
        x = x + self.attn(self.ln1(x), pad_mask)
        return x + self.ff(self.ln2(x))


class DocClassifier(L.LightningModule):
    def __init__(self, vectors, num_classes, d_model=300, n_layers=4, n_heads=6, lr=3e-4, teacher=None):
        super().__init__()
        self.save_hyperparameters(ignore=["vectors", "teacher"])
        # fine-tune the 400k x 300 GloVe table; keep it in fp16 so it fits next to the encoder
        self.embedding = nn.Embedding.from_pretrained(vectors, freeze=False, padding_idx=0).half()  # expect: AMP001
        self.pos = nn.Parameter(torch.zeros(1, 4096, d_model))
        self.layers = nn.ModuleList([EncoderLayer(d_model, n_heads) for _ in range(n_layers)])
        self.pool_proj = nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, num_classes)
        if teacher is not None:
            self.teacher = teacher.half().eval()
            self.teacher.requires_grad_(False)
        else:
            self.teacher = None

    def forward(self, tokens):
        pad_mask = tokens == 0
        x = self.embedding(tokens).float() + self.pos[:, : tokens.size(1)]
        for layer in self.layers:
            x = layer(x, pad_mask)
        h = torch.tanh(self.pool_proj(x))
        # max-pool over the valid tokens only
        pooled = h.masked_fill(pad_mask.unsqueeze(-1), -1e5).max(dim=1).values  # expect: AMP007
        return self.head(pooled)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits, labels, label_smoothing=0.05)
        if self.teacher is not None:
            with torch.no_grad():
                t_logits = self.teacher(tokens).float()
            kd = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(t_logits, -1),
                          log_target=True, reduction="batchmean")
            loss = loss + 0.5 * kd
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self(tokens)
        with torch.autocast(device_type="cuda", enabled=False):
            probs = logits.float().softmax(-1)
            conf, pred = probs.max(-1)
            acc = (pred == labels).float().mean()
            ece = torch.abs(conf - (pred == labels).float()).mean()
        self.log_dict({"val/acc": acc, "val/ece": ece}, prog_bar=True)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0]).float().softmax(-1)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for n, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim == 1 or n.startswith("embedding") else decay).append(p)
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr, eps=1e-6)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr,
                                                        total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def export_half(model, path):
    serving = copy.deepcopy(model).half().eval()
    serving.teacher = None
    torch.save(serving.state_dict(), path)


if __name__ == "__main__":
    vectors = torch.load("glove.840B.300d.pt")
    tokens = torch.load("train_tokens.pt")
    labels = torch.load("train_labels.pt")
    n_val = len(tokens) // 10
    train_loader = DataLoader(TensorDataset(tokens[n_val:], labels[n_val:]), batch_size=16, shuffle=True, num_workers=4)
    val_loader = DataLoader(TensorDataset(tokens[:n_val], labels[:n_val]), batch_size=64, num_workers=4)

    model = DocClassifier(vectors, num_classes=20)
    trainer = L.Trainer(max_epochs=10, accelerator="gpu", devices=1, precision="16-mixed",
                        gradient_clip_val=1.0, accumulate_grad_batches=2, log_every_n_steps=25)
    trainer.fit(model, train_loader, val_loader)
    export_half(model, "doc_classifier_fp16.pt")
