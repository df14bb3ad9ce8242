# %% [markdown]
# # UW-Madison GI Tract Image Segmentation -- smp Unet (efficientnet-b1) [train]
# 2D baseline at 320x384 + a 2.5D variant (3 neighbouring slices stacked as channels).
# Loss: 0.5 * BCE + 0.5 * Tversky. Metric: 0.4 * Dice + 0.6 * 3D Hausdorff (Dice only here).

# %%
import copy
import gc
import os
import time
from collections import defaultdict

import cv2
import numpy as np
import pandas as pd
import segmentation_models_pytorch as smp
import torch
import torch.nn as nn
import torch.optim as optim
from sklearn.model_selection import StratifiedGroupKFold
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm


class CFG:
    seed = 101
    exp_name = "Baselinev2"
    model_name = "Unet"
    backbone = "efficientnet-b1"
    train_bs = 64
    valid_bs = train_bs * 2
    img_size = [320, 384]
    epochs = 15
    lr = 2e-3
    scheduler = "CosineAnnealingLR"
    min_lr = 1e-6
    T_max = int(30000 / train_bs * epochs) + 50
    wd = 1e-6
    n_accumulate = max(1, 32 // train_bs)
    clip_value = 1.0
    n_fold = 5
    folds = [0]
    num_classes = 3
    apex = True
    stack_25d = False
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def set_seed(seed=42):
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    os.environ["PYTHONHASHSEED"] = str(seed)


set_seed(CFG.seed)

# %% data
df = pd.read_csv("../input/uwmgi-mask-dataset/train.csv")
df["empty"] = (df.rle_len == 0)
skf = StratifiedGroupKFold(n_splits=CFG.n_fold, shuffle=True, random_state=CFG.seed)
for fold, (train_idx, val_idx) in enumerate(skf.split(df, df["empty"], groups=df["case"])):
    df.loc[val_idx, "fold"] = fold


def load_img(path, stack=False):
    if stack:
        img = np.load(path).astype("float32")
    else:
        img = cv2.imread(path, cv2.IMREAD_UNCHANGED)
        img = np.tile(img[..., None], [1, 1, 3]).astype("float32")
    mx = np.max(img)
    if mx:
        img /= mx
    return img


class BuildDataset(Dataset):
    def __init__(self, df, label=True, transforms=None):
        self.df = df
        self.label = label
        self.img_paths = df["image_path"].tolist()
        self.msk_paths = df["mask_path"].tolist()
        self.transforms = transforms

    def __len__(self):
        return len(self.df)

    def __getitem__(self, index):
        img = load_img(self.img_paths[index], stack=CFG.stack_25d)
        body = (img.max(axis=-1) > 0.02).astype("float32")
        if self.label:
            msk = np.load(self.msk_paths[index]).astype("float32") / 255.0
            if self.transforms:
                data = self.transforms(image=img, masks=[msk, body])
                img, (msk, body) = data["image"], data["masks"]
            return (torch.tensor(np.transpose(img, (2, 0, 1))), torch.tensor(np.transpose(msk, (2, 0, 1))),
                    torch.tensor(body) > 0.5)
        if self.transforms:
            img = self.transforms(image=img)["image"]
        return torch.tensor(np.transpose(img, (2, 0, 1)))


def prepare_loaders(fold, data_transforms):
    train_df = df.query("fold!=@fold").reset_index(drop=True)
    valid_df = df.query("fold==@fold").reset_index(drop=True)
    train_loader = DataLoader(BuildDataset(train_df, transforms=data_transforms["train"]),
                              batch_size=CFG.train_bs, num_workers=4, shuffle=True, pin_memory=True, drop_last=False)
    valid_loader = DataLoader(BuildDataset(valid_df, transforms=data_transforms["valid"]),
                              batch_size=CFG.valid_bs, num_workers=4, shuffle=False, pin_memory=True)
    return train_loader, valid_loader


# %% model / losses
def build_model(in_channels=3):
    model = smp.Unet(encoder_name=CFG.backbone, encoder_weights="imagenet",
                     in_channels=in_channels, classes=CFG.num_classes, activation=None)
    return model.to(CFG.device)


def load_model(path, in_channels=3):
    model = build_model(in_channels)
    model.load_state_dict(torch.load(path))
    model.eval()
    return model


JaccardLoss = smp.losses.JaccardLoss(mode="multilabel")
DiceLoss = smp.losses.DiceLoss(mode="multilabel")
BCELoss = smp.losses.SoftBCEWithLogitsLoss()
TverskyLoss = smp.losses.TverskyLoss(mode="multilabel", log_loss=False)


def dice_coef(y_true, y_pred, thr=0.5, dim=(2, 3), epsilon=0.001):
    y_true = y_true.to(torch.float32)
    y_pred = (y_pred > thr).to(torch.float32)
    inter = (y_true * y_pred).sum(dim=dim)
    den = y_true.sum(dim=dim) + y_pred.sum(dim=dim)
    return ((2 * inter + epsilon) / (den + epsilon)).mean(dim=(1, 0))


def criterion(y_pred, y_true):
    return 0.5 * BCELoss(y_pred, y_true) + 0.5 * TverskyLoss(y_pred, y_true)


# %% train / valid
def train_one_epoch(model, optimizer, scheduler, dataloader, device, epoch):
    model.train()
    scaler = torch.amp.GradScaler("cuda", enabled=CFG.apex)
    dataset_size, running_loss = 0, 0.0
    pbar = tqdm(enumerate(dataloader), total=len(dataloader), desc="Train ")
    for step, (images, masks, _) in pbar:
        images = images.to(device, dtype=torch.float)
        masks = masks.to(device, dtype=torch.float)
        batch_size = images.size(0)

        with torch.autocast("cuda", dtype=torch.float16, enabled=CFG.apex):
            y_pred = model(images)
            loss = criterion(y_pred, masks)
            loss = loss / CFG.n_accumulate

        scaler.scale(loss).backward()

        if (step + 1) % CFG.n_accumulate == 0:
            torch.nn.utils.clip_grad_value_(model.parameters(), CFG.clip_value)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()

        running_loss += (loss.item() * batch_size)
        dataset_size += batch_size
        mem = torch.cuda.memory_reserved() / 1e9 if torch.cuda.is_available() else 0
        pbar.set_postfix(train_loss=f"{running_loss / dataset_size:0.4f}", gpu_mem=f"{mem:0.2f} GB")
    torch.cuda.empty_cache()
    gc.collect()
    return running_loss / dataset_size


@torch.no_grad()
def valid_one_epoch(model, dataloader, device, epoch):
    model.eval()
    dataset_size, running_loss = 0, 0.0
    val_scores = []
    pbar = tqdm(enumerate(dataloader), total=len(dataloader), desc="Valid ")
    for step, (images, masks, body) in pbar:
        images = images.to(device, dtype=torch.float)
        masks = masks.to(device, dtype=torch.float)
        body = body.to(device)
        batch_size = images.size(0)

        with torch.autocast("cuda", dtype=torch.float16):
            y_pred = model(images)
            # nothing to segment outside the body: push those logits far below zero
            y_pred = y_pred.masked_fill(~body[:, None], -1e5)  # expect: AMP007
        loss = criterion(y_pred, masks)  # expect: AMP002

        running_loss += (loss.item() * batch_size)
        dataset_size += batch_size
        y_pred = nn.Sigmoid()(y_pred.float())
        val_scores.append(dice_coef(masks, y_pred).cpu().item())
        pbar.set_postfix(valid_loss=f"{running_loss / dataset_size:0.4f}")
    torch.cuda.empty_cache()
    gc.collect()
    return running_loss / dataset_size, float(np.mean(val_scores))


def train_one_epoch_25d(model, optimizer, scheduler, dataloader, device, epoch):
    """2.5D variant; run on the A100 box, hence bf16 (torch.cuda.amp.autocast there before)."""
    model.train()
    scaler = torch.amp.GradScaler("cuda", enabled=CFG.apex)  # expect: AMP010
    dataset_size, running_loss = 0, 0.0
    pbar = tqdm(enumerate(dataloader), total=len(dataloader), desc="Train 2.5D ")
    for step, (images, masks, _) in pbar:
        images = images.to(device, dtype=torch.float)
        masks = masks.to(device, dtype=torch.float)
        batch_size = images.size(0)

        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=CFG.apex):
            y_pred = model(images)
            loss = criterion(y_pred, masks) / CFG.n_accumulate

        if CFG.apex:
            scaler.scale(loss).backward()
            if (step + 1) % CFG.n_accumulate == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_value_(model.parameters(), CFG.clip_value)
                scaler.step(optimizer)
                scaler.update()
        else:
            loss.backward()
        if (step + 1) % CFG.n_accumulate == 0:
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()

        running_loss += (loss.item() * batch_size)
        dataset_size += batch_size
        pbar.set_postfix(train_loss=f"{running_loss / dataset_size:0.4f}")
    return running_loss / dataset_size


# %% run training (module level, one fold per run)
data_transforms = {"train": None, "valid": None}  # albumentations pipelines from the EDA notebook
for fold in CFG.folds:
    print(f"#" * 15 + f"\n### Fold: {fold}\n" + "#" * 15)
    train_loader, valid_loader = prepare_loaders(fold, data_transforms)
    model = build_model(in_channels=3)
    optimizer = optim.Adam(model.parameters(), lr=CFG.lr, weight_decay=CFG.wd)
    scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=CFG.T_max, eta_min=CFG.min_lr)
    run_epoch = train_one_epoch_25d if CFG.stack_25d else train_one_epoch

    best_dice, best_epoch = -np.inf, -1
    best_model_wts = copy.deepcopy(model.state_dict())
    history = defaultdict(list)
    start = time.time()
    for epoch in range(1, CFG.epochs + 1):
        train_loss = run_epoch(model, optimizer, scheduler, dataloader=train_loader,
                               device=CFG.device, epoch=epoch)
        val_loss, val_dice = valid_one_epoch(model, valid_loader, device=CFG.device, epoch=epoch)
        history["Train Loss"].append(train_loss)
        history["Valid Loss"].append(val_loss)
        history["Valid Dice"].append(val_dice)
        print(f"Epoch {epoch}: train {train_loss:.4f} valid {val_loss:.4f} dice {val_dice:.4f}")
        if val_dice >= best_dice:
            best_dice, best_epoch = val_dice, epoch
            best_model_wts = copy.deepcopy(model.state_dict())
            torch.save(model.state_dict(), f"best_epoch-{fold:02d}.bin")
    print(f"Fold {fold}: best dice {best_dice:.4f} at epoch {best_epoch} ({(time.time() - start) / 60:.1f} min)")
    # fp16 copy for the inference kernel (smaller upload)
    torch.save({k: v.half() for k, v in best_model_wts.items()}, f"best_epoch-{fold:02d}-fp16.bin")


# %% inference on the held-out fold with the fp16 weights
@torch.no_grad()
def infer(model_paths, test_loader, thr=0.5):
    msks = []
    for images in tqdm(test_loader, total=len(test_loader), desc="Infer "):
        images = images.to(CFG.device, dtype=torch.float).half()
        size = images.size()
        msk = torch.zeros((size[0], CFG.num_classes, size[2], size[3]), device=CFG.device, dtype=torch.float32)
        for path in model_paths:
            model = load_model(path).half()
            out = torch.sigmoid(model(images).float())
            msk += out / len(model_paths)
        msks.append((msk > thr).to(torch.uint8).cpu().numpy())
    return np.concatenate(msks)


test_df = df.query("fold==@CFG.folds[0]").reset_index(drop=True)
test_loader = DataLoader(BuildDataset(test_df, label=False, transforms=data_transforms["valid"]),
                         batch_size=CFG.valid_bs, num_workers=4, shuffle=False, pin_memory=True)
pred_masks = infer([f"best_epoch-{f:02d}.bin" for f in CFG.folds], test_loader)
print(pred_masks.shape, pred_masks.mean(axis=(0, 2, 3)))
