"""CLAP-style contrastive audio-text pretraining.

Audio tower: a CNN14-like log-mel CNN (first pretrained on AudioSet tagging),
text tower: a Hugging Face RoBERTa. Trained with bf16 autocast on A100/H100.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModel


@dataclass
class AudioOutput:
    embedding: torch.Tensor
    clip_logits: torch.Tensor


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu_(self.bn1(self.conv1(x)))
        x = F.relu_(self.bn2(self.conv2(x)))
        return F.avg_pool2d(x, kernel_size=2)


class AudioEncoder(nn.Module):
    def __init__(self, n_mels=64, width=64, embed_dim=1024, n_classes=527):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(n_mels)
        self.blocks = nn.Sequential(
            ConvBlock(1, width), ConvBlock(width, 2 * width), ConvBlock(2 * width, 4 * width), ConvBlock(4 * width, 8 * width)
        )
        self.proj = nn.Conv2d(8 * width, embed_dim, 1)
        self.fc_audioset = nn.Linear(embed_dim, n_classes)

    def forward(self, mel):
        x = mel.unsqueeze(1)
        x = self.bn0(x.transpose(1, 3)).transpose(1, 3)
        x = self.proj(self.blocks(x))
        x = x.mean(dim=3)  # expect: AMP004
        x_max = x.amax(dim=2)
        x_mean = x.mean(dim=2)  # expect: AMP004
        emb = F.relu_(x_max + x_mean)
        return AudioOutput(embedding=emb, clip_logits=self.fc_audioset(emb))


class TextEncoder(nn.Module):
    def __init__(self, name="roberta-base"):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name)

    def forward(self, input_ids, attention_mask):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


class CLAP(nn.Module):
    def __init__(self, text_model="roberta-base", audio_dim=1024, text_dim=768, joint_dim=512):
        super().__init__()
        self.audio = AudioEncoder(embed_dim=audio_dim)
        self.text = TextEncoder(text_model)
        self.audio_proj = nn.Sequential(nn.Linear(audio_dim, joint_dim), nn.ReLU(), nn.Linear(joint_dim, joint_dim))
        self.text_proj = nn.Sequential(nn.Linear(text_dim, joint_dim), nn.ReLU(), nn.Linear(joint_dim, joint_dim))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_audio(self, mel):
        return F.normalize(self.audio_proj(self.audio(mel).embedding), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        return F.normalize(self.text_proj(self.text(input_ids, attention_mask)), dim=-1)

    def forward(self, mel, input_ids, attention_mask):
        a = self.encode_audio(mel)
        t = self.encode_text(input_ids, attention_mask)
        return a, t, self.logit_scale.exp().clamp(max=100.0)


def clip_loss(a, t, scale):
    logits = scale * a @ t.t()
    labels = torch.arange(a.size(0), device=a.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


def pretrain_audio_tagging(loader, epochs, lr=1e-3):
    audio = AudioEncoder().cuda()
    opt = torch.optim.AdamW(audio.parameters(), lr=lr, weight_decay=0.0, amsgrad=True)
    for epoch in range(epochs):
        for mel, target in loader:
            mel, target = mel.cuda(non_blocking=True), target.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = audio(mel)
                clipwise = torch.sigmoid(out.clip_logits)
                loss = F.binary_cross_entropy(clipwise, target)  # expect: AMP003
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        print(f"tagging epoch {epoch}: bce {loss.item():.4f}")
    return audio


def train_clap(clap, loader, args):
    decay = [p for n, p in clap.named_parameters() if p.ndim > 1 and "text.backbone" not in n]
    rest = [p for n, p in clap.named_parameters() if p.ndim <= 1 and "text.backbone" not in n]
    text = list(clap.text.backbone.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.2}, {"params": rest, "weight_decay": 0.0}, {"params": text, "lr": args.lr * 0.1}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6,
    )
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010
    for epoch in range(args.epochs):
        for step, (mel, input_ids, attention_mask) in enumerate(loader):
            mel, input_ids, attention_mask = mel.cuda(), input_ids.cuda(), attention_mask.cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                a, t, scale = clap(mel, input_ids, attention_mask)
                loss = clip_loss(a, t, scale)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(clap.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            if step % 100 == 0:
                print(f"epoch {epoch} step {step}: loss {loss.item():.4f} scale {scale.item():.1f}")


@torch.no_grad()
def zero_shot_eval(clap, loader, prompt_ids, prompt_mask):
    clap.eval()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        class_emb = clap.encode_text(prompt_ids.cuda(), prompt_mask.cuda())
    correct, total = 0, 0
    for mel, label in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            sims = clap.encode_audio(mel.cuda()) @ class_emb.t()
        correct += (sims.argmax(-1).cpu() == label).sum().item()
        total += label.numel()
    clap.train()
    return correct / max(total, 1)


def finetune_adapter(clap, loader, steps, lr=1e-3, joint_dim=512):
    """Residual adapter on frozen CLAP embeddings for a new sound domain."""
    clap.requires_grad_(False)
    clap.eval()
    adapter = nn.Sequential(nn.Linear(joint_dim, 128), nn.GELU(), nn.Linear(128, joint_dim)).cuda().half()  # expect: AMP001
    opt = torch.optim.Adam(adapter.parameters(), lr=lr)  # expect: AMP011
    data = iter(loader)
    for step in range(steps):
        mel, input_ids, attention_mask = next(data)
        with torch.no_grad():
            a = clap.encode_audio(mel.cuda())
            t = clap.encode_text(input_ids.cuda(), attention_mask.cuda())
        a, t = a.half(), t.half()  # expect: AMP001
        loss = F.mse_loss(a + adapter(a), t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return adapter


def main(args, tag_loader, pair_loader, eval_loader, prompts):
    audio = pretrain_audio_tagging(tag_loader, args.tag_epochs)
    clap = CLAP(args.text_model).cuda()
    clap.audio.load_state_dict(audio.state_dict())
    train_clap(clap, pair_loader, args)
    print("zero-shot acc", zero_shot_eval(clap, eval_loader, *prompts))
    torch.save(finetune_adapter(clap, pair_loader, args.adapter_steps).state_dict(), args.adapter_out)
