# ====================================================
# 12-lead ECG multi-label arrhythmia classification
# 1D-ResNet + masked attention pooling, ASL loss, 5-fold CV
# (PTB-XL superdiagnostic + auxiliary age regression)
# ====================================================
import os
import math
import copy

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm


class CFG:
    debug = False
    apex = True
    print_freq = 100
    num_workers = 4
    model_name = "resnet1d_attnpool"
    epochs = 30
    lr = 1e-3
    min_lr = 1e-6
    eps = 1e-6
    betas = (0.9, 0.999)
    weight_decay = 1e-2
    batch_size = 64
    max_len = 5000
    n_leads = 12
    target_cols = ["NORM", "MI", "STTC", "CD", "HYP"]
    age_weight = 0.1
    gradient_accumulation_steps = 1
    max_grad_norm = 1000
    seed = 42
    n_fold = 5
    trn_fold = [0, 1, 2, 3, 4]
    train = True
    output_dir = "./outputs/"


def seed_everything(seed=42):
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    torch.backends.cudnn.deterministic = True


class AverageMeter:
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def get_score(y_true, y_pred):
    return np.mean([roc_auc_score(y_true[:, i], y_pred[:, i]) for i in range(y_true.shape[1])])


# ====================================================
# Dataset
# ====================================================
class ECGDataset(Dataset):
    def __init__(self, df, signal_dir, train=True):
        self.df = df.reset_index(drop=True)
        self.signal_dir = signal_dir
        self.labels = df[CFG.target_cols].values.astype(np.float32)
        self.ages = (df["age"].values.astype(np.float32) - 60.0) / 20.0
        self.train = train

    def __len__(self):
        return len(self.df)

    def __getitem__(self, idx):
        sig = np.load(os.path.join(self.signal_dir, f"{self.df.ecg_id[idx]}.npy")).astype(np.float32)
        sig = (sig - sig.mean(axis=0, keepdims=True)) / (sig.std(axis=0, keepdims=True) + 1e-8)
        length = min(len(sig), CFG.max_len)
        if self.train and len(sig) > CFG.max_len:
            start = np.random.randint(0, len(sig) - CFG.max_len)
            sig = sig[start: start + CFG.max_len]
        out = np.zeros((CFG.max_len, CFG.n_leads), dtype=np.float32)
        out[:length] = sig[:length]
        if self.train and np.random.rand() < 0.5:
            out[:length] *= np.random.uniform(0.8, 1.2)
        return (torch.from_numpy(out.T.copy()), torch.tensor(length), torch.from_numpy(self.labels[idx]),
                torch.tensor(self.ages[idx]))


# ====================================================
# Model
# ====================================================
class ResBlock1d(nn.Module):
    def __init__(self, in_ch, out_ch, stride=1, k=7):
        super().__init__()
        self.conv1 = nn.Conv1d(in_ch, out_ch, k, stride=stride, padding=k // 2, bias=False)
        self.bn1 = nn.BatchNorm1d(out_ch)
        self.conv2 = nn.Conv1d(out_ch, out_ch, k, padding=k // 2, bias=False)
        self.bn2 = nn.BatchNorm1d(out_ch)
        self.se = nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Conv1d(out_ch, out_ch // 8, 1), nn.ReLU(inplace=True),
                                nn.Conv1d(out_ch // 8, out_ch, 1), nn.Sigmoid())
        self.down = None
        if stride != 1 or in_ch != out_ch:
            self.down = nn.Sequential(nn.Conv1d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm1d(out_ch))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out * self.se(out)
        return F.relu(out + identity)


class GeM1d(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool1d(x.clamp(min=self.eps).pow(self.p), x.size(-1)).pow(1.0 / self.p).squeeze(-1)


class ECGNet(nn.Module):
    def __init__(self, cfg, widths=(64, 128, 192, 256)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(cfg.n_leads, widths[0], 15, stride=2, padding=7, bias=False),
                                  nn.BatchNorm1d(widths[0]), nn.ReLU(inplace=True), nn.MaxPool1d(3, 2, 1))
        blocks, in_ch = [], widths[0]
        for w in widths:
            blocks += [ResBlock1d(in_ch, w, stride=2), ResBlock1d(w, w)]
            in_ch = w
        self.blocks = nn.Sequential(*blocks)
        self.downsample = 4 * 2 ** len(widths)
        self.head_conv = nn.Conv1d(in_ch, 256, 1)
        self.att = nn.Linear(256, 1)
        self.gem = GeM1d()
        self.fc = nn.Sequential(nn.Dropout(0.3), nn.Linear(256 * 4, len(cfg.target_cols)))
        self.age_head = nn.Linear(256 * 4, 1)

    def forward(self, x, lengths):
        h = self.head_conv(self.blocks(self.stem(x)))
        t = h.size(-1)
        valid = torch.arange(t, device=h.device)[None, :] < (lengths[:, None] + self.downsample - 1) // self.downsample
        scores = self.att(h.transpose(1, 2)).squeeze(-1)
        scores = scores.masked_fill(~valid, -1e9)  # expect: AMP007
        w = torch.softmax(scores, dim=-1)
        att_pool = torch.bmm(w.unsqueeze(1), h.transpose(1, 2)).squeeze(1)
        avg_pool = h.mean(dim=-1)  # expect: AMP004
        std_pool = torch.sqrt(h.var(dim=-1) + 1e-8)  # expect: AMP004 AMP011
        feat = torch.cat([att_pool, avg_pool, std_pool, self.gem(F.relu(h))], dim=1)
        return self.fc(feat), self.age_head(feat).squeeze(-1)


# ====================================================
# Loss
# ====================================================
class AsymmetricLoss(nn.Module):
    def __init__(self, gamma_neg=4, gamma_pos=0, clip=0.05, eps=1e-8):
        super().__init__()
        self.gamma_neg, self.gamma_pos, self.clip, self.eps = gamma_neg, gamma_pos, clip, eps

    def forward(self, x, y):
        x = x.float()
        xs_pos = torch.sigmoid(x)
        xs_neg = 1 - xs_pos
        if self.clip is not None and self.clip > 0:
            xs_neg = (xs_neg + self.clip).clamp(max=1)
        los_pos = y * torch.log(xs_pos.clamp(min=self.eps))
        los_neg = (1 - y) * torch.log(xs_neg.clamp(min=self.eps))
        loss = los_pos + los_neg
        pt = xs_pos * y + xs_neg * (1 - y)
        gamma = self.gamma_pos * y + self.gamma_neg * (1 - y)
        loss = loss * torch.pow(1 - pt, gamma)
        return -loss.sum() / x.size(0)


# ====================================================
# Train / valid loops
# ====================================================
def train_fn(fold, train_loader, model, criterion, age_criterion, optimizer, epoch, scheduler, device):
    model.train()
    scaler = torch.cuda.amp.GradScaler(enabled=CFG.apex)  # expect: AMP009
    losses = AverageMeter()
    global_step = 0
    for step, (signals, lengths, labels, ages) in enumerate(train_loader):
        signals = signals.to(device)
        lengths = lengths.to(device)
        labels = labels.to(device)
        ages = ages.to(device)
        batch_size = labels.size(0)
        with torch.cuda.amp.autocast(enabled=CFG.apex):  # expect: AMP009
            y_preds, age_preds = model(signals, lengths)
            loss_cls = criterion(y_preds, labels)
        loss_age = age_criterion(age_preds, ages)  # expect: AMP002
        loss = loss_cls + CFG.age_weight * loss_age
        if CFG.gradient_accumulation_steps > 1:
            loss = loss / CFG.gradient_accumulation_steps
        losses.update(loss.item(), batch_size)
        scaler.scale(loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CFG.max_grad_norm)  # expect: AMP005
        if (step + 1) % CFG.gradient_accumulation_steps == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            global_step += 1
            scheduler.step()
        if step % CFG.print_freq == 0 or step == (len(train_loader) - 1):
            print(f"Epoch: [{epoch + 1}][{step}/{len(train_loader)}] Loss: {losses.val:.4f}({losses.avg:.4f}) "
                  f"Grad: {grad_norm:.4f} LR: {scheduler.get_last_lr()[0]:.8f}")
    return losses.avg


def valid_fn(valid_loader, model, criterion, device):
    losses = AverageMeter()
    model.eval()
    preds = []
    for signals, lengths, labels, _ in valid_loader:
        signals, lengths, labels = signals.to(device), lengths.to(device), labels.to(device)
        with torch.no_grad():
            y_preds, _ = model(signals, lengths)
            loss = criterion(y_preds, labels)
        losses.update(loss.item(), labels.size(0))
        preds.append(y_preds.sigmoid().to("cpu").numpy())
    return losses.avg, np.concatenate(preds)


def train_loop(folds, fold, device):
    print(f"========== fold: {fold} training ==========")
    trn = folds[folds["fold"] != fold].reset_index(drop=True)
    val = folds[folds["fold"] == fold].reset_index(drop=True)
    valid_labels = val[CFG.target_cols].values
    train_loader = DataLoader(ECGDataset(trn, "../input/ptbxl-npy/", train=True), batch_size=CFG.batch_size,
                              shuffle=True, num_workers=CFG.num_workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(ECGDataset(val, "../input/ptbxl-npy/", train=False), batch_size=CFG.batch_size * 2,
                              shuffle=False, num_workers=CFG.num_workers, pin_memory=True)

    model = ECGNet(CFG)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG.lr, eps=CFG.eps, betas=CFG.betas,
                                  weight_decay=CFG.weight_decay)
    num_train_steps = int(len(trn) / CFG.batch_size * CFG.epochs)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=CFG.lr, total_steps=num_train_steps + 10,
                                                    pct_start=0.1, final_div_factor=CFG.lr / CFG.min_lr)
    criterion = AsymmetricLoss()
    age_criterion = nn.SmoothL1Loss()

    best_score = -np.inf
    for epoch in range(CFG.epochs):
        avg_loss = train_fn(fold, train_loader, model, criterion, age_criterion, optimizer, epoch, scheduler, device)
        avg_val_loss, predictions = valid_fn(valid_loader, model, criterion, device)
        score = get_score(valid_labels, predictions)
        print(f"Epoch {epoch + 1} - avg_train_loss: {avg_loss:.4f} avg_val_loss: {avg_val_loss:.4f} AUC: {score:.4f}")
        if best_score < score:
            best_score = score
            torch.save({"model": model.state_dict(), "predictions": predictions.astype(np.float16)},
                       CFG.output_dir + f"{CFG.model_name}_fold{fold}_best.pth")
    predictions = torch.load(CFG.output_dir + f"{CFG.model_name}_fold{fold}_best.pth", map_location="cpu")["predictions"]
    val[[f"pred_{c}" for c in CFG.target_cols]] = predictions.astype(np.float32)
    return val


@torch.inference_mode()
def inference_fn(test_loader, model_paths, device):
    fold_preds = []
    for path in model_paths:
        model = ECGNet(CFG)
        model.load_state_dict(torch.load(path, map_location="cpu")["model"])
        model.to(device).eval().half()
        preds = []
        for signals, lengths, _, _ in tqdm(test_loader, total=len(test_loader)):
            logits, _ = model(signals.to(device).half(), lengths.to(device))
            preds.append(logits.float().sigmoid().cpu().numpy())
        fold_preds.append(np.concatenate(preds))
    return np.mean(fold_preds, axis=0)


if __name__ == "__main__":
    seed_everything(CFG.seed)
    os.makedirs(CFG.output_dir, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_df = pd.read_csv("../input/ptbxl-npy/train_meta.csv")
    if CFG.debug:
        CFG.epochs = 2
        train_df = train_df.sample(n=1000, random_state=CFG.seed).reset_index(drop=True)
    folds = train_df.copy()
    skf = StratifiedKFold(n_splits=CFG.n_fold, shuffle=True, random_state=CFG.seed)
    strat = folds[CFG.target_cols].values @ (2 ** np.arange(len(CFG.target_cols)))
    for n, (_, val_index) in enumerate(skf.split(folds, strat)):
        folds.loc[val_index, "fold"] = int(n)
    folds["fold"] = folds["fold"].astype(int)
    if CFG.train:
        oof_df = pd.DataFrame()
        for fold in range(CFG.n_fold):
            if fold in CFG.trn_fold:
                _oof_df = train_loop(folds, fold, device)
                oof_df = pd.concat([oof_df, _oof_df])
        oof_score = get_score(oof_df[CFG.target_cols].values, oof_df[[f"pred_{c}" for c in CFG.target_cols]].values)
        print(f"========== CV: {oof_score:.4f} ==========")
        oof_df.to_pickle(CFG.output_dir + "oof_df.pkl")
