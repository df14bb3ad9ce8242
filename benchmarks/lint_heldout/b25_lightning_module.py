"""Intent classifier as a LightningModule: a small Transformer encoder with a
squared-ReLU MLP and an attention-pooling head. Automatic optimization, 16-mixed
precision, and a custom `configure_gradient_clipping` with a warm-up schedule."""
import math

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint


class _SquaredReLU(torch.autograd.Function):
    """relu(x)**2 with a hand-written backward that saves only the input."""

    @staticmethod
    @torch.cuda.amp.custom_fwd  # expect: AMP009
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.relu(x).square()

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return grad_out * 2.0 * F.relu(x)


class MaskedSelfAttention(nn.Module):
    def __init__(self, d_model, n_head, dropout=0.1):
        super().__init__()
        self.n_head, self.d_head = n_head, d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, key_mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, self.d_head).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_head)
        scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = self.drop(scores.softmax(dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, d_model, n_head, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MaskedSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, key_mask):
        x = x + self.attn(self.ln1(x), key_mask)
        h = _SquaredReLU.apply(self.fc1(self.ln2(x)))
        return x + self.drop(self.fc2(h))


class AttentionPoolHead(nn.Module):
    """Pools token states into one vector; always computed in fp16 so that the
    exported head matches the serving kernels."""

    def __init__(self, d_model, num_labels):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.score = nn.Linear(d_model, 1)
        self.out = nn.Linear(d_model, num_labels)

    @torch.autocast("cuda", dtype=torch.float16)
    def forward(self, hidden, key_mask):
        h = torch.tanh(self.dense(hidden))
        h = h - h.mean(dim=-1, keepdim=True)  # expect: AMP004
        h = h / (h.abs().amax(dim=-1, keepdim=True) + 1e-9)  # expect: AMP011
        scores = self.score(h).squeeze(-1)
        scores = scores.masked_fill(~key_mask, -1e9)  # expect: AMP007
        weights = torch.softmax(scores, dim=-1)
        pooled = torch.bmm(weights.unsqueeze(1), h).squeeze(1)
        return self.out(pooled).float()


class IntentClassifier(pl.LightningModule):
    def __init__(self, vocab_size=32000, d_model=384, n_head=6, n_layer=6, num_labels=150,
                 lr=3e-4, warmup_epochs=1, max_len=128):
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        self.blocks = nn.ModuleList([Block(d_model, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = AttentionPoolHead(d_model, num_labels)
        self.register_buffer("class_prior", torch.full((num_labels,), 1.0 / num_labels))

    def forward(self, input_ids, attention_mask):
        key_mask = attention_mask.bool()
        x = self.tok(input_ids) + self.pos[:, : input_ids.size(1)]
        for block in self.blocks:
            x = block(x, key_mask)
        return self.head(self.ln_f(x), key_mask)

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        with torch.autocast(device_type="cuda", enabled=False):
            # logit adjustment for the long-tailed intents (Menon et al.)
            log_prior = torch.log(self.class_prior.float() + 1e-12)
            loss = F.cross_entropy(logits.float() + log_prior, batch["labels"], label_smoothing=0.1)
        acc = (logits.argmax(dim=-1) == batch["labels"]).float().mean()
        self.log_dict({"train/loss": loss, "train/acc": acc}, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits, batch["labels"])
        acc = (logits.argmax(dim=-1) == batch["labels"]).float().mean()
        self.log_dict({"val/loss": loss, "val/acc": acc}, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (no_decay if p.ndim < 2 or "ln" in name else decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr, betas=(0.9, 0.98), eps=1e-6,
        )
        steps = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=steps, pct_start=0.06)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # Lightning's precision plugin has already unscaled the gradients here.
        if self.current_epoch < self.hparams.warmup_epochs:
            torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.5)
        else:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                                gradient_clip_algorithm=gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["head_fp16"] = {k: v.half() for k, v in self.head.state_dict().items()}


class IntentDataModule(pl.LightningDataModule):
    def __init__(self, path="clinc150_tokenized.pt", batch_size=64):
        super().__init__()
        self.path, self.batch_size = path, batch_size

    def setup(self, stage=None):
        data = torch.load(self.path)
        self.train_set, self.val_set = data["train"], data["val"]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=4)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val_set, batch_size=self.batch_size * 2, num_workers=4)


def main():
    pl.seed_everything(7)
    model = IntentClassifier()
    trainer = pl.Trainer(
        max_epochs=20,
        accelerator="gpu",
        devices=1,
        precision="16-mixed",
        gradient_clip_val=1.0,
        callbacks=[ModelCheckpoint(monitor="val/acc", mode="max"), LearningRateMonitor("step")],
    )
    trainer.fit(model, datamodule=IntentDataModule())


if __name__ == "__main__":
    main()
