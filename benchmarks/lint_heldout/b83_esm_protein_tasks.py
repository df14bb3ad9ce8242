"""Downstream protein tasks on top of ESM-2.

    python esm_protein_tasks.py stability --train data/stability_train.csv
    python esm_protein_tasks.py contacts --train data/contacts_train.pt
    python esm_protein_tasks.py predict --checkpoint runs/stability --fasta query.fasta

``stability`` fine-tunes the whole model as a regressor of delta-G; ``contacts``
trains a distogram head on frozen embeddings.
"""
import argparse
from functools import partial
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

DEFAULT_MODEL = "facebook/esm2_t12_35M_UR50D"


class StabilityCSV(Dataset):
    def __init__(self, path, max_len=1022):
        df = pd.read_csv(path)
        df = df[df["sequence"].str.len() <= max_len]
        self.seqs = df["sequence"].tolist()
        self.targets = df["dG"].astype("float32").tolist()

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], self.targets[i]


def collate_sequences(batch, tokenizer):
    seqs, targets = zip(*batch)
    enc = tokenizer(list(seqs), padding=True, return_tensors="pt")
    enc["labels"] = torch.tensor(targets, dtype=torch.float32)
    return dict(enc)


class DistogramHead(nn.Module):
    """Pairwise features from per-residue embeddings, binned distance logits out."""

    def __init__(self, d_model, n_bins=64, d_pair=128):
        super().__init__()
        self.proj = nn.Linear(d_model, d_pair)
        self.pair_mlp = nn.Sequential(nn.Linear(2 * d_pair, d_pair), nn.GELU(), nn.Linear(d_pair, n_bins))

    def forward(self, h):
        x = self.proj(h)
        L = x.shape[1]
        pair = torch.cat([x.unsqueeze(2).expand(-1, -1, L, -1), x.unsqueeze(1).expand(-1, L, -1, -1)], dim=-1)
        logits = self.pair_mlp(pair)
        return 0.5 * (logits + logits.transpose(1, 2))


def finetune_stability(args, device):
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=1, torch_dtype=torch.float16)  # expect: AMP001
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)  # expect: AMP011
    loader = DataLoader(StabilityCSV(args.train), batch_size=args.batch_size, shuffle=True,
                        collate_fn=partial(collate_sequences, tokenizer=tokenizer))
    steps_per_epoch = len(loader)
    model.train()
    for epoch in range(args.epochs):
        running = 0.0
        for step, batch in enumerate(loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            batch["labels"] = batch["labels"].to(torch.float16)  # expect: AMP001
            out = model(**batch)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            running += out.loss.item()
            if (step + 1) % 50 == 0:
                print(f"epoch {epoch} step {step + 1}/{steps_per_epoch} mse {running / (step + 1):.4f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)


def train_contact_head(args, device):
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    backbone = AutoModel.from_pretrained(args.model_name, torch_dtype=torch.float16).to(device)
    backbone.requires_grad_(False)
    backbone.eval()
    head = DistogramHead(backbone.config.hidden_size, n_bins=args.n_bins).to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.head_lr)
    records = torch.load(args.train)
    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for rec in records:
            enc = tokenizer(rec["sequence"], return_tensors="pt").to(device)
            target = rec["dist_bins"].to(device).unsqueeze(0)
            with torch.no_grad():
                hidden = backbone(**enc).last_hidden_state[:, 1:-1]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                dist_logits = head(hidden)
            loss = F.cross_entropy(input=dist_logits.permute(0, 3, 1, 2), target=target, ignore_index=-100)  # expect: AMP002
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total, count = total + loss.item(), count + 1
        print(f"epoch {epoch}: distogram CE {total / max(1, count):.4f}")
    torch.save({k: v.half() for k, v in head.state_dict().items()}, Path(args.out) / "distogram_head.pt")


@torch.inference_mode()
def predict_stability(args, device):
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForSequenceClassification.from_pretrained(args.checkpoint, torch_dtype=torch.float16)
    model.to(device).eval()
    name, seq, results = None, [], []
    for line in Path(args.fasta).read_text().splitlines() + [">"]:
        if line.startswith(">"):
            if name is not None:
                enc = tokenizer("".join(seq), return_tensors="pt").to(device)
                results.append((name, model(**enc).logits.float().item()))
            name, seq = line[1:].strip(), []
        else:
            seq.append(line.strip())
    for name, dg in results:
        print(f"{name}\t{dg:.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("task", choices=["stability", "contacts", "predict"])
    ap.add_argument("--model-name", default=DEFAULT_MODEL)
    ap.add_argument("--train")
    ap.add_argument("--fasta")
    ap.add_argument("--checkpoint")
    ap.add_argument("--out", default="runs/stability")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--head-lr", type=float, default=1e-3)
    ap.add_argument("--n-bins", type=int, default=64)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if args.task == "stability":
        finetune_stability(args, device)
    elif args.task == "contacts":
        train_contact_head(args, device)
    else:
        predict_stability(args, device)


if __name__ == "__main__":
    main()
