"""Extractive QA with a small transformer encoder, trained with PyTorch Lightning.

Automatic optimization: Lightning's precision plugin ("16-mixed") owns autocast and the
GradScaler, so nothing in here turns autocast on or scales a loss by hand.
A frozen teacher (distillation) is kept in fp16 to save memory.
"""
import argparse
import math

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.dh = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.dh)
        scores = scores.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = self.drop(scores.softmax(dim=-1))
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, -1))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = MultiHeadSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x, pad_mask):
        x = x + self.attn(self.ln1(x), pad_mask)
        return x + self.mlp(self.ln2(x))


class QAEncoder(nn.Module):
    def __init__(self, vocab_size, dim=512, depth=8, heads=8, max_len=512):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList([EncoderLayer(dim, heads) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(dim)
        self.qa_outputs = nn.Linear(dim, 2)
        self.has_answer = nn.Linear(dim, 1)

    def forward(self, input_ids, attention_mask, context_mask):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        h = self.tok(input_ids) + self.pos(pos)[None]
        pad_mask = attention_mask == 0
        for layer in self.layers:
            h = layer(h, pad_mask)
        h = self.ln_f(h)
        start_logits, end_logits = self.qa_outputs(h).unbind(dim=-1)
        start_logits = start_logits.masked_fill(~context_mask, -1e9)  # expect: AMP007
        end_logits = end_logits.masked_fill(~context_mask, -1e9)  # expect: AMP007
        # mean over all positions; the [CLS] token alone was worse on SQuAD v2
        pooled = h.mean(dim=1)
        return start_logits, end_logits, self.has_answer(pooled).squeeze(-1)


def build_teacher(args):
    teacher = QAEncoder(args.vocab_size, dim=1024, depth=24, heads=16)
    teacher.load_state_dict(torch.load(args.teacher_ckpt, map_location="cpu"))
    return teacher


class SpanQAModule(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.save_hyperparameters(vars(args))
        self.model = QAEncoder(args.vocab_size, dim=args.dim, depth=args.depth, heads=args.heads)
        self.teacher = None
        if args.teacher_ckpt:
            self.teacher = build_teacher(args).half().eval()
            self.teacher.requires_grad_(False)
        self.T = args.kd_temperature

    def forward(self, batch):
        return self.model(batch["input_ids"], batch["attention_mask"], batch["context_mask"])

    def on_train_epoch_start(self):
        if self.teacher is not None:
            self.teacher.eval()

    def training_step(self, batch, batch_idx):
        start_logits, end_logits, ans_logit = self(batch)
        loss = (
            F.cross_entropy(start_logits, batch["start_positions"])
            + F.cross_entropy(end_logits, batch["end_positions"])
        ) / 2
        loss = loss + F.binary_cross_entropy_with_logits(ans_logit, batch["has_answer"].float())
        if self.teacher is not None:
            with torch.no_grad():
                t_start, t_end, _ = self.teacher(
                    batch["input_ids"], batch["attention_mask"], batch["context_mask"]
                )
            kd = F.kl_div(
                F.log_softmax(start_logits / self.T, dim=-1),
                F.softmax(t_start.float() / self.T, dim=-1),
                reduction="batchmean",
            ) + F.kl_div(
                F.log_softmax(end_logits / self.T, dim=-1),
                F.softmax(t_end.float() / self.T, dim=-1),
                reduction="batchmean",
            )
            loss = loss + self.hparams.kd_weight * (self.T ** 2) * kd
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def best_spans(self, start_logits, end_logits, context_mask, max_answer_len=30):
        # span scoring in fp32: the sum of two fp16 logits loses the tie-breaks we care about
        with torch.cuda.amp.autocast(enabled=False):  # expect: AMP009
            span = (start_logits[:, :, None] + end_logits[:, None, :]).float()
            n = span.size(-1)
            idx = torch.arange(n, device=span.device)
            valid = (idx[None, :] >= idx[:, None]) & (idx[None, :] - idx[:, None] < max_answer_len)
            valid = valid[None] & context_mask[:, :, None] & context_mask[:, None, :]
            span[~valid] = -1e9
            best = span.flatten(1).argmax(dim=-1)
        return best // n, best % n

    def validation_step(self, batch, batch_idx):
        start_logits, end_logits, ans_logit = self(batch)
        s, e = self.best_spans(start_logits, end_logits, batch["context_mask"])
        exact = ((s == batch["start_positions"]) & (e == batch["end_positions"])).float().mean()
        self.log("val/exact", exact, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            (no_decay if p.ndim < 2 or "ln" in n else decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            eps=1e-8,
        )
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches, pct_start=0.1
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # the precision plugin has already unscaled the gradients when this hook runs
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")

    def on_before_optimizer_step(self, optimizer):
        if self.global_step % 100 == 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))
            self.log("train/grad_norm", norm)


def train(args):
    from data import SquadDataModule  # project-local

    dm = SquadDataModule(args.data_dir, batch_size=args.batch_size, max_len=384)
    model = SpanQAModule(args)
    if args.init_from:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu")["state_dict"], strict=False)
    model = model.half()  # expect: AMP001
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=args.gpus,
        precision="16-mixed",
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accum,
        callbacks=[ModelCheckpoint(monitor="val/exact", mode="max"), LearningRateMonitor()],
    )
    trainer.fit(model, datamodule=dm)


def export_onnx(ckpt_path, out_path, seq_len=384):
    model = SpanQAModule.load_from_checkpoint(ckpt_path).half().eval()
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    mask = torch.ones(1, seq_len, dtype=torch.long)
    ctx = torch.ones(1, seq_len, dtype=torch.bool)
    torch.onnx.export(model.model, (ids, mask, ctx), out_path, opset_version=17)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/squad2")
    p.add_argument("--vocab_size", type=int, default=30522)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--teacher_ckpt", default="")
    p.add_argument("--kd_temperature", type=float, default=2.0)
    p.add_argument("--kd_weight", type=float, default=0.5)
    p.add_argument("--init_from", default="")
    p.add_argument("--export", default="")
    args = p.parse_args()
    if args.export:
        export_onnx(args.init_from, args.export)
    else:
        train(args)
