"""A hand-written fp16 loop with static loss scaling and fp32 master weights (old-school)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

STATIC_LOSS_SCALE = 128.0


def prep_param_lists(model):
    model_params = [p for p in model.parameters() if p.requires_grad]
    master_params = [p.detach().clone().float() for p in model_params]
    for p in master_params:
        p.requires_grad = True
    return model_params, master_params


def model_grads_to_master_grads(model_params, master_params):
    for model, master in zip(model_params, master_params):
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(model.grad)


def master_params_to_model_params(model_params, master_params):
    for model, master in zip(model_params, master_params):
        model.data.copy_(master.data)


def train(model, loader, epochs=10, lr=0.01, fp16=True):
    if fp16:
        model = model.cuda().half()
    model_params, master_params = prep_param_lists(model)
    optimizer = torch.optim.SGD(master_params, lr=lr, momentum=0.9)
    for _ in range(epochs):
        for x, y in loader:
            x = x.cuda().half() if fp16 else x.cuda()
            out = model(x)
            loss = F.cross_entropy(out.float(), y.cuda())
            (loss * STATIC_LOSS_SCALE).backward()
            model_grads_to_master_grads(model_params, master_params)
            for p in master_params:
                p.grad.data.mul_(1.0 / STATIC_LOSS_SCALE)
            optimizer.step()
            master_params_to_model_params(model_params, master_params)
            model.zero_grad()


def train_autocast_static_scale(model, loader, optimizer):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x.cuda()), y.cuda())
        optimizer.zero_grad()
        (loss * STATIC_LOSS_SCALE).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(STATIC_LOSS_SCALE)
        optimizer.step()


def train_autocast_unscaled(model, loader, optimizer):
    for x, y in loader:
        with torch.autocast("cuda"):  # expect: AMP010
            loss = F.cross_entropy(model(x.cuda()), y.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


class SoftmaxWithTemperature(nn.Module):
    def __init__(self, temperature=1.0):
        super().__init__()
        self.temperature = temperature

    def forward(self, logits):
        z = logits.half() / self.temperature
        z = z - z.amax(dim=-1, keepdim=True)
        return z.exp() / (z.exp().sum(dim=-1, keepdim=True) + 1e-10)  # expect: AMP004 AMP011
