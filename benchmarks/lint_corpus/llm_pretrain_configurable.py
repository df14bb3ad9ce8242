"""The same pretraining loop with the precision chosen on the command line (nanoGPT style)."""
import argparse
from contextlib import nullcontext

import torch

from model import Decoder, DecoderConfig
from train_utils import get_batch, cosine_lr

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
parser.add_argument("--device", default="cuda")
parser.add_argument("--iters", type=int, default=10_000)
parser.add_argument("--grad-clip", type=float, default=1.0)
args = parser.parse_args()

device_type = "cuda" if "cuda" in args.device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

model = Decoder(DecoderConfig()).to(args.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95))
scaler = torch.amp.GradScaler(device_type, enabled=(args.dtype == "float16"))

for it in range(args.iters):
    x, y = get_batch("train", args.device)
    with ctx:
        logits, loss = model(x, y)
    scaler.scale(loss).backward()
    if args.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

# quick fp16 smoke test on the old V100 box; the scaler above is off unless --dtype float16
model16 = Decoder(DecoderConfig(n_layer=2)).to(args.device)
opt16 = torch.optim.AdamW(model16.parameters(), lr=1e-4)
for it in range(10):
    x, y = get_batch("train", args.device)
    with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
        _, loss = model16(x, y)
    loss.backward()
    opt16.step()
    opt16.zero_grad()
