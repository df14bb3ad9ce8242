"""AMP005/AMP006 in notebook-style code: globals, a ``CFG['apex']`` switch, and a step helper
called at module level after a loop of accumulation steps."""
import torch

CFG = {"apex": True, "accum_iter": 4, "max_norm": 1.0, "grad_clip": 1.0}
model = torch.nn.Linear(16, 4).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda", enabled=CFG["apex"])


def optimizer_step(model, optimizer, scaler, grad_clip):
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # AMP005
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def clipped_step(model, optimizer, scaler, grad_clip):
    """Also called before any backward has run through the scaler: not known to be scaled."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()


def train_one_epoch(loader, loss_fn):
    for step, (x, y) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.float16, enabled=CFG["apex"]):
            loss = loss_fn(model(x), y) / CFG["accum_iter"]
        if CFG["apex"]:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (step + 1) % CFG["accum_iter"] == 0:
            if CFG["apex"]:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["max_norm"])
                scaler.step(optimizer)
                scaler.update()
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["max_norm"])
                optimizer.step()
            optimizer.zero_grad()


def warm_start(loader, loss_fn):
    for x, y in loader:
        loss_fn(model(x).float(), y).backward()
        clipped_step(model, optimizer, scaler, 1.0)


for iteration in range(100):
    for micro_step in range(CFG["accum_iter"]):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(8, 16, device="cuda")).float().pow(2).mean()
        scaler.scale(loss / CFG["accum_iter"]).backward()
    optimizer_step(model, optimizer, scaler, CFG["grad_clip"])
    for micro_step in range(CFG["accum_iter"]):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(8, 16, device="cuda")).float().pow(2).mean()
        scaler.scale(loss / CFG["accum_iter"]).backward()
    clipped_step(model, optimizer, scaler, 1.0)
