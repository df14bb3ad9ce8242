"""Multi-label image tagging with label queries (Query2Label-style decoder),
self-training on pseudo-labels from an EMA teacher. Run with `accelerate launch`."""
import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed


class ConvBackbone(nn.Module):
    def __init__(self, dim=256):
        super().__init__()
        chans = [3, 64, 128, 256, dim]
        self.stages = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(a, b, 3, stride=2, padding=1), nn.BatchNorm2d(b), nn.GELU())
             for a, b in zip(chans[:-1], chans[1:])]
        )

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x.flatten(2).transpose(1, 2)


class LabelQueryDecoder(nn.Module):
    def __init__(self, num_labels, dim=256, n_head=8):
        super().__init__()
        self.n_head, self.d_head = n_head, dim // n_head
        self.queries = nn.Parameter(torch.randn(num_labels, dim) * 0.02)
        self.q_proj = nn.Linear(dim, dim)
        self.kv_proj = nn.Linear(dim, 2 * dim)
        self.out_proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, tokens, pad_mask):
        b, n, d = tokens.shape
        q = self.q_proj(self.queries).view(1, -1, self.n_head, self.d_head).transpose(1, 2)
        k, v = self.kv_proj(tokens).view(b, n, 2, self.n_head, self.d_head).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_head)
        attn = attn.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        out = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, -1, d)
        h = self.norm(self.queries + self.out_proj(out))
        return h + self.ffn(h)


class Tagger(nn.Module):
    def __init__(self, num_labels, dim=256):
        super().__init__()
        self.backbone = ConvBackbone(dim)
        self.decoder = LabelQueryDecoder(num_labels, dim)
        self.classifier = nn.Linear(dim, 1)

    def forward(self, images, pad_mask):
        tokens = self.backbone(images)
        return self.classifier(self.decoder(tokens, pad_mask)).squeeze(-1)


@torch.no_grad()
def ema_update(teacher, student, momentum):
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.lerp_(s.detach(), 1.0 - momentum)
    for tb, sb in zip(teacher.buffers(), student.buffers()):
        tb.copy_(sb)


@torch.no_grad()
def evaluate(model, loader, accelerator):
    model.eval()
    hits, total = 0.0, 0.0
    for images, pad_mask, labels, _ in loader:
        logits = model(images, pad_mask)
        preds = (logits.float().sigmoid() > 0.5).float()
        preds, labels = accelerator.gather_for_metrics((preds, labels))
        hits += (preds * labels).sum().item()
        total += labels.sum().item()
    model.train()
    return hits / max(total, 1.0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-labels", type=int, default=80)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--pseudo-weight", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="tagger_best_fp16.pt")
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)
    model = Tagger(args.num_labels)
    teacher = Tagger(args.num_labels)
    teacher.load_state_dict(model.state_dict())
    teacher.requires_grad_(False)
    teacher.eval()

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    train_loader = torch.load("coco_multilabel_train.pt")
    val_loader = torch.load("coco_multilabel_val.pt")
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * len(train_loader))
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler
    )
    teacher.to(accelerator.device)

    best_recall = -1e9
    for epoch in range(args.epochs):
        model.train()
        for images, pad_mask, labels, label_known in train_loader:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                t_probs = torch.sigmoid(teacher(images, pad_mask))
                class_conf = t_probs.mean(dim=0)  # expect: AMP004
                pseudo = (t_probs / (class_conf + 1e-10)).clamp(max=1.0)  # expect: AMP011
            targets = torch.where(label_known, labels, pseudo.float())
            weights = torch.where(label_known, torch.ones_like(labels), torch.full_like(labels, args.pseudo_weight))

            with accelerator.accumulate(model):
                with accelerator.autocast():
                    probs = torch.sigmoid(model(images, pad_mask))
                    loss = F.binary_cross_entropy(probs, targets, weight=weights)  # expect: AMP003
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            if accelerator.sync_gradients:
                ema_update(teacher, accelerator.unwrap_model(model), args.ema)

        recall = evaluate(model, val_loader, accelerator)
        accelerator.print(f"epoch {epoch} recall@0.5 {recall:.4f} loss {loss.item():.4f}")
        if recall > best_recall:
            best_recall = recall
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            accelerator.save(copy.deepcopy(unwrapped).half().state_dict(), args.out)

    accelerator.end_training()


if __name__ == "__main__":
    main()
