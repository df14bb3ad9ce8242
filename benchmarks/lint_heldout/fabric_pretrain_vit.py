"""ViT pretraining with Lightning Fabric (precision handled by Fabric)."""
import argparse

import lightning as L
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch.utils.data import DataLoader

from ssl_data import MaskedImageDataset


def build(args):
    model = VisionTransformer(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, num_classes=0)
    head = torch.nn.Linear(768, 16 * 16 * 3)
    return model, head


def main(args):
    fabric = L.Fabric(accelerator="cuda", devices=args.devices, precision="16-mixed")
    fabric.launch()
    model, head = build(args)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.half_weights:
        # "saves memory" - added by a contributor, breaks fp32 master weights under 16-mixed
        model = model.half()
    params = list(model.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=1.5e-4, betas=(0.9, 0.95), weight_decay=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    head = fabric.setup_module(head)
    loader = fabric.setup_dataloaders(DataLoader(MaskedImageDataset(args.data), batch_size=128, num_workers=8))

    for epoch in range(args.epochs):
        for step, (imgs, mask, target) in enumerate(loader):
            tokens = model.forward_features(imgs)
            pred = head(tokens[:, 1:])
            loss = (F.mse_loss(pred, target, reduction="none").mean(-1) * mask).sum() / mask.sum()
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                fabric.print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
        fabric.save(f"ckpt_{epoch}.ckpt", {"model": model, "optimizer": optimizer})


def linear_probe(backbone, loader, classes=1000, epochs=10):
    """Linear probing on frozen features (plain PyTorch, fp16 autocast)."""
    backbone.eval().requires_grad_(False)
    probe = torch.nn.Linear(768, classes).cuda()
    opt = torch.optim.SGD(probe.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    for _ in range(epochs):
        for x, y in loader:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                feats = backbone.forward_features(x.cuda())[:, 0]
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(probe(feats), y.cuda())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return probe


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/in1k")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--half-weights", action="store_true")
    main(p.parse_args())
