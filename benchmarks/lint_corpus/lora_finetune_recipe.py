"""LoRA fine-tuning recipe: frozen base model in bf16, trainable adapters in fp32."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank=8, alpha=16):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.zeros(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, x):
        return self.base(x) + (x.to(self.lora_a.dtype) @ self.lora_a.t() @ self.lora_b.t()).to(x.dtype) * self.scaling


def inject_lora(model, targets=("q_proj", "v_proj"), rank=8):
    for name, module in model.named_children():
        if isinstance(module, nn.Linear) and name in targets:
            setattr(model, name, LoRALinear(module, rank))
        else:
            inject_lora(module, targets, rank)
    return model


def train(model, loader, epochs=1, lr=2e-4, device="cuda"):
    model.requires_grad_(False)
    model.to(device, dtype=torch.bfloat16)
    model = inject_lora(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(epochs):
        for batch in loader:
            input_ids = batch["input_ids"].to(device)
            labels = batch["labels"].to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def train_full_bf16(model, loader, lr=1e-5, device="cuda"):
    """Full fine-tuning in pure bf16 (no fp32 master weights)."""
    model = model.to(device=device, dtype=torch.bfloat16)  # expect: AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for batch in loader:
        out = model(batch["input_ids"].to(device), labels=batch["labels"].to(device))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def merge_and_save(model, path):
    for module in model.modules():
        if isinstance(module, LoRALinear):
            delta = (module.lora_b @ module.lora_a) * module.scaling
            module.base.weight.data += delta.to(module.base.weight.dtype)
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, path)
