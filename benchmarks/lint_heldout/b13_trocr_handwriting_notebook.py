# %% [markdown]
# # TrOCR fine-tuning on IAM handwriting lines (Kaggle notebook export)
# The P100 only has 16 GB, so the whole model is kept in half precision during training.

# %%
import copy
import os
import random

import numpy as np
import pandas as pd
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import TrOCRProcessor, VisionEncoderDecoderModel

CFG = {
    "model_name": "microsoft/trocr-base-handwritten",
    "data_dir": "/kaggle/input/iam-handwriting-lines",
    "epochs": 8,
    "batch_size": 12,
    "lr": 3e-5,
    "max_target_len": 64,
    "num_beams": 4,
    "seed": 42,
    "out": "/kaggle/working",
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)


seed_everything(CFG["seed"])

# %%
df = pd.read_csv(os.path.join(CFG["data_dir"], "lines.csv"))
df = df.sample(frac=1.0, random_state=CFG["seed"]).reset_index(drop=True)
n_val = int(0.1 * len(df))
valid_df, train_df = df.iloc[:n_val].reset_index(drop=True), df.iloc[n_val:].reset_index(drop=True)
processor = TrOCRProcessor.from_pretrained(CFG["model_name"])


class IAMDataset(Dataset):
    def __init__(self, frame, processor, max_len):
        self.frame, self.processor, self.max_len = frame, processor, max_len

    def __len__(self):
        return len(self.frame)

    def __getitem__(self, idx):
        row = self.frame.iloc[idx]
        image = Image.open(os.path.join(CFG["data_dir"], "lines", row["file_name"])).convert("RGB")
        pixel_values = self.processor(image, return_tensors="pt").pixel_values.squeeze(0)
        labels = self.processor.tokenizer(row["text"], padding="max_length", max_length=self.max_len,
                                          truncation=True).input_ids
        labels = [t if t != self.processor.tokenizer.pad_token_id else -100 for t in labels]
        return {"pixel_values": pixel_values, "labels": torch.tensor(labels)}


train_loader = DataLoader(IAMDataset(train_df, processor, CFG["max_target_len"]), batch_size=CFG["batch_size"],
                          shuffle=True, num_workers=2, drop_last=True)
valid_loader = DataLoader(IAMDataset(valid_df, processor, CFG["max_target_len"]), batch_size=CFG["batch_size"] * 2,
                          num_workers=2)


# %%
def build_model():
    model = VisionEncoderDecoderModel.from_pretrained(CFG["model_name"])
    model.config.decoder_start_token_id = processor.tokenizer.cls_token_id
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.vocab_size = model.config.decoder.vocab_size
    model.config.eos_token_id = processor.tokenizer.sep_token_id
    model.config.max_length = CFG["max_target_len"]
    model.config.num_beams = CFG["num_beams"]
    return model.to(DEVICE)


def char_error_rate(preds, refs):
    import editdistance

    errs = sum(editdistance.eval(p, r) for p, r in zip(preds, refs))
    return errs / max(1, sum(len(r) for r in refs))


@torch.no_grad()
def validate(model, loader):
    model.eval()
    preds, refs = [], []
    for batch in tqdm(loader, desc="valid", leave=False):
        pixel_values = batch["pixel_values"].to(DEVICE).half()
        generated = model.generate(pixel_values, max_length=CFG["max_target_len"], num_beams=CFG["num_beams"])
        preds += processor.batch_decode(generated, skip_special_tokens=True)
        labels = batch["labels"].clone()
        labels[labels == -100] = processor.tokenizer.pad_token_id
        refs += processor.batch_decode(labels, skip_special_tokens=True)
    model.train()
    return char_error_rate(preds, refs), preds[:5], refs[:5]


# %%
def train():
    model = build_model()
    model = model.half()  # expect: AMP001
    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG["lr"])  # expect: AMP011
    total_steps = CFG["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=CFG["lr"], total_steps=total_steps,
                                                    pct_start=0.1)
    best_cer = 1.0
    for epoch in range(CFG["epochs"]):
        model.train()
        pbar = tqdm(train_loader, desc=f"epoch {epoch}")
        running = 0.0
        for step, batch in enumerate(pbar):
            pixel_values = batch["pixel_values"].to(DEVICE).half()  # expect: AMP001
            labels = batch["labels"].to(DEVICE)
            outputs = model(pixel_values=pixel_values, labels=labels)
            loss = outputs.loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            running = 0.98 * running + 0.02 * loss.item() if step else loss.item()
            pbar.set_postfix(loss=f"{running:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")

        cer, sample_preds, sample_refs = validate(model, valid_loader)
        print(f"epoch {epoch}: CER {cer:.4f}")
        for p, r in zip(sample_preds, sample_refs):
            print(f"  pred: {p!r}\n  ref : {r!r}")
        if cer < best_cer:
            best_cer = cer
            model.save_pretrained(os.path.join(CFG["out"], "trocr-best"))
            processor.save_pretrained(os.path.join(CFG["out"], "trocr-best"))
    return model, best_cer


# %%
model, best_cer = train()
print("best CER", best_cer)

# %%
# Small fp16 copy for the submission kernel
submission_model = copy.deepcopy(model).half().eval()
torch.save(submission_model.state_dict(), os.path.join(CFG["out"], "trocr_fp16.pt"))


# %%
def predict_lines(model, image_paths, batch_size=16):
    model.eval()
    out = []
    for i in range(0, len(image_paths), batch_size):
        images = [Image.open(p).convert("RGB") for p in image_paths[i: i + batch_size]]
        pv = processor(images, return_tensors="pt").pixel_values.to(DEVICE).half()
        with torch.inference_mode():
            ids = model.generate(pv, num_beams=CFG["num_beams"], max_length=CFG["max_target_len"])
        out += processor.batch_decode(ids, skip_special_tokens=True)
    return out


test_files = sorted(os.path.join(CFG["data_dir"], "test", f) for f in os.listdir(os.path.join(CFG["data_dir"], "test")))
pd.DataFrame({"file": test_files, "text": predict_lines(model, test_files)}).to_csv("submission.csv", index=False)
