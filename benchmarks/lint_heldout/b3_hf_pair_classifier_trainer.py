"""Sentence-pair classifier fine-tuning: a Hugging Face Trainer subclass plus a hand-written R-Drop loop."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import (
    AutoModel,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)


class MeanPooling(nn.Module):
    def forward(self, last_hidden_state, attention_mask):
        mask = attention_mask.unsqueeze(-1).expand(last_hidden_state.size()).float()
        sum_embeddings = torch.sum(last_hidden_state * mask, 1)
        sum_mask = torch.clamp(mask.sum(1), min=1e-9)
        return sum_embeddings / sum_mask


class MaxPooling(nn.Module):
    def forward(self, last_hidden_state, attention_mask):
        embeddings = last_hidden_state.clone()
        embeddings[attention_mask == 0] = -1e9  # expect: AMP007
        return torch.max(embeddings, 1).values


class PairClassifier(nn.Module):
    def __init__(self, name, num_labels, pooling="mean"):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        hidden = self.encoder.config.hidden_size
        self.pool = MeanPooling() if pooling == "mean" else MaxPooling()
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        pooled = self.pool(out.last_hidden_state, attention_mask)
        logits = self.classifier(self.dropout(pooled))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class WeightedLossTrainer(Trainer):
    def __init__(self, *args, class_weights=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.class_weights = class_weights

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs["logits"]
        loss_fct = nn.CrossEntropyLoss(weight=self.class_weights.to(logits.device))
        loss = loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self):
        # the encoder is large: keep weights and optimizer state in half precision
        model = self.model.half()  # expect: AMP001
        no_decay = ["bias", "LayerNorm.weight"]
        groups = [
            {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
             "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=self.args.learning_rate)  # expect: AMP011
        return self.optimizer


def train_rdrop(model, train_loader, args):
    """R-Drop: two stochastic forward passes, CE on both plus a symmetric-ish KL between them."""
    device = torch.device("cuda")
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    num_steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * num_steps), num_steps)
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    model.train()
    for epoch in range(args.epochs):
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                out1 = model(**batch)
                out2 = model(**batch)
                ce = 0.5 * (out1["loss"] + out2["loss"])
            kl = F.kl_div(F.log_softmax(out1["logits"], dim=-1), F.softmax(out2["logits"], dim=-1), reduction="batchmean")  # expect: AMP002
            loss = ce + args.rdrop_alpha * kl
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if step % 100 == 0:
                print(f"epoch {epoch} step {step}: ce {ce.item():.4f} kl {kl.item():.4f}")


@torch.no_grad()
def predict(model, loader, device="cuda"):
    model = model.half().eval().to(device)
    preds = []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items() if k != "labels"}
        logits = model(**batch)["logits"]
        preds.append(logits.float().softmax(-1).cpu())
    return torch.cat(preds)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="microsoft/deberta-v3-base")
    parser.add_argument("--pooling", default="mean", choices=["mean", "max"])
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rdrop", action="store_true")
    parser.add_argument("--rdrop_alpha", type=float, default=4.0)
    parser.add_argument("--output_dir", default="out")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    raw = load_dataset("glue", "mrpc")

    def tokenize(ex):
        return tokenizer(ex["sentence1"], ex["sentence2"], truncation=True, max_length=256)

    ds = raw.map(tokenize, batched=True, remove_columns=["sentence1", "sentence2", "idx"]).rename_column("label", "labels")
    collator = DataCollatorWithPadding(tokenizer)
    model = PairClassifier(args.model_name, num_labels=2, pooling=args.pooling)

    if args.rdrop:
        loader = DataLoader(ds["train"], batch_size=32, shuffle=True, collate_fn=collator)
        train_rdrop(model, loader, args)
    else:
        targs = TrainingArguments(output_dir=args.output_dir, learning_rate=args.lr, num_train_epochs=args.epochs,
                                  per_device_train_batch_size=32, fp16=True, eval_strategy="epoch",
                                  weight_decay=0.01, warmup_ratio=0.06, report_to="none")
        counts = torch.bincount(torch.tensor(ds["train"]["labels"]), minlength=2).float()
        trainer = WeightedLossTrainer(model=model, args=targs, train_dataset=ds["train"],
                                      eval_dataset=ds["validation"], data_collator=collator,
                                      class_weights=counts.sum() / (2.0 * counts))
        trainer.train()

    val_loader = DataLoader(ds["validation"], batch_size=64, collate_fn=collator)
    probs = predict(model, val_loader)
    acc = (probs.argmax(-1) == torch.tensor(ds["validation"]["labels"])).float().mean()
    print(f"validation accuracy: {acc:.4f}")


if __name__ == "__main__":
    main()
