#!/usr/bin/env python
# coding: utf-8
# FB3 - English Language Learning | DeBERTa-v3-base baseline [train]
# exported from the competition notebook (kernel version 14)

import os

OUTPUT_DIR = "./"
os.makedirs(OUTPUT_DIR, exist_ok=True)


# ====================== CFG ======================
class CFG:
    debug = False
    apex = True  # bf16 mixed precision (deberta-v3 gives nan losses in fp16)
    print_freq = 20
    num_workers = 4
    model = "microsoft/deberta-v3-base"
    gradient_checkpointing = True
    scheduler = "cosine"  # ['linear', 'cosine']
    batch_scheduler = True
    num_cycles = 0.5
    num_warmup_steps = 0
    epochs = 4
    encoder_lr = 2e-5
    decoder_lr = 2e-5
    eps = 1e-6
    betas = (0.9, 0.999)
    batch_size = 8
    max_len = 512
    weight_decay = 0.01
    gradient_accumulation_steps = 1
    max_grad_norm = 1000
    pooling = "attention"  # ['mean', 'attention']
    target_cols = ["cohesion", "syntax", "vocabulary", "phraseology", "grammar", "conventions"]
    seed = 42
    n_fold = 4
    trn_fold = [0, 1, 2, 3]
    train = True


if CFG.debug:
    CFG.epochs, CFG.trn_fold = 2, [0]

# ====================== Library ======================
import gc
import time
import random
import warnings

warnings.filterwarnings("ignore")

import numpy as np
import pandas as pd
from tqdm.auto import tqdm
from iterstrat.ml_stratifiers import MultilabelStratifiedKFold

import torch
import torch.nn as nn
from torch.optim import AdamW
from torch.utils.data import DataLoader, Dataset

from transformers import AutoTokenizer, AutoModel, AutoConfig
from transformers import get_linear_schedule_with_warmup, get_cosine_schedule_with_warmup

os.environ["TOKENIZERS_PARALLELISM"] = "true"
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ====================== Utils ======================
def get_score(y_trues, y_preds):
    scores = [np.sqrt(np.mean((y_trues[:, i] - y_preds[:, i]) ** 2)) for i in range(y_trues.shape[1])]
    return np.mean(scores), scores


def get_logger(filename=OUTPUT_DIR + "train"):
    from logging import getLogger, INFO, StreamHandler, FileHandler, Formatter

    logger = getLogger(__name__)
    logger.setLevel(INFO)
    for handler in (StreamHandler(), FileHandler(filename=f"{filename}.log")):
        handler.setFormatter(Formatter("%(message)s"))
        logger.addHandler(handler)
    return logger


LOGGER = get_logger()


def seed_everything(seed=42):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


seed_everything(seed=CFG.seed)

# ====================== Data Loading / CV split ======================
train = pd.read_csv("../input/feedback-prize-english-language-learning/train.csv")
test = pd.read_csv("../input/feedback-prize-english-language-learning/test.csv")

Fold = MultilabelStratifiedKFold(n_splits=CFG.n_fold, shuffle=True, random_state=CFG.seed)
for n, (train_index, val_index) in enumerate(Fold.split(train, train[CFG.target_cols])):
    train.loc[val_index, "fold"] = int(n)
train["fold"] = train["fold"].astype(int)

tokenizer = AutoTokenizer.from_pretrained(CFG.model)
tokenizer.save_pretrained(OUTPUT_DIR + "tokenizer/")
CFG.tokenizer = tokenizer


# ====================== Dataset ======================
def prepare_input(cfg, text):
    inputs = cfg.tokenizer.encode_plus(text, return_tensors=None, add_special_tokens=True,
                                       max_length=cfg.max_len, pad_to_max_length=True, truncation=True)
    for k, v in inputs.items():
        inputs[k] = torch.tensor(v, dtype=torch.long)
    return inputs


class TrainDataset(Dataset):
    def __init__(self, cfg, df):
        self.cfg = cfg
        self.texts = df["full_text"].values
        self.labels = df[cfg.target_cols].values

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, item):
        return prepare_input(self.cfg, self.texts[item]), torch.tensor(self.labels[item], dtype=torch.float)


class TestDataset(TrainDataset):
    def __getitem__(self, item):
        return prepare_input(self.cfg, self.texts[item])


def collate(inputs):
    mask_len = int(inputs["attention_mask"].sum(axis=1).max())
    return {k: v[:, :mask_len] for k, v in inputs.items()}


# ====================== Model ======================
class MeanPooling(nn.Module):
    def forward(self, last_hidden_state, attention_mask):
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(last_hidden_state.size()).float()
        sum_embeddings = torch.sum(last_hidden_state * input_mask_expanded, 1)
        sum_mask = torch.clamp(input_mask_expanded.sum(1), min=1e-9)
        return sum_embeddings / sum_mask


class AttentionPooling(nn.Module):
    def __init__(self, in_dim):
        super().__init__()
        self.attention = nn.Sequential(nn.Linear(in_dim, in_dim), nn.LayerNorm(in_dim), nn.GELU(), nn.Linear(in_dim, 1))

    def forward(self, last_hidden_state, attention_mask):
        w = self.attention(last_hidden_state)
        w = w.masked_fill(attention_mask.unsqueeze(-1) == 0, torch.finfo(w.dtype).min)
        w = torch.softmax(w, 1)
        return torch.sum(w * last_hidden_state, dim=1)


class CustomModel(nn.Module):
    def __init__(self, cfg, config_path=None, pretrained=False):
        super().__init__()
        self.cfg = cfg
        if config_path is None:
            self.config = AutoConfig.from_pretrained(cfg.model, output_hidden_states=True)
            for key in ("hidden_dropout", "hidden_dropout_prob", "attention_dropout", "attention_probs_dropout_prob"):
                setattr(self.config, key, 0.0)
        else:
            self.config = torch.load(config_path)
        self.model = AutoModel.from_pretrained(cfg.model, config=self.config) if pretrained else AutoModel.from_config(self.config)
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if cfg.pooling == "attention":
            self.pool = AttentionPooling(self.config.hidden_size)
        else:
            self.pool = MeanPooling()
        self.fc = nn.Linear(self.config.hidden_size, len(cfg.target_cols))
        self._init_weights(self.fc)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()

    def feature(self, inputs):
        last_hidden_states = self.model(**inputs)[0]
        return self.pool(last_hidden_states, inputs["attention_mask"])

    def forward(self, inputs):
        feature = self.feature(inputs)
        return self.fc(feature)


# ====================== Loss ======================
class RMSELoss(nn.Module):
    def __init__(self, reduction="mean", eps=1e-9):
        super().__init__()
        self.mse = nn.MSELoss(reduction="none")
        self.reduction = reduction
        self.eps = eps

    def forward(self, y_pred, y_true):
        loss = torch.sqrt(self.mse(y_pred, y_true) + self.eps)
        if self.reduction == "sum":
            return loss.sum()
        return loss.mean() if self.reduction == "mean" else loss


# ====================== Helper functions ======================
class AverageMeter(object):
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val, self.sum, self.count = val, self.sum + val * n, self.count + n
        self.avg = self.sum / self.count


def timeSince(since, percent):
    s = time.time() - since
    rs = s / percent - s
    return "%dm %ds (remain %dm %ds)" % (s // 60, s % 60, rs // 60, rs % 60)


def train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, device):
    model.train()
    scaler = torch.cuda.amp.GradScaler(enabled=CFG.apex)  # expect: AMP009 AMP010
    losses = AverageMeter()
    start = time.time()
    for step, (inputs, labels) in enumerate(train_loader):
        inputs = collate(inputs)
        for k, v in inputs.items():
            inputs[k] = v.to(device)
        labels = labels.to(device)
        batch_size = labels.size(0)
        with torch.cuda.amp.autocast(enabled=CFG.apex, dtype=torch.bfloat16):  # expect: AMP009
            y_preds = model(inputs)
            loss = criterion(y_preds, labels)
        if CFG.gradient_accumulation_steps > 1:
            loss = loss / CFG.gradient_accumulation_steps
        losses.update(loss.item(), batch_size)
        scaler.scale(loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CFG.max_grad_norm)  # expect: AMP005
        if (step + 1) % CFG.gradient_accumulation_steps == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if CFG.batch_scheduler:
                scheduler.step()
        if step % CFG.print_freq == 0 or step == (len(train_loader) - 1):
            print(f"Epoch: [{epoch + 1}][{step}/{len(train_loader)}] "
                  f"Elapsed {timeSince(start, float(step + 1) / len(train_loader))} "
                  f"Loss: {losses.val:.4f}({losses.avg:.4f}) Grad: {grad_norm:.4f} LR: {scheduler.get_lr()[0]:.8f}")
    return losses.avg


def valid_fn(valid_loader, model, criterion, device):
    losses = AverageMeter()
    model.eval()
    preds = []
    start = time.time()
    for step, (inputs, labels) in enumerate(valid_loader):
        inputs = collate(inputs)
        for k, v in inputs.items():
            inputs[k] = v.to(device)
        labels = labels.to(device)
        batch_size = labels.size(0)
        with torch.no_grad():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=CFG.apex):
                y_preds = model(inputs)
                loss = criterion(y_preds, labels)
        if CFG.gradient_accumulation_steps > 1:
            loss = loss / CFG.gradient_accumulation_steps
        losses.update(loss.item(), batch_size)
        preds.append(y_preds.float().to("cpu").numpy())
        if step % CFG.print_freq == 0 or step == (len(valid_loader) - 1):
            print(f"EVAL: [{step}/{len(valid_loader)}] Elapsed {timeSince(start, float(step + 1) / len(valid_loader))} "
                  f"Loss: {losses.val:.4f}({losses.avg:.4f})")
    return losses.avg, np.concatenate(preds)


def inference_fn(test_loader, model, device):
    preds = []
    model.eval()
    model.to(device)
    model.half()
    for inputs in tqdm(test_loader, total=len(test_loader)):
        inputs = collate(inputs)
        for k, v in inputs.items():
            inputs[k] = v.to(device)
        with torch.no_grad():
            y_preds = model(inputs)
        preds.append(y_preds.float().to("cpu").numpy())
    return np.concatenate(preds)


def get_optimizer_params(model, encoder_lr, decoder_lr, weight_decay=0.0):
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    return [
        {"params": [p for n, p in model.model.named_parameters() if not any(nd in n for nd in no_decay)],
         "lr": encoder_lr, "weight_decay": weight_decay},
        {"params": [p for n, p in model.model.named_parameters() if any(nd in n for nd in no_decay)],
         "lr": encoder_lr, "weight_decay": 0.0},
        {"params": [p for n, p in model.named_parameters() if "model" not in n],
         "lr": decoder_lr, "weight_decay": 0.0},
    ]


def get_scheduler(cfg, optimizer, num_train_steps):
    if cfg.scheduler == "linear":
        return get_linear_schedule_with_warmup(optimizer, cfg.num_warmup_steps, num_train_steps)
    return get_cosine_schedule_with_warmup(optimizer, cfg.num_warmup_steps, num_train_steps, num_cycles=cfg.num_cycles)


# ====================== train loop ======================
def train_loop(folds, fold):
    LOGGER.info(f"========== fold: {fold} training ==========")
    train_folds = folds[folds["fold"] != fold].reset_index(drop=True)
    valid_folds = folds[folds["fold"] == fold].reset_index(drop=True)
    valid_labels = valid_folds[CFG.target_cols].values
    train_loader = DataLoader(TrainDataset(CFG, train_folds), batch_size=CFG.batch_size, shuffle=True,
                              num_workers=CFG.num_workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(TrainDataset(CFG, valid_folds), batch_size=CFG.batch_size * 2, shuffle=False,
                              num_workers=CFG.num_workers, pin_memory=True, drop_last=False)

    model = CustomModel(CFG, config_path=None, pretrained=True)
    torch.save(model.config, OUTPUT_DIR + "config.pth")
    model.to(device)

    optimizer_parameters = get_optimizer_params(model, encoder_lr=CFG.encoder_lr, decoder_lr=CFG.decoder_lr,
                                                weight_decay=CFG.weight_decay)
    optimizer = AdamW(optimizer_parameters, lr=CFG.encoder_lr, eps=CFG.eps, betas=CFG.betas)
    num_train_steps = int(len(train_folds) / CFG.batch_size * CFG.epochs)
    scheduler = get_scheduler(CFG, optimizer, num_train_steps)

    criterion = RMSELoss(reduction="mean")  # nn.SmoothL1Loss(reduction="mean")
    best_score = 1e9

    for epoch in range(CFG.epochs):
        start_time = time.time()
        avg_loss = train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, device)
        avg_val_loss, predictions = valid_fn(valid_loader, model, criterion, device)
        score, scores = get_score(valid_labels, predictions)
        LOGGER.info(f"Epoch {epoch+1} - avg_train_loss: {avg_loss:.4f}  avg_val_loss: {avg_val_loss:.4f}  "
                    f"time: {time.time() - start_time:.0f}s")
        LOGGER.info(f"Epoch {epoch+1} - Score: {score:.4f}  Scores: {scores}")
        if best_score > score:
            best_score = score
            LOGGER.info(f"Epoch {epoch+1} - Save Best Score: {best_score:.4f} Model")
            torch.save({"model": model.state_dict(), "predictions": predictions},
                       OUTPUT_DIR + f"{CFG.model.replace('/', '-')}_fold{fold}_best.pth")

    predictions = torch.load(OUTPUT_DIR + f"{CFG.model.replace('/', '-')}_fold{fold}_best.pth",
                             map_location=torch.device("cpu"))["predictions"]
    valid_folds[[f"pred_{c}" for c in CFG.target_cols]] = predictions
    torch.cuda.empty_cache()
    gc.collect()
    return valid_folds


def get_result(oof_df):
    labels = oof_df[CFG.target_cols].values
    preds = oof_df[[f"pred_{c}" for c in CFG.target_cols]].values
    score, scores = get_score(labels, preds)
    LOGGER.info(f"Score: {score:<.4f}  Scores: {scores}")


if __name__ == "__main__":
    if CFG.train:
        oof_df = pd.DataFrame()
        for fold in range(CFG.n_fold):
            if fold in CFG.trn_fold:
                _oof_df = train_loop(train, fold)
                oof_df = pd.concat([oof_df, _oof_df])
                LOGGER.info(f"========== fold: {fold} result ==========")
                get_result(_oof_df)
        oof_df = oof_df.reset_index(drop=True)
        LOGGER.info("========== CV ==========")
        get_result(oof_df)
        oof_df.to_pickle(OUTPUT_DIR + "oof_df.pkl")

    test_loader = DataLoader(TestDataset(CFG, test), batch_size=CFG.batch_size, shuffle=False,
                             num_workers=CFG.num_workers, pin_memory=True)
    fold_preds = []
    for fold in CFG.trn_fold:
        model = CustomModel(CFG, config_path=OUTPUT_DIR + "config.pth", pretrained=False)
        model.load_state_dict(torch.load(OUTPUT_DIR + f"{CFG.model.replace('/', '-')}_fold{fold}_best.pth",
                                         map_location=torch.device("cpu"))["model"])
        fold_preds.append(inference_fn(test_loader, model, device))
        del model
        gc.collect()
    test[CFG.target_cols] = np.mean(fold_preds, axis=0)
    test[["text_id"] + CFG.target_cols].to_csv("submission.csv", index=False)
