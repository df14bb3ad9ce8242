"""
Toxic comment classification with a BiLSTM + self-attention, trained with AMP
=============================================================================

Companion code for the post "Training an LSTM classifier 2x faster with mixed
precision". The script is meant to be read (and run) top to bottom, cell by cell;
every `# %%` marker is one cell of the original notebook.

Data: Jigsaw toxic comment classification (train.csv / test.csv), GloVe 840B 300d.
"""
# %%
import math
import os
import random
import time
from collections import Counter

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

SEED = 1029
LABELS = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]
MAX_LEN = 220
MAX_FEATURES = 100_000
EMBED_SIZE = 300
LSTM_UNITS = 128
BATCH_SIZE = 512
EPOCHS = 4
LR = 2e-3
DATA_DIR = "../input/jigsaw-toxic-comment-classification-challenge"
GLOVE_PATH = "../input/glove840b300dtxt/glove.840B.300d.txt"

device = torch.device("cuda")


def seed_everything(seed=SEED):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


seed_everything()

# %% [markdown]
# ## 1. Tokenise and build the vocabulary
# Nothing fancy: lowercase + whitespace split, keep the 100k most frequent words.


# %%
def tokenize(text):
    return str(text).lower().replace("\n", " ").split()


def build_vocab(texts, max_features=MAX_FEATURES):
    counter = Counter(tok for t in texts for tok in tokenize(t))
    itos = ["<pad>", "<unk>"] + [w for w, _ in counter.most_common(max_features - 2)]
    return {w: i for i, w in enumerate(itos)}


def encode(texts, vocab, max_len=MAX_LEN):
    out = np.zeros((len(texts), max_len), dtype=np.int64)
    for i, t in enumerate(texts):
        ids = [vocab.get(tok, 1) for tok in tokenize(t)][:max_len]
        out[i, : len(ids)] = ids
    return out


def load_embeddings(path, vocab):
    matrix = np.random.normal(0, 0.1, (len(vocab), EMBED_SIZE)).astype(np.float32)
    with open(path, encoding="utf8") as f:
        for line in f:
            word, *vec = line.rstrip().split(" ")
            if word in vocab and len(vec) == EMBED_SIZE:
                matrix[vocab[word]] = np.asarray(vec, dtype=np.float32)
    matrix[0] = 0.0
    return matrix


train_df = pd.read_csv(f"{DATA_DIR}/train.csv")
test_df = pd.read_csv(f"{DATA_DIR}/test.csv")
vocab = build_vocab(train_df["comment_text"].values)
X = encode(train_df["comment_text"].values, vocab)
y = train_df[LABELS].values.astype(np.float32)
X_test = encode(test_df["comment_text"].values, vocab)
embedding_matrix = load_embeddings(GLOVE_PATH, vocab)

X_tr, X_val, y_tr, y_val = train_test_split(X, y, test_size=0.1, random_state=SEED)
train_loader = DataLoader(TensorDataset(torch.from_numpy(X_tr), torch.from_numpy(y_tr)),
                          batch_size=BATCH_SIZE, shuffle=True, drop_last=True)
valid_loader = DataLoader(TensorDataset(torch.from_numpy(X_val), torch.from_numpy(y_val)),
                          batch_size=BATCH_SIZE * 2)

# %% [markdown]
# ## 2. The model
# Frozen GloVe embeddings -> 2 x BiLSTM -> multi-head self-attention pooling -> MLP.
# The attention pooling is a trimmed version of the usual transformer layer; padded
# positions are masked out before the softmax.


# %%
class SpatialDropout(nn.Dropout2d):
    def forward(self, x):
        x = x.unsqueeze(2).permute(0, 3, 2, 1)
        x = super().forward(x)
        return x.permute(0, 3, 2, 1).squeeze(2)


class SelfAttentionPool(nn.Module):
    def __init__(self, dim, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.d_k = dim // n_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.query = nn.Parameter(torch.randn(1, 1, dim) * 0.02)

    def forward(self, h, pad_mask):
        b, t, d = h.shape
        _, k, v = self.qkv(h).chunk(3, dim=-1)
        q = self.query.expand(b, 1, d)
        q = q.view(b, 1, self.n_heads, self.d_k).transpose(1, 2)
        k = k.view(b, t, self.n_heads, self.d_k).transpose(1, 2)
        v = v.view(b, t, self.n_heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        scores = scores.masked_fill(pad_mask[:, None, None, :], -1e9)  # expect: AMP007
        attn = F.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, d)
        return out


class ToxicNet(nn.Module):
    def __init__(self, embedding_matrix, n_labels=len(LABELS)):
        super().__init__()
        num_words, embed_size = embedding_matrix.shape
        self.embedding = nn.Embedding(num_words, embed_size, padding_idx=0)
        self.embedding.weight = nn.Parameter(torch.tensor(embedding_matrix, dtype=torch.float32))
        self.embedding.weight.requires_grad = False
        self.embedding_dropout = SpatialDropout(0.3)
        self.lstm1 = nn.LSTM(embed_size, LSTM_UNITS, bidirectional=True, batch_first=True)
        self.lstm2 = nn.LSTM(LSTM_UNITS * 2, LSTM_UNITS, bidirectional=True, batch_first=True)
        self.pool = SelfAttentionPool(LSTM_UNITS * 2)
        self.linear = nn.Linear(LSTM_UNITS * 4, LSTM_UNITS * 4)
        self.out = nn.Linear(LSTM_UNITS * 4, n_labels)

    def features(self, x):
        pad_mask = x == 0
        h = self.embedding_dropout(self.embedding(x))
        h, _ = self.lstm1(h)
        h, _ = self.lstm2(h)
        max_pool, _ = torch.max(h, 1)
        att_pool = self.pool(h, pad_mask)
        h_cat = torch.cat((max_pool, att_pool), 1)
        return h_cat + F.relu(self.linear(h_cat))

    def forward(self, x):
        return torch.sigmoid(self.out(self.features(x)))


# %% [markdown]
# ## 3. Training with mixed precision
# `torch.autocast` runs the LSTMs and the linear layers in fp16, `GradScaler` takes care
# of gradient underflow. Gradients are unscaled before clipping.

# %%
model = ToxicNet(embedding_matrix).to(device)
criterion = nn.BCELoss()
optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.6 ** epoch)
scaler = torch.amp.GradScaler("cuda")


def train_one_epoch(model, loader):
    model.train()
    running = 0.0
    for xb, yb in tqdm(loader, leave=False):
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            probs = model(xb)
            loss = criterion(probs, yb)  # expect: AMP003
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        running += loss.item() * xb.size(0)
    return running / len(loader.dataset)


def evaluate(model, loader):
    model.eval()
    val_loss, preds = 0.0, []
    with torch.no_grad(), torch.autocast(device_type="cuda", dtype=torch.float16):
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            probs = model(xb)
            val_loss += F.binary_cross_entropy(probs, yb, reduction="sum").item()  # expect: AMP003
            preds.append(probs.float().cpu().numpy())
    preds = np.concatenate(preds)
    return val_loss / len(loader.dataset), preds


for epoch in range(EPOCHS):
    t0 = time.time()
    tr_loss = train_one_epoch(model, train_loader)
    val_loss, val_preds = evaluate(model, valid_loader)
    scheduler.step()
    auc = np.mean([roc_auc_score(y_val[:, i], val_preds[:, i]) for i in range(len(LABELS))])
    print(f"epoch {epoch + 1}: train {tr_loss:.4f}  val {val_loss:.4f}  auc {auc:.4f}  ({time.time() - t0:.0f}s)")

# %% [markdown]
# ## 4. v2: logits + BCEWithLogitsLoss
# Same backbone; v2 returns logits and the loss applies the sigmoid itself. The pooling
# layer is rewritten a little more compactly.


# %%
class MaskedAttnPool(SelfAttentionPool):
    def forward(self, h, pad_mask):
        b, t, d = h.shape
        _, k, v = self.qkv(h).chunk(3, dim=-1)
        q = self.query.expand(b, 1, d).view(b, 1, self.n_heads, self.d_k).transpose(1, 2)
        k = k.view(b, t, self.n_heads, self.d_k).transpose(1, 2)
        v = v.view(b, t, self.n_heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        scores = scores.masked_fill(pad_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        attn = scores.softmax(dim=-1)
        return torch.matmul(attn, v).transpose(1, 2).reshape(b, d)


class ToxicNetV2(ToxicNet):
    def __init__(self, embedding_matrix, n_labels=len(LABELS)):
        super().__init__(embedding_matrix, n_labels)
        self.pool = MaskedAttnPool(LSTM_UNITS * 2)

    def forward(self, x):
        return self.out(self.features(x))


model_v2 = ToxicNetV2(embedding_matrix).to(device)
criterion_v2 = nn.BCEWithLogitsLoss()
optimizer_v2 = torch.optim.Adam([p for p in model_v2.parameters() if p.requires_grad], lr=LR)
scaler_v2 = torch.amp.GradScaler("cuda")

for epoch in range(EPOCHS):
    model_v2.train()
    for xb, yb in tqdm(train_loader, leave=False):
        xb, yb = xb.to(device), yb.to(device)
        optimizer_v2.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model_v2(xb)
            loss = criterion_v2(logits, yb)
        scaler_v2.scale(loss).backward()
        scaler_v2.unscale_(optimizer_v2)
        nn.utils.clip_grad_norm_(model_v2.parameters(), 1.0)
        scaler_v2.step(optimizer_v2)
        scaler_v2.update()

    model_v2.eval()
    val_preds = []
    with torch.no_grad():
        for xb, yb in valid_loader:
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                logits = model_v2(xb.to(device))
                val_loss = criterion_v2(logits, yb.to(device))
            val_preds.append(torch.sigmoid(logits.float()).cpu().numpy())
    val_preds = np.concatenate(val_preds)
    auc = np.mean([roc_auc_score(y_val[:, i], val_preds[:, i]) for i in range(len(LABELS))])
    print(f"[v2] epoch {epoch + 1}: last val loss {val_loss.item():.4f}  auc {auc:.4f}")

# %% [markdown]
# ## 5. Pseudo-labelling
# Confident test predictions (p < 0.05 or p > 0.95 for every label) are added to the
# training set and v2 is fine-tuned for one more epoch at a lower learning rate.


# %%
def pseudo_label(model, X_unlabeled, low=0.05, high=0.95):
    model.eval()
    keep_x, keep_y = [], []
    loader = DataLoader(TensorDataset(torch.from_numpy(X_unlabeled)), batch_size=BATCH_SIZE * 2)
    with torch.inference_mode():
        for (xb,) in loader:
            probs = torch.sigmoid(model(xb.to(device)).float())
            confident = ((probs < low) | (probs > high)).all(dim=1)
            keep_x.append(xb[confident.cpu()])
            keep_y.append(probs[confident].round().cpu())
    return torch.cat(keep_x), torch.cat(keep_y)


def finetune_on_pseudo(model, loader, optimizer, scaler, epochs=1):
    model.train()
    for _ in range(epochs):
        for xb, yb in tqdm(loader, leave=False):
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                loss = criterion_v2(model(xb), yb)
            scaler.scale(loss).backward()
            optimizer.step()  # expect: AMP006
    return model


px, py = pseudo_label(model_v2, X_test)
pseudo_loader = DataLoader(
    TensorDataset(torch.cat([torch.from_numpy(X_tr), px]), torch.cat([torch.from_numpy(y_tr), py])),
    batch_size=BATCH_SIZE, shuffle=True, drop_last=True,
)
for g in optimizer_v2.param_groups:
    g["lr"] = LR * 0.1
finetune_on_pseudo(model_v2, pseudo_loader, optimizer_v2, scaler_v2)


# %% [markdown]
# ## 6. Submission
# For inference the weights are simply cast to fp16: no autocast, no gradients.


# %%
def predict(model, X_in):
    model = model.eval().half()
    loader = DataLoader(TensorDataset(torch.from_numpy(X_in)), batch_size=BATCH_SIZE * 4)
    out = []
    with torch.inference_mode():
        for (xb,) in loader:
            out.append(torch.sigmoid(model(xb.to(device)).float()).cpu().numpy())
    return np.concatenate(out)


test_preds = predict(model_v2, X_test)
submission = pd.DataFrame(test_preds, columns=LABELS)
submission.insert(0, "id", test_df["id"].values)
submission.to_csv("submission.csv", index=False)
