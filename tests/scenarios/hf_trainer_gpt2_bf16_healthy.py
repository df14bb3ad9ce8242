"""EXPECT: none
HEALTHY: a Hugging Face `Trainer` run of a tiny randomly initialised GPT-2 built from a
config (`GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)`,
no download, no tokenizer: the dataset yields `input_ids`/`labels` directly) on a
synthetic language of repeating token patterns, with
`TrainingArguments(use_cpu=True, bf16=True, gradient_accumulation_steps=2,
max_grad_norm=1.0, warmup_steps=2, max_steps=12)`. transformers 5.17 relies on accelerate
for autocast (`Trainer.autocast_smart_context_manager` returns a null context;
`TrainingArguments` sets `mixed_precision="bf16"`), so accelerate wraps the model's forward
in CPU bf16 autocast and converts the outputs to fp32; the LM loss is computed inside the
model's forward (`outputs.loss`, REAL_WORLD_IDIOMS idiom 6), `accelerator.backward(loss)`
runs outside autocast, the Trainer clips with `accelerator.clip_grad_norm_` and steps its
prepared AdamW with no scaler (bf16: correct). Token embeddings get exact-zero rows for
tokens absent from a batch ("Zero is not underflow"). A plain run shows no fp16/bf16
reduction anywhere in the step (checked by a TorchFunctionMode probe), finite losses
falling from ~4.74, gradient norms of order 1. REAL_WORLD_IDIOMS: "Hugging Face `Trainer`
and accelerate call `accelerator.backward(loss)` and their own `clip_grad_norm_`" is
something the guard must handle; a healthy run has no finding. So no event is expected.
"""
import json
import tempfile
import time
import warnings

import torch

torch.set_num_threads(1)

from torch.utils.data import Dataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import amp_runtime  # noqa: E402

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
SEQ = 32


class PatternLM(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            period = int(torch.randint(2, 6, (1,), generator=g))
            motif = torch.randint(0, 128, (period,), generator=g)
            self.rows.append(motif.repeat(SEQ // period + 1)[:SEQ])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = self.rows[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main():
    set_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=True,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=2e-3,
        warmup_steps=2,
        max_steps=12,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=PatternLM(256, 8))
    t0 = time.time()
    with amp_runtime.guard(policy="record") as g:
        trainer.train()
    print(f"WALL {time.time() - t0:.2f}s")
    hist = [h for h in trainer.state.log_history if "loss" in h]
    print("LOSSES", [round(h["loss"], 6) for h in hist])
    print("GRADNORMS", [round(float(h.get("grad_norm", float("nan"))), 4) for h in hist])
    print("WEIGHTSUM", float(sum(p.detach().double().sum() for p in model.parameters())))
    print("EVENTS " + json.dumps(sorted({e.code for e in g.report.events})))


if __name__ == "__main__":
    main()
