# %% [markdown]
# # FB3 / English Language Learning - DeBERTa-v3-base baseline [train]
# 4-fold MultilabelStratifiedKFold, mean pooling head, SmoothL1 loss.
# CV 0.4509 / LB 0.44 with the default CFG below.

# %%
import os
import gc
import time
import random
import warnings

warnings.filterwarnings("ignore")

import numpy as np
import pandas as pd
from tqdm.auto import tqdm
from sklearn.metrics import mean_squared_error

import torch
import torch.nn as nn
from torch.optim import AdamW
from torch.utils.data import DataLoader, Dataset

from transformers import AutoTokenizer, AutoModel, AutoConfig
from transformers import get_linear_schedule_with_warmup, get_cosine_schedule_with_warmup
from iterstrat.ml_stratifiers import MultilabelStratifiedKFold

os.environ["TOKENIZERS_PARALLELISM"] = "true"
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

OUTPUT_DIR = "./"
os.makedirs(OUTPUT_DIR, exist_ok=True)


# %%
class CFG:
    debug = False
    apex = True
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
    target_cols = ["cohesion", "syntax", "vocabulary", "phraseology", "grammar", "conventions"]
    seed = 42
    n_fold = 4
    trn_fold = [0, 1, 2, 3]
    train = True


if CFG.debug:
    CFG.epochs = 2
    CFG.trn_fold = [0]


# %% Utils
def MCRMSE(y_trues, y_preds):
    scores = [mean_squared_error(y_trues[:, i], y_preds[:, i], squared=False) for i in range(y_trues.shape[1])]
    return np.mean(scores), scores


get_score = MCRMSE


def get_logger(filename=OUTPUT_DIR + "train"):
    from logging import getLogger, INFO, StreamHandler, FileHandler
    logger = getLogger(__name__)
    logger.setLevel(INFO)
    logger.addHandler(StreamHandler())
    logger.addHandler(FileHandler(filename=f"{filename}.log"))
    return logger


LOGGER = get_logger()


def seed_everything(seed=42):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


seed_everything(seed=CFG.seed)

# %% Data Loading
train = pd.read_csv("../input/feedback-prize-english-language-learning/train.csv")
Fold = MultilabelStratifiedKFold(n_splits=CFG.n_fold, shuffle=True, random_state=CFG.seed)
for n, (train_index, val_index) in enumerate(Fold.split(train, train[CFG.target_cols])):
    train.loc[val_index, "fold"] = int(n)
train["fold"] = train["fold"].astype(int)

tokenizer = AutoTokenizer.from_pretrained(CFG.model)
tokenizer.save_pretrained(OUTPUT_DIR + "tokenizer/")
CFG.tokenizer = tokenizer


# %% Dataset
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
        self.labels = df[cfg.target_cols].values if cfg.target_cols[0] in df else None

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, item):
        inputs = prepare_input(self.cfg, self.texts[item])
        label = torch.tensor(self.labels[item], dtype=torch.float)
        return inputs, label


def collate(inputs):
    mask_len = int(inputs["attention_mask"].sum(axis=1).max())
    for k, v in inputs.items():
        inputs[k] = inputs[k][:, :mask_len]
    return inputs


# %% Model
class MeanPooling(nn.Module):
    def forward(self, last_hidden_state, attention_mask):
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(last_hidden_state.size()).float()
        sum_embeddings = torch.sum(last_hidden_state * input_mask_expanded, 1)
        sum_mask = input_mask_expanded.sum(1)
        sum_mask = torch.clamp(sum_mask, min=1e-9)
        mean_embeddings = sum_embeddings / sum_mask
        return mean_embeddings


class CustomModel(nn.Module):
    def __init__(self, cfg, config_path=None, pretrained=False):
        super().__init__()
        self.cfg = cfg
        if config_path is None:
            self.config = AutoConfig.from_pretrained(cfg.model, output_hidden_states=True)
            self.config.hidden_dropout = 0.0
            self.config.hidden_dropout_prob = 0.0
            self.config.attention_dropout = 0.0
            self.config.attention_probs_dropout_prob = 0.0
        else:
            self.config = torch.load(config_path)
        if pretrained:
            self.model = AutoModel.from_pretrained(cfg.model, config=self.config)
        else:
            self.model = AutoModel(self.config)
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.pool = MeanPooling()
        self.fc = nn.Linear(self.config.hidden_size, 6)
        self._init_weights(self.fc)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()

    def feature(self, inputs):
        outputs = self.model(**inputs)
        last_hidden_states = outputs[0]
        feature = self.pool(last_hidden_states, inputs["attention_mask"])
        return feature

    def forward(self, inputs):
        feature = self.feature(inputs)
        output = self.fc(feature)
        return output


# %% Helper functions
class AverageMeter(object):
    """Computes and stores the average and current value"""

    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def timeSince(since, percent):
    s = time.time() - since
    return "%dm (remain %dm)" % (s // 60, (s / percent - s) // 60)


def train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, device):
    model.train()
    scaler = torch.cuda.amp.GradScaler(enabled=CFG.apex)  # expect: AMP009
    losses = AverageMeter()
    start = time.time()
    global_step = 0
    for step, (inputs, labels) in enumerate(train_loader):
        inputs = collate(inputs)
        for k, v in inputs.items():
            inputs[k] = v.to(device)
        labels = labels.to(device)
        batch_size = labels.size(0)
        with torch.cuda.amp.autocast(enabled=CFG.apex):  # expect: AMP009
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
            global_step += 1
            if CFG.batch_scheduler:
                scheduler.step()
        if step % CFG.print_freq == 0 or step == (len(train_loader) - 1):
            print(f"Epoch: [{epoch + 1}][{step}/{len(train_loader)}] "
                  f"Elapsed {timeSince(start, float(step + 1) / len(train_loader))} "
                  f"Loss: {losses.val:.4f}({losses.avg:.4f}) Grad: {grad_norm:.4f} "
                  f"LR: {scheduler.get_lr()[0]:.8f}")
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
            with torch.cuda.amp.autocast(enabled=CFG.apex):  # expect: AMP009
                y_preds = model(inputs)
            loss = criterion(y_preds, labels)  # expect: AMP002
        if CFG.gradient_accumulation_steps > 1:
            loss = loss / CFG.gradient_accumulation_steps
        losses.update(loss.item(), batch_size)
        preds.append(y_preds.float().to("cpu").numpy())
        if step % CFG.print_freq == 0 or step == (len(valid_loader) - 1):
            print(f"EVAL: [{step}/{len(valid_loader)}] "
                  f"Elapsed {timeSince(start, float(step + 1) / len(valid_loader))} "
                  f"Loss: {losses.val:.4f}({losses.avg:.4f})")
    predictions = np.concatenate(preds)
    return losses.avg, predictions


# %% train loop
def get_optimizer_params(model, encoder_lr, decoder_lr, weight_decay=0.0):
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    optimizer_parameters = [
        {"params": [p for n, p in model.model.named_parameters() if not any(nd in n for nd in no_decay)],
         "lr": encoder_lr, "weight_decay": weight_decay},
        {"params": [p for n, p in model.model.named_parameters() if any(nd in n for nd in no_decay)],
         "lr": encoder_lr, "weight_decay": 0.0},
        {"params": [p for n, p in model.named_parameters() if "model" not in n],
         "lr": decoder_lr, "weight_decay": 0.0},
    ]
    return optimizer_parameters


def get_scheduler(cfg, optimizer, num_train_steps):
    if cfg.scheduler == "linear":
        return get_linear_schedule_with_warmup(optimizer, cfg.num_warmup_steps, num_train_steps)
    return get_cosine_schedule_with_warmup(optimizer, cfg.num_warmup_steps, num_train_steps,
                                           num_cycles=cfg.num_cycles)


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

    optimizer_parameters = get_optimizer_params(model, encoder_lr=CFG.encoder_lr,
                                                decoder_lr=CFG.decoder_lr, weight_decay=CFG.weight_decay)
    optimizer = AdamW(optimizer_parameters, lr=CFG.encoder_lr, eps=CFG.eps, betas=CFG.betas)
    num_train_steps = int(len(train_folds) / CFG.batch_size * CFG.epochs)
    scheduler = get_scheduler(CFG, optimizer, num_train_steps)

    criterion = nn.SmoothL1Loss(reduction="mean")
    best_score = np.inf

    for epoch in range(CFG.epochs):
        start_time = time.time()
        avg_loss = train_fn(fold, train_loader, model, criterion, optimizer, epoch, scheduler, device)
        avg_val_loss, predictions = valid_fn(valid_loader, model, criterion, device)
        score, scores = get_score(valid_labels, predictions)
        elapsed = time.time() - start_time
        LOGGER.info(f"Epoch {epoch+1} - avg_train_loss: {avg_loss:.4f}  avg_val_loss: {avg_val_loss:.4f}  time: {elapsed:.0f}s")
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


# %% run k-fold
def get_result(oof_df):
    labels = oof_df[CFG.target_cols].values
    score, scores = get_score(labels, oof_df[[f"pred_{c}" for c in CFG.target_cols]].values)
    LOGGER.info(f"Score: {score:<.4f}  Scores: {scores}")


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


# %% inference (same kernel, test set)
class TestDataset(TrainDataset):
    def __getitem__(self, item):
        return prepare_input(self.cfg, self.texts[item])


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


test = pd.read_csv("../input/feedback-prize-english-language-learning/test.csv")
test_loader = DataLoader(TestDataset(CFG, test), batch_size=CFG.batch_size * 2, shuffle=False,
                         num_workers=CFG.num_workers, pin_memory=True, drop_last=False)
predictions = []
for fold in CFG.trn_fold:
    model = CustomModel(CFG, config_path=OUTPUT_DIR + "config.pth", pretrained=False)
    state = torch.load(OUTPUT_DIR + f"{CFG.model.replace('/', '-')}_fold{fold}_best.pth",
                       map_location=torch.device("cpu"))
    model.load_state_dict(state["model"])
    predictions.append(inference_fn(test_loader, model, device))
    del model, state
    gc.collect()
    torch.cuda.empty_cache()
predictions = np.mean(predictions, axis=0)
test[CFG.target_cols] = predictions
test[["text_id"] + CFG.target_cols].to_csv("submission.csv", index=False)
