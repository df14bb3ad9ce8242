"""Post-training utilities for ViT-B/16 LoRA fine-tunes.

    python vit_lora_tools.py merge  --adapter runs/vit_lora/best_adapter.pt --num-classes 102 --out merged.pt
    python vit_lora_tools.py report --merged merged.pt --num-classes 102
    python vit_lora_tools.py probe  --merged merged.pt --num-classes 102 --data /data/flowers102
    python vit_lora_tools.py recal  --merged merged.pt --num-classes 102 --data /data/flowers102
"""
import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.models import ViT_B_16_Weights, vit_b_16


def load_base(num_classes, pretrained=False):
    model = vit_b_16(weights=ViT_B_16_Weights.IMAGENET1K_V1 if pretrained else None)
    model.heads = nn.Linear(model.hidden_dim, num_classes)
    return model


def make_loader(root, split, batch_size=128, shuffle=False):
    ds = datasets.ImageFolder(os.path.join(root, split), ViT_B_16_Weights.IMAGENET1K_V1.transforms())
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=8, pin_memory=True)


@torch.no_grad()
def merge_adapter(model, adapter_state, alpha=16.0):
    """Fold the lora_A/lora_B pairs saved by the training script into the base MLP weights."""
    merged = 0
    for i, block in enumerate(model.encoder.layers):
        for j in (0, 3):
            prefix = f"encoder.layers.encoder_layer_{i}.mlp.{j}"
            A, B = adapter_state.get(f"{prefix}.lora_A"), adapter_state.get(f"{prefix}.lora_B")
            if A is None or B is None:
                continue
            block.mlp[j].weight += (B.float() @ A.float()) * (alpha / A.size(0))
            merged += 1
    model.heads.weight.copy_(adapter_state["heads.weight"])
    model.heads.bias.copy_(adapter_state["heads.bias"])
    return merged


@torch.no_grad()
def fp16_error_report(model, top_k=10):
    """Per-layer error introduced by storing the merged weights in half precision."""
    rows = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight.detach().float()
        w16 = w.to(torch.float16)
        abs_err = (w16.float() - w).abs()
        rel_err = abs_err / (w16.abs() + 1e-8)  # expect: AMP011
        energy_ratio = w16.pow(2).mean().item() / w.pow(2).mean().item()  # expect: AMP004
        flushed = int(torch.count_nonzero((w16 == 0) & (w != 0)))
        rows.append((name, abs_err.max().item(), rel_err.max().item(), energy_ratio, flushed))
    rows.sort(key=lambda r: r[1], reverse=True)
    print(f"{'layer':48s} {'max abs':>10s} {'max rel':>10s} {'energy':>8s} {'flushed':>8s}")
    for name, a, r, e, f in rows[:top_k]:
        print(f"{name:48s} {a:10.3e} {r:10.3e} {e:8.5f} {f:8d}")
    return rows


def export_half(model, path):
    """Write a compact fp16 copy of the merged model for serving."""
    compact = copy.deepcopy(model).half().eval()
    torch.save(compact.state_dict(), path)
    print(f"wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")


@torch.no_grad()
def extract_features(model, loader, device):
    backbone = copy.deepcopy(model)
    backbone.heads = nn.Identity()
    backbone = backbone.half().to(device).eval()
    feats, labels = [], []
    for images, targets in loader:
        feats.append(backbone(images.to(device, non_blocking=True).half()))
        labels.append(targets.to(device))
    return torch.cat(feats), torch.cat(labels)


def fit_linear_probe(feats, labels, num_classes, epochs=100, lr=1e-3, batch_size=1024):
    device = feats.device
    probe = nn.Linear(feats.size(1), num_classes).to(device).half()  # expect: AMP001
    opt = torch.optim.Adam(probe.parameters(), lr=lr, eps=1e-8)  # expect: AMP011
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    for _ in range(epochs):
        perm = torch.randperm(feats.size(0), device=device)
        for start in range(0, feats.size(0), batch_size):
            idx = perm[start:start + batch_size]
            loss = F.cross_entropy(probe(feats[idx]).float(), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()
    return probe


def recalibrate_norms(model, loader, device, steps=200, lr=1e-4):
    """Tune only the LayerNorm affine parameters of the merged model on a small labelled split."""
    model.requires_grad_(False)
    norm_params = []
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.requires_grad_(True)
            norm_params += [m.weight, m.bias]
    opt = torch.optim.AdamW(norm_params, lr=lr, weight_decay=0.0)
    model.to(device).train()
    it = iter(loader)
    for step in range(steps):
        try:
            images, labels = next(it)
        except StopIteration:
            it = iter(loader)
            images, labels = next(it)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
            loss = F.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"recal step {step}: loss {loss.item():.4f}")
    return model.eval()


@torch.inference_mode()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for images, labels in loader:
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(images.to(device, non_blocking=True))
        correct += (logits.argmax(-1).cpu() == labels).sum().item()
        total += labels.numel()
    return correct / max(total, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["merge", "report", "probe", "recal"])
    parser.add_argument("--adapter")
    parser.add_argument("--merged")
    parser.add_argument("--num-classes", type=int, required=True)
    parser.add_argument("--data")
    parser.add_argument("--out", default="merged.pt")
    args = parser.parse_args()
    device = torch.device("cuda")

    if args.command == "merge":
        model = load_base(args.num_classes, pretrained=True)
        ckpt = torch.load(args.adapter, map_location="cpu")
        n = merge_adapter(model, ckpt["adapter"], alpha=ckpt["config"]["alpha"])
        print(f"merged {n} adapters")
        torch.save(model.state_dict(), args.out)
        export_half(model, args.out.replace(".pt", "_fp16.pt"))
        return

    model = load_base(args.num_classes)
    model.load_state_dict(torch.load(args.merged, map_location="cpu"))
    if args.command == "report":
        fp16_error_report(model)
    elif args.command == "probe":
        train_feats, train_labels = extract_features(model, make_loader(args.data, "train"), device)
        val_feats, val_labels = extract_features(model, make_loader(args.data, "val"), device)
        probe = fit_linear_probe(train_feats, train_labels, args.num_classes)
        with torch.no_grad():
            acc = (probe(val_feats).argmax(-1) == val_labels).float().mean().item()
        print(f"linear probe val acc {acc:.4f}")
    elif args.command == "recal":
        before = evaluate(model.to(device), make_loader(args.data, "val"), device)
        model = recalibrate_norms(model, make_loader(args.data, "train", shuffle=True), device)
        after = evaluate(model, make_loader(args.data, "val"), device)
        print(f"val acc {before:.4f} -> {after:.4f}")
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
