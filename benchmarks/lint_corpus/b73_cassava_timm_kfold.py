# %% [markdown]
# # Cassava Leaf Disease -- tf_efficientnet_b4_ns, 5-fold, label smoothing, CutMix
# Train kernel. Images at 384 for the first stage, 1 extra epoch at 512 at the end of
# each fold. Mixed precision switch in CFG['apex'].

# %%
import os
import random
import time

import cv2
import numpy as np
import pandas as pd
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from albumentations import (CenterCrop, CoarseDropout, Compose, HorizontalFlip, HueSaturationValue,
                            Normalize, RandomBrightnessContrast, RandomResizedCrop, Resize,
                            ShiftScaleRotate, Transpose, VerticalFlip)
from albumentations.pytorch import ToTensorV2
from sklearn.metrics import accuracy_score
from sklearn.model_selection import StratifiedKFold
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

CFG = {
    'fold_num': 5,
    'seed': 719,
    'model_arch': 'tf_efficientnet_b4_ns',
    'img_size': 384,
    'ft_img_size': 512,
    'epochs': 10,
    'cutmix_epochs': 6,
    'train_bs': 16,
    'valid_bs': 32,
    'T_0': 10,
    'lr': 1e-4,
    'min_lr': 1e-6,
    'weight_decay': 1e-6,
    'num_workers': 4,
    'accum_iter': 2,
    'verbose_step': 1,
    'max_norm': 10.0,
    'smoothing': 0.1,
    'apex': True,
    'device': 'cuda:0',
}

train = pd.read_csv('../input/cassava-leaf-disease-classification/train.csv')
DATA_ROOT = '../input/cassava-leaf-disease-classification/train_images/'


def seed_everything(seed):
    random.seed(seed)
    os.environ['PYTHONHASHSEED'] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = True


seed_everything(CFG['seed'])


# %% dataset
def get_img(path):
    im_bgr = cv2.imread(path)
    return im_bgr[:, :, ::-1]


def rand_bbox(size, lam):
    W, H = size[0], size[1]
    cut_rat = np.sqrt(1.0 - lam)
    cut_w, cut_h = int(W * cut_rat), int(H * cut_rat)
    cx, cy = np.random.randint(W), np.random.randint(H)
    bbx1, bby1 = np.clip(cx - cut_w // 2, 0, W), np.clip(cy - cut_h // 2, 0, H)
    bbx2, bby2 = np.clip(cx + cut_w // 2, 0, W), np.clip(cy + cut_h // 2, 0, H)
    return bbx1, bby1, bbx2, bby2


class CassavaDataset(Dataset):
    def __init__(self, df, data_root, transforms=None, output_label=True):
        super().__init__()
        self.df = df.reset_index(drop=True).copy()
        self.transforms = transforms
        self.data_root = data_root
        self.output_label = output_label
        if output_label:
            self.labels = self.df['label'].values

    def __len__(self):
        return self.df.shape[0]

    def __getitem__(self, index):
        img = get_img(f"{self.data_root}/{self.df.loc[index]['image_id']}")
        if self.transforms:
            img = self.transforms(image=img)['image']
        if self.output_label:
            return img, self.labels[index]
        return img


def get_train_transforms(size):
    return Compose([
        RandomResizedCrop(size, size), Transpose(p=0.5), HorizontalFlip(p=0.5), VerticalFlip(p=0.5),
        ShiftScaleRotate(p=0.5),
        HueSaturationValue(hue_shift_limit=0.2, sat_shift_limit=0.2, val_shift_limit=0.2, p=0.5),
        RandomBrightnessContrast(brightness_limit=(-0.1, 0.1), contrast_limit=(-0.1, 0.1), p=0.5),
        Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], max_pixel_value=255.0, p=1.0),
        CoarseDropout(p=0.5), ToTensorV2(p=1.0),
    ], p=1.)


def get_valid_transforms(size):
    return Compose([
        CenterCrop(size, size, p=1.), Resize(size, size),
        Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], max_pixel_value=255.0, p=1.0),
        ToTensorV2(p=1.0),
    ], p=1.)


def prepare_dataloader(df, trn_idx, val_idx, size):
    train_ds = CassavaDataset(df.loc[trn_idx], DATA_ROOT, transforms=get_train_transforms(size))
    valid_ds = CassavaDataset(df.loc[val_idx], DATA_ROOT, transforms=get_valid_transforms(size))
    train_loader = DataLoader(train_ds, batch_size=CFG['train_bs'], pin_memory=False, drop_last=False,
                              shuffle=True, num_workers=CFG['num_workers'])
    val_loader = DataLoader(valid_ds, batch_size=CFG['valid_bs'], num_workers=CFG['num_workers'],
                            shuffle=False, pin_memory=False)
    return train_loader, val_loader


# %% model + loss
class CassvaImgClassifier(nn.Module):
    def __init__(self, model_arch, n_class, pretrained=False):
        super().__init__()
        self.model = timm.create_model(model_arch, pretrained=pretrained)
        n_features = self.model.classifier.in_features
        self.model.classifier = nn.Linear(n_features, n_class)

    def forward(self, x):
        return self.model(x)


class LabelSmoothingLoss(nn.Module):
    def __init__(self, classes=5, smoothing=0.0, dim=-1):
        super().__init__()
        self.confidence = 1.0 - smoothing
        self.smoothing = smoothing
        self.cls = classes
        self.dim = dim

    def forward(self, pred, target):
        pred = pred.log_softmax(dim=self.dim)
        with torch.no_grad():
            true_dist = torch.zeros_like(pred)
            true_dist.fill_(self.smoothing / (self.cls - 1))
            true_dist.scatter_(1, target.data.unsqueeze(1), self.confidence)
        return torch.mean(torch.sum(-true_dist * pred, dim=self.dim))


# %% train / valid functions
def train_one_epoch(epoch, model, loss_fn, optimizer, train_loader, device, scheduler=None):
    model.train()
    running_loss = None
    pbar = tqdm(enumerate(train_loader), total=len(train_loader))
    for step, (imgs, image_labels) in pbar:
        imgs = imgs.to(device).float()
        image_labels = image_labels.to(device).long()

        with torch.autocast("cuda", dtype=torch.float16, enabled=CFG['apex']):
            image_preds = model(imgs)
            loss = loss_fn(image_preds, image_labels) / CFG['accum_iter']

        if CFG['apex']:
            scaler.scale(loss).backward()
        else:
            loss.backward()

        running_loss = loss.item() if running_loss is None else running_loss * .99 + loss.item() * .01

        if ((step + 1) % CFG['accum_iter'] == 0) or ((step + 1) == len(train_loader)):
            if CFG['apex']:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), CFG['max_norm'])
                scaler.step(optimizer)
                scaler.update()
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CFG['max_norm'])
                optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()

        if ((step + 1) % CFG['verbose_step'] == 0) or ((step + 1) == len(train_loader)):
            pbar.set_description(f'epoch {epoch} loss: {running_loss:.4f}')


def train_one_epoch_cutmix(epoch, model, loss_fn, optimizer, train_loader, device, scheduler=None):
    model.train()
    running_loss = None
    pbar = tqdm(enumerate(train_loader), total=len(train_loader))
    for step, (imgs, image_labels) in pbar:
        imgs = imgs.to(device).float()
        image_labels = image_labels.to(device).long()
        lam = np.random.beta(1.0, 1.0)
        rand_index = torch.randperm(imgs.size(0), device=device)
        target_a, target_b = image_labels, image_labels[rand_index]
        bbx1, bby1, bbx2, bby2 = rand_bbox(imgs.size()[2:], lam)
        imgs[:, :, bbx1:bbx2, bby1:bby2] = imgs[rand_index, :, bbx1:bbx2, bby1:bby2]
        lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (imgs.size(-1) * imgs.size(-2)))

        with torch.autocast("cuda", dtype=torch.float16):
            image_preds = model(imgs)
            loss = lam * loss_fn(image_preds, target_a) + (1. - lam) * loss_fn(image_preds, target_b)
            loss = loss / CFG['accum_iter']
            scaler.scale(loss).backward()  # expect: AMP008

        running_loss = loss.item() if running_loss is None else running_loss * .99 + loss.item() * .01

        if ((step + 1) % CFG['accum_iter'] == 0) or ((step + 1) == len(train_loader)):
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
        pbar.set_description(f'epoch {epoch} [cutmix] loss: {running_loss:.4f}')


def finetune_one_epoch(model, loss_fn, optimizer, train_loader, device):
    model.train()
    pbar = tqdm(enumerate(train_loader), total=len(train_loader))
    for step, (imgs, image_labels) in pbar:
        imgs = imgs.to(device).float()
        image_labels = image_labels.to(device).long()
        with torch.autocast("cuda", dtype=torch.float16):
            image_preds = model(imgs)
        loss = loss_fn(image_preds, image_labels) / CFG['accum_iter']  # expect: AMP002
        scaler.scale(loss).backward()
        if ((step + 1) % CFG['accum_iter'] == 0) or ((step + 1) == len(train_loader)):
            scaler.step(optimizer)  # expect: AMP006
            optimizer.zero_grad()
        pbar.set_description(f'[ft {CFG["ft_img_size"]}] loss: {loss.item():.4f}')


def valid_one_epoch(epoch, model, loss_fn, val_loader, device):
    model.eval()
    loss_sum, sample_num = 0, 0
    image_preds_all, image_targets_all = [], []
    for step, (imgs, image_labels) in tqdm(enumerate(val_loader), total=len(val_loader)):
        imgs = imgs.to(device).float()
        image_labels = image_labels.to(device).long()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=CFG['apex']):
            image_preds = model(imgs)
            loss = loss_fn(image_preds, image_labels)
        image_preds_all += [torch.argmax(image_preds, 1).detach().cpu().numpy()]
        image_targets_all += [image_labels.detach().cpu().numpy()]
        loss_sum += loss.item() * image_labels.shape[0]
        sample_num += image_labels.shape[0]
    image_preds_all = np.concatenate(image_preds_all)
    image_targets_all = np.concatenate(image_targets_all)
    acc = accuracy_score(image_targets_all, image_preds_all)
    print(f'epoch {epoch} validation loss = {loss_sum / sample_num:.4f}  accuracy = {acc:.4f}')
    return acc


def inference_one_epoch(model, data_loader, device):
    model.eval().half()
    image_preds_all = []
    with torch.no_grad():
        for imgs, _ in tqdm(data_loader, total=len(data_loader)):
            image_preds = model(imgs.to(device).half())
            image_preds_all += [torch.softmax(image_preds.float(), 1).detach().cpu().numpy()]
    return np.concatenate(image_preds_all, axis=0)


# %% k-fold training
folds = StratifiedKFold(n_splits=CFG['fold_num'], shuffle=True, random_state=CFG['seed']).split(
    np.arange(train.shape[0]), train.label.values)
device = torch.device(CFG['device'])
oof = np.zeros((len(train), 5), dtype=np.float32)

for fold, (trn_idx, val_idx) in enumerate(folds):
    print(f'Training with fold {fold} started')
    train_loader, val_loader = prepare_dataloader(train, trn_idx, val_idx, CFG['img_size'])

    model = CassvaImgClassifier(CFG['model_arch'], train.label.nunique(), pretrained=True).to(device)
    scaler = torch.amp.GradScaler("cuda", enabled=CFG['apex'])
    optimizer = torch.optim.Adam(model.parameters(), lr=CFG['lr'], weight_decay=CFG['weight_decay'])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        optimizer, T_0=CFG['T_0'], T_mult=1, eta_min=CFG['min_lr'], last_epoch=-1)
    loss_tr = LabelSmoothingLoss(classes=5, smoothing=CFG['smoothing']).to(device)
    loss_fn = nn.CrossEntropyLoss().to(device)

    best_acc = 0.0
    for epoch in range(CFG['epochs']):
        if epoch < CFG['cutmix_epochs']:
            train_one_epoch_cutmix(epoch, model, loss_tr, optimizer, train_loader, device, scheduler=scheduler)
        else:
            train_one_epoch(epoch, model, loss_tr, optimizer, train_loader, device, scheduler=scheduler)
        acc = valid_one_epoch(epoch, model, loss_fn, val_loader, device)
        if acc > best_acc:
            best_acc = acc
            torch.save(model.state_dict(), f'{CFG["model_arch"]}_fold_{fold}_best')

    # one more epoch at full resolution with a small constant LR
    for g in optimizer.param_groups:
        g['lr'] = CFG['min_lr'] * 10
    ft_loader, ft_val_loader = prepare_dataloader(train, trn_idx, val_idx, CFG['ft_img_size'])
    finetune_one_epoch(model, loss_tr, optimizer, ft_loader, device)
    valid_one_epoch(CFG['epochs'], model, loss_fn, ft_val_loader, device)
    torch.save(model.state_dict(), f'{CFG["model_arch"]}_fold_{fold}_ft{CFG["ft_img_size"]}')

    oof[val_idx] = inference_one_epoch(model, ft_val_loader, device)
    del model, optimizer, train_loader, val_loader, scaler, scheduler
    torch.cuda.empty_cache()

print('OOF accuracy:', accuracy_score(train.label.values, oof.argmax(1)))
