"""Kaggle notebook export: UNet++ segmentation (segmentation_models_pytorch) with deep supervision, k-fold training."""
import copy
import gc
import time

import numpy as np
import pandas as pd
import segmentation_models_pytorch as smp
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch import amp
from torch.optim import lr_scheduler
from tqdm import tqdm


class CFG:
    seed = 101
    backbone = "efficientnet-b4"
    train_bs = 16
    valid_bs = 32
    img_size = [384, 384]
    epochs = 15
    lr = 2e-3
    min_lr = 1e-6
    wd = 1e-6
    n_accumulate = max(1, 32 // train_bs)
    n_fold = 5
    num_classes = 3
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class DeepSupUnet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = smp.UnetPlusPlus(encoder_name=CFG.backbone, encoder_weights="imagenet", in_channels=3,
                                    classes=CFG.num_classes, activation=None)
        chs = self.net.encoder.out_channels[-2:]
        self.aux_heads = nn.ModuleList([nn.Conv2d(c, CFG.num_classes, 1) for c in chs])

    def forward(self, x):
        features = self.net.encoder(x)
        main = self.net.segmentation_head(self.net.decoder(*features))
        if not self.training:
            return main
        aux = [F.interpolate(h(f), size=x.shape[-2:], mode="bilinear", align_corners=False)
               for h, f in zip(self.aux_heads, features[-2:])]
        return [main] + aux


JaccardLoss = smp.losses.JaccardLoss(mode="multilabel")
DiceLoss = smp.losses.DiceLoss(mode="multilabel")
BCELoss = smp.losses.SoftBCEWithLogitsLoss()
TverskyLoss = smp.losses.TverskyLoss(mode="multilabel", log_loss=False)


def criterion(y_pred, y_true):
    return 0.5 * BCELoss(y_pred, y_true) + 0.5 * TverskyLoss(y_pred, y_true)


def dice_coef(y_true, y_pred, thr=0.5, dim=(2, 3), epsilon=0.001):
    y_true = y_true.to(torch.float32)
    y_pred = (y_pred > thr).to(torch.float32)
    inter = (y_true * y_pred).sum(dim=dim)
    den = y_true.sum(dim=dim) + y_pred.sum(dim=dim)
    return ((2 * inter + epsilon) / (den + epsilon)).mean(dim=(1, 0))


def iou_coef(y_true, y_pred, thr=0.5, dim=(2, 3), epsilon=0.001):
    y_true = y_true.to(torch.float32)
    y_pred = (y_pred > thr).to(torch.float32)
    inter = (y_true * y_pred).sum(dim=dim)
    union = (y_true + y_pred - y_true * y_pred).sum(dim=dim)
    return ((inter + epsilon) / (union + epsilon)).mean(dim=(1, 0))


def train_one_epoch(model, optimizer, scheduler, dataloader, device, epoch):
    model.train()
    scaler = amp.GradScaler("cuda")  # expect: AMP010
    dataset_size, running_loss = 0, 0.0
    pbar = tqdm(enumerate(dataloader), total=len(dataloader), desc="Train ")
    for step, (images, masks) in pbar:
        images = images.to(device, dtype=torch.half)  # expect: AMP001
        images = (images - images.mean(dim=(2, 3), keepdim=True)) / (images.std(dim=(2, 3), keepdim=True) + 1e-8)  # expect: AMP004 AMP011
        masks = masks.to(device, dtype=torch.float)
        batch_size = images.size(0)

        with amp.autocast("cuda", dtype=torch.bfloat16):
            y_preds = model(images)
        loss = sum(criterion(p, masks) for p in y_preds) / len(y_preds)  # expect: AMP002
        loss = loss / CFG.n_accumulate
        scaled = scaler.scale(loss)
        scaled.backward()

        if (step + 1) % CFG.n_accumulate == 0:
            torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)  # expect: AMP005
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()

        running_loss += loss.item() * batch_size
        dataset_size += batch_size
        epoch_loss = running_loss / dataset_size
        mem = torch.cuda.memory_reserved() / 1e9 if torch.cuda.is_available() else 0
        pbar.set_postfix(epoch=epoch, train_loss=f"{epoch_loss:0.4f}", lr=f"{optimizer.param_groups[0]['lr']:0.5f}",
                         gpu_mem=f"{mem:0.2f} GB")
    torch.cuda.empty_cache()
    gc.collect()
    return epoch_loss


@torch.no_grad()
def valid_one_epoch(model, dataloader, device, epoch):
    model.eval()
    dataset_size, running_loss = 0, 0.0
    val_scores = []
    for images, masks in tqdm(dataloader, desc="Valid "):
        images = images.to(device, dtype=torch.float)
        images = (images - images.mean(dim=(2, 3), keepdim=True)) / (images.std(dim=(2, 3), keepdim=True) + 1e-8)
        masks = masks.to(device, dtype=torch.float)
        with amp.autocast("cuda", dtype=torch.bfloat16):
            y_pred = model(images)
            loss = criterion(y_pred, masks)
        running_loss += loss.item() * images.size(0)
        dataset_size += images.size(0)
        y_pred = nn.Sigmoid()(y_pred.float())
        val_scores.append([dice_coef(masks, y_pred).cpu().item(), iou_coef(masks, y_pred).cpu().item()])
    return running_loss / dataset_size, np.mean(val_scores, axis=0)


def run_training(model, train_loader, valid_loader, fold):
    optimizer = optim.AdamW(model.parameters(), lr=CFG.lr, weight_decay=CFG.wd)
    scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=CFG.epochs * len(train_loader) // CFG.n_accumulate,
                                               eta_min=CFG.min_lr)
    best_dice, best_epoch = -np.inf, -1
    best_wts = copy.deepcopy(model.state_dict())
    history = []
    start = time.time()
    for epoch in range(1, CFG.epochs + 1):
        train_loss = train_one_epoch(model, optimizer, scheduler, train_loader, CFG.device, epoch)
        val_loss, (val_dice, val_jaccard) = valid_one_epoch(model, valid_loader, CFG.device, epoch)
        history.append({"epoch": epoch, "train_loss": train_loss, "valid_loss": val_loss,
                        "dice": val_dice, "jaccard": val_jaccard})
        print(f"Fold {fold} epoch {epoch}: dice {val_dice:.4f} jaccard {val_jaccard:.4f}")
        if val_dice >= best_dice:
            best_dice, best_epoch = val_dice, epoch
            best_wts = copy.deepcopy(model.state_dict())
            torch.save(model.state_dict(), f"best_epoch-{fold:02d}.bin")
    print(f"Training complete in {(time.time() - start) / 3600:.2f}h, best dice {best_dice:.4f} at {best_epoch}")
    model.load_state_dict(best_wts)
    return model, pd.DataFrame(history)


@torch.no_grad()
def infer(model_paths, test_loader, thr=0.4):
    models = []
    for path in model_paths:
        m = DeepSupUnet()
        m.load_state_dict(torch.load(path, map_location="cpu"))
        models.append(m.to(CFG.device).half().eval())
    preds = []
    for images, ids in tqdm(test_loader, desc="Infer "):
        images = images.to(CFG.device, dtype=torch.float)
        images = (images - images.mean(dim=(2, 3), keepdim=True)) / (images.std(dim=(2, 3), keepdim=True) + 1e-6)
        msk = torch.zeros((images.size(0), CFG.num_classes, *images.shape[2:]), device=CFG.device, dtype=torch.float32)
        for m in models:
            msk += torch.sigmoid(m(images.half())).float() / len(models)
        preds.append(((msk > thr).to(torch.uint8).cpu().numpy(), ids))
    return preds
