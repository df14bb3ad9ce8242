"""A small Hugging Face training script, as a user writes one: a tiny randomly initialised
Llama body with the user's own head, trained by ``transformers.Trainer`` on the CPU.

    python hf_train.py --precision bf16 --steps 6 [--overflow-at N [--overflow-rank R]]
                       [--callback] [--trace auto] [--output DIR] [--losses FILE]

The tests import it (``train``) and run it as a script, plain and under
``python -m amp_runtime run``. Nothing is downloaded (HF_HUB_OFFLINE=1).
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import LlamaConfig, LlamaModel, Trainer, TrainingArguments  # noqa: E402

VOCAB = 64


class TinyLM(nn.Module):
    """The user's model code: a one-layer Llama body and a language-model head."""

    def __init__(self, overflow_at=None, overflow_rank=None, overflow_inside_body=False):
        super().__init__()
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                             max_position_embeddings=32)
        self.body = LlamaModel(config)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.overflow_at = overflow_at
        self.overflow_inside_body = overflow_inside_body
        self.overflows_here = overflow_rank in (None, int(os.environ.get("RANK", "0")))
        self.training_calls = 0

    def forward(self, input_ids, labels=None):
        overflow = (self.training and self.training_calls == self.overflow_at
                    and self.overflows_here)
        embeds = self.body.embed_tokens(input_ids)
        if overflow and self.overflow_inside_body:
            embeds = embeds * 1e37  # finite here; the body's RMSNorm squares it to inf
        hidden = self.body(inputs_embeds=embeds).last_hidden_state
        logits = self.head(hidden)
        if overflow and not self.overflow_inside_body:
            logits = logits * 1e39  # injected overflow
        if self.training:
            self.training_calls += 1
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size=48, length=12):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (size, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class LossRecorder(Trainer):
    """Keeps every step's loss, exactly (the Trainer's log rounds them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = model(**inputs)["loss"]
        self.losses.append(loss.item())
        return loss


def train(precision="bf16", steps=6, overflow_at=None, output="hf-output", callbacks=(),
          save_steps=None, resume=None, overflow_rank=None, overflow_inside_body=False):
    """Train from a fixed seed (``resume``: from this checkpoint; ``save_steps``: save one
    every so many steps; ``overflow_inside_body``: the overflow at ``overflow_at`` happens in
    the Llama body's code, not the user's); the losses of every step."""
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=output, max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
        use_cpu=True, bf16=precision == "bf16", fp16=precision == "fp16", report_to=[],
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        disable_tqdm=True, seed=0, logging_steps=steps, dataloader_num_workers=0)
    trainer = LossRecorder(model=TinyLM(overflow_at, overflow_rank, overflow_inside_body),
                           args=args,
                           train_dataset=Tokens(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer.losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--overflow-at", type=int)
    parser.add_argument("--overflow-rank", type=int, help="under torchrun: only on this rank")
    parser.add_argument("--callback", action="store_true", help="add AmpGuardCallback")
    parser.add_argument("--trace", default="auto")
    parser.add_argument("--output", default="hf-output")
    parser.add_argument("--losses", help="write the losses to this JSON file")
    options = parser.parse_args()
    callbacks = []
    if options.callback:
        from amp_runtime.integrations.transformers import AmpGuardCallback

        callbacks.append(AmpGuardCallback(policy="record", trace=options.trace))
    losses = train(options.precision, options.steps, options.overflow_at, options.output,
                   callbacks, overflow_rank=options.overflow_rank)
    if options.losses and os.environ.get("RANK", "0") == "0":  # under torchrun: rank 0's
        with open(options.losses, "w", encoding="utf-8") as fh:
            json.dump(losses, fh)


if __name__ == "__main__":
    main()
