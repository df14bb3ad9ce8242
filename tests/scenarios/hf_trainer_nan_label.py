"""EXPECT: AMP103,AMP112
MAY: AMP104
FAULT: a Hugging Face `Trainer` run (`use_cpu=True, bf16=True`, accelerate's CPU bf16
autocast around the model's forward, no scaler) fine-tuning a tiny randomly initialised
BERT regressor built from a config (`BertConfig(num_hidden_layers=2, hidden_size=64)`,
`num_labels=1`, `problem_type="regression"`, so the model computes `MSELoss` itself and the
Trainer backpropagates `outputs.loss`). The synthetic dataset has one example whose target
is missing and was read as NaN (`labels[37] = nan`, a CSV hole). The Trainer's seeded
shuffle puts it into the batch of training step STEP_OF_NAN (printed; step 9 in the plain
run). That step's loss is NaN when backward starts; the gradients are NaN; the Trainer's
`clip_grad_norm_` (max_grad_norm=1.0) multiplies them by a NaN coefficient and AdamW steps
on them (no GradScaler in bf16), so every weight is NaN and every later loss is NaN too
(plain run: losses finite up to step 8, NaN from step 9 on).
AMP112's page: "Checks the tensor that `backward()` starts from and reports when it is NaN
or Inf"; AMP103's page: "Reports NaN/Inf gradients that reached an optimizer step without a
GradScaler catching them". No AMP101 is expected: the NaN enters as data (a label, an input
of `mse_loss`), not from an op with finite inputs ("the first op whose output holds NaN or
Inf while all of its inputs were finite"), and after the bad step every op has NaN weights
among its inputs.
MAY AMP104: the pages do not say how a NaN total gradient norm compares with AMP104's
thresholds.
"""
import json
import tempfile
import time
import warnings

import torch

torch.set_num_threads(1)

from torch.utils.data import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.utils import logging as hf_logging  # noqa: E402

import amp_runtime  # noqa: E402

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
SEQ, VOCAB, NAN_INDEX = 16, 100, 37


class ScoreData(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, VOCAB, (n, SEQ), generator=g)
        self.ids[:, 0] = 2  # [CLS]-like token
        self.y = (self.ids[:, 1:] < 40).float().mean(1) * 4.0 - 1.0  # a learnable score
        self.y[NAN_INDEX] = float("nan")  # FAULT: a missing target read as NaN

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(SEQ, dtype=torch.long),
            "labels": self.y[i],
            "idx": torch.tensor(i),
        }


class IndexedTrainer(Trainer):
    """Notes the step whose batch holds the NaN label; otherwise the stock compute_loss."""

    nan_step = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        idx = inputs.pop("idx")
        if self.nan_step is None and bool((idx == NAN_INDEX).any()):
            IndexedTrainer.nan_step = self.state.global_step
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def main():
    set_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=SEQ, num_labels=1, problem_type="regression",
    )
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=True,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        max_steps=12,
        max_grad_norm=1.0,
        logging_steps=1,
        logging_nan_inf_filter=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        seed=0,
    )
    trainer = IndexedTrainer(model=model, args=args, train_dataset=ScoreData(96, 9))
    t0 = time.time()
    with amp_runtime.guard(policy="record") as g:
        trainer.train()
    print(f"WALL {time.time() - t0:.2f}s STEP_OF_NAN={IndexedTrainer.nan_step}")
    hist = [h for h in trainer.state.log_history if "loss" in h]
    print("LOSSES", [round(float(h["loss"]), 6) for h in hist])
    print("WEIGHTSUM", float(sum(p.detach().double().sum() for p in model.parameters())))
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
