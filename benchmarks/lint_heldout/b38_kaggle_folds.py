# ====================================================
# Kaggle: binary image classification, 5-fold CV baseline (notebook exported to script)
# ====================================================
import argparse
import gc
import math
import os
import random
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

# ====================================================
# CFG
# ====================================================
CFG = {
    "debug": False,
    "apex": True,
    "print_freq": 100,
    "num_workers": 4,
    "scheduler": "cosine",
    "batch_scheduler": True,
    "num_cycles": 0.5,
    "num_warmup_steps": 0,
    "epochs": 5,
    "lr": 2e-4,
    "min_lr": 1e-6,
    "eps": 1e-6,
    "betas": (0.9, 0.999),
    "batch_size": 32,
    "weight_decay": 0.01,
    "gradient_accumulation_steps": 1,
    "max_grad_norm": 1000,
    "pooling": "mean",
    "img_size": 128,
    "seed": 42,
    "n_fold": 5,
    "trn_fold": [0, 1, 2, 3, 4],
    "train": True,
    "output_dir": "./",
}


def parse_args():
    p = argparse.ArgumentParser()
    for k, v in CFG.items():
        if isinstance(v, bool):
            p.add_argument(f"--{k}", type=lambda s: s.lower() in ("1", "true", "yes"), default=v)
        elif isinstance(v, (int, float, str)):
            p.add_argument(f"--{k}", type=type(v), default=v)
    p.add_argument("--trn_fold", type=int, nargs="+", default=CFG["trn_fold"])
    return p.parse_args()


def seed_everything(seed=42):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    torch.backends.cudnn.deterministic = True


def get_score(y_true, y_pred):
    order = np.argsort(y_pred)
    ranks = np.empty(len(order))
    ranks[order] = np.arange(1, len(order) + 1)
    pos = y_true == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1)


class AverageMeter:
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


# ====================================================
# Dataset
# ====================================================
class TrainDataset(Dataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = torch.from_numpy(self.images[i]).float() / 255.0
        if random.random() < 0.5:
            img = img.flip(-1)
        return img, torch.tensor(self.labels[i], dtype=torch.float)


# ====================================================
# Model
# ====================================================
class ConvBNAct(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), (x.size(-2), x.size(-1))).pow(1.0 / self.p)


class CustomModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.pooling = cfg["pooling"]
        self.backbone = nn.Sequential(
            ConvBNAct(3, 32, 2), ConvBNAct(32, 64, 2), ConvBNAct(64, 128, 2), ConvBNAct(128, 128, 1),
            nn.Conv2d(128, 256, 1, bias=False),
        )
        self.gem = GeM()
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(256, 1)

    def forward(self, images):
        x = self.backbone(images)
        if self.pooling == "gem":
            feature = self.gem(x).flatten(1)
        else:
            feature = x.mean(dim=(2, 3))  # expect: AMP004
        return self.fc(self.dropout(feature))


# ====================================================
# Helper functions
# ====================================================
def get_scheduler(cfg, optimizer, num_train_steps):
    def lr_lambda(step):
        if step < cfg["num_warmup_steps"]:
            return step / max(1, cfg["num_warmup_steps"])
        progress = (step - cfg["num_warmup_steps"]) / max(1, num_train_steps - cfg["num_warmup_steps"])
        return max(cfg["min_lr"] / cfg["lr"], 0.5 * (1.0 + math.cos(math.pi * cfg["num_cycles"] * 2.0 * progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, device, scaler):
    model.train()
    losses = AverageMeter()
    start = time.time()
    global_step = 0
    for step, (images, labels) in enumerate(train_loader):
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        batch_size = labels.size(0)
        with torch.cuda.amp.autocast(enabled=CFG["apex"], dtype=torch.bfloat16):  # expect: AMP009
            y_preds = model(images)
            loss = criterion(y_preds.view(-1), labels)
        if CFG["gradient_accumulation_steps"] > 1:
            loss = loss / CFG["gradient_accumulation_steps"]
        losses.update(loss.item(), batch_size)
        loss = scaler.scale(loss)
        loss.backward()
        if (step + 1) % CFG["gradient_accumulation_steps"] == 0:
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["max_grad_norm"])
            optimizer.step()  # expect: AMP006
            scaler.update()
            optimizer.zero_grad()
            global_step += 1
            if CFG["batch_scheduler"]:
                scheduler.step()
        if step % CFG["print_freq"] == 0 or step == (len(train_loader) - 1):
            print(f"Epoch: [{epoch + 1}][{step}/{len(train_loader)}] "
                  f"Elapsed {time.time() - start:.0f}s Loss: {losses.val:.4f}({losses.avg:.4f}) "
                  f"Grad: {grad_norm:.4f} LR: {scheduler.get_last_lr()[0]:.8f}")
    return losses.avg


@torch.no_grad()
def valid_fn(valid_loader, model, criterion, device):
    losses = AverageMeter()
    model.eval()
    preds = []
    for images, labels in valid_loader:
        images, labels = images.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=CFG["apex"]):
            y_preds = model(images)
            loss = criterion(y_preds.view(-1), labels)
        losses.update(loss.item(), labels.size(0))
        preds.append(y_preds.sigmoid().float().cpu().numpy())
    return losses.avg, np.concatenate(preds).reshape(-1)


def inference_fn(test_loader, model, device):
    model.eval()
    model.half()
    preds = []
    with torch.no_grad():
        for images in test_loader:
            y_preds = model(images.to(device).half())
            preds.append(y_preds.sigmoid().float().cpu().numpy())
    return np.concatenate(preds).reshape(-1)


# ====================================================
# train loop
# ====================================================
def train_loop(images, labels, folds, fold, device):
    print(f"========== fold: {fold} training ==========")
    trn_idx, val_idx = np.where(folds != fold)[0], np.where(folds == fold)[0]
    train_loader = DataLoader(TrainDataset(images[trn_idx], labels[trn_idx]), batch_size=CFG["batch_size"],
                              shuffle=True, num_workers=CFG["num_workers"], pin_memory=True, drop_last=True)
    valid_loader = DataLoader(TrainDataset(images[val_idx], labels[val_idx]), batch_size=CFG["batch_size"] * 2,
                              shuffle=False, num_workers=CFG["num_workers"], pin_memory=True)

    model = CustomModel(CFG)
    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": CFG["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=CFG["lr"], eps=CFG["eps"], betas=CFG["betas"])
    num_train_steps = int(len(trn_idx) / CFG["batch_size"] * CFG["epochs"])
    scheduler = get_scheduler(CFG, optimizer, num_train_steps)
    criterion = nn.BCEWithLogitsLoss(reduction="mean")
    scaler = torch.cuda.amp.GradScaler(enabled=CFG["apex"])  # expect: AMP009, AMP010

    best_score = -np.inf
    best_path = os.path.join(CFG["output_dir"], f"model_fold{fold}_best.pth")
    for epoch in range(CFG["epochs"]):
        start_time = time.time()
        avg_loss = train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, device, scaler)
        avg_val_loss, predictions = valid_fn(valid_loader, model, criterion, device)
        score = get_score(labels[val_idx], predictions)
        elapsed = time.time() - start_time
        print(f"Epoch {epoch + 1} - avg_train_loss: {avg_loss:.4f} avg_val_loss: {avg_val_loss:.4f} "
              f"time: {elapsed:.0f}s  Score: {score:.4f}")
        if best_score < score:
            best_score = score
            torch.save({"model": model.state_dict(), "predictions": predictions}, best_path)

    oof = np.zeros(len(folds))
    oof[val_idx] = torch.load(best_path, map_location="cpu", weights_only=False)["predictions"]
    torch.cuda.empty_cache()
    gc.collect()
    return val_idx, oof[val_idx]


def main():
    args = parse_args()
    CFG.update({k: v for k, v in vars(args).items() if k in CFG})
    seed_everything(CFG["seed"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = 512 if CFG["debug"] else 8000
    rng = np.random.default_rng(CFG["seed"])
    images = rng.integers(0, 256, size=(n, 3, CFG["img_size"], CFG["img_size"]), dtype=np.uint8)
    labels = (images[:, 0].mean(axis=(1, 2)) > 127.5).astype(np.float32)
    folds = rng.integers(0, CFG["n_fold"], size=n)

    if CFG["train"]:
        oof = np.zeros(n)
        for fold in range(CFG["n_fold"]):
            if fold in CFG["trn_fold"]:
                val_idx, fold_oof = train_loop(images, labels, folds, fold, device)
                oof[val_idx] = fold_oof
                print(f"========== fold: {fold} result: {get_score(labels[val_idx], fold_oof):.4f}")
        print(f"========== CV: {get_score(labels, oof):.4f} ==========")

    test = DataLoader(torch.from_numpy(images[:256]).float() / 255.0, batch_size=64)
    preds = []
    for fold in CFG["trn_fold"]:
        model = CustomModel(CFG)
        state = torch.load(os.path.join(CFG["output_dir"], f"model_fold{fold}_best.pth"), map_location="cpu",
                           weights_only=False)
        model.load_state_dict(state["model"])
        model.to(device)
        preds.append(inference_fn(test, model, device))
    np.save(os.path.join(CFG["output_dir"], "submission.npy"), np.mean(preds, axis=0))


if __name__ == "__main__":
    main()
