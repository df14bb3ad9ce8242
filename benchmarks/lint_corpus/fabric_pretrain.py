"""Language-model pretraining with Lightning Fabric (precision handled by Fabric)."""
import math
import time

import lightning as L
import torch
import torch.nn.functional as F


def get_lr(it, warmup_iters=2000, lr_decay_iters=600000, learning_rate=6e-4, min_lr=6e-5):
    if it < warmup_iters:
        return learning_rate * it / warmup_iters
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def validate(fabric, model, val_data, eval_iters=100):
    fabric.print("Validating ...")
    model.eval()
    losses = torch.zeros(eval_iters, device=fabric.device)
    for k, (input_ids, targets) in enumerate(val_data):
        if k >= eval_iters:
            break
        logits = model(input_ids)
        losses[k] = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    model.train()
    return losses.mean()


def train(fabric, model, optimizer, train_data, val_data, max_iters=600000, grad_accum=5, grad_clip=1.0):
    model.train()
    iter_num = 0
    t0 = time.time()
    for input_ids, targets in train_data:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        is_accumulating = (iter_num + 1) % grad_accum != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            fabric.backward(loss / grad_accum)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=grad_clip)
            optimizer.step()
            optimizer.zero_grad()
        if iter_num % 1000 == 0:
            val_loss = validate(fabric, model, val_data)
            fabric.print(f"iter {iter_num}: val loss {val_loss.item():.4f}")
        iter_num += 1
        if iter_num >= max_iters:
            break
    fabric.print(f"done in {time.time() - t0:.1f}s")


def main(model_factory, data_factory):
    fabric = L.Fabric(accelerator="cuda", devices=4, strategy="ddp", precision="bf16-mixed")
    fabric.launch()
    fabric.seed_everything(1337 + fabric.global_rank)
    with fabric.init_module():
        model = model_factory()
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    train_data, val_data = data_factory()
    train_data, val_data = fabric.setup_dataloaders(train_data, val_data)
    train(fabric, model, optimizer, train_data, val_data)
    fabric.save("out/final.ckpt", {"model": model, "optimizer": optimizer})
