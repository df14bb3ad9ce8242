"""Tacotron2-style multi-speaker TTS training (NVIDIA/NeMo flavour) with a gradient-reversal speaker adversary."""
import argparse
import math
import os
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


class GradientReversal(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # expect: AMP009
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    @torch.cuda.amp.custom_bwd  # expect: AMP009
    def backward(ctx, grad_output):
        return -ctx.scale * grad_output, None


class LocationSensitiveAttention(nn.Module):
    def __init__(self, rnn_dim=1024, embedding_dim=512, attention_dim=128, n_filters=32, kernel_size=31):
        super().__init__()
        self.query_layer = nn.Linear(rnn_dim, attention_dim, bias=False)
        self.memory_layer = nn.Linear(embedding_dim, attention_dim, bias=False)
        self.v = nn.Linear(attention_dim, 1, bias=False)
        self.location_conv = nn.Conv1d(2, n_filters, kernel_size, padding=(kernel_size - 1) // 2, bias=False)
        self.location_dense = nn.Linear(n_filters, attention_dim, bias=False)

    def forward(self, query, memory, processed_memory, attention_weights_cat, mask):
        processed_query = self.query_layer(query.unsqueeze(1))
        processed_attention = self.location_dense(self.location_conv(attention_weights_cat).transpose(1, 2))
        alignment = self.v(torch.tanh(processed_query + processed_attention + processed_memory)).squeeze(-1)
        if mask is not None:
            alignment = torch.where(mask, torch.full_like(alignment, -1e9), alignment)  # expect: AMP007
        attention_weights = F.softmax(alignment, dim=1)
        context = torch.bmm(attention_weights.unsqueeze(1), memory).squeeze(1)
        return context, attention_weights


class Tacotron2(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.n_mels = hp.n_mel_channels
        self.embedding = nn.Embedding(hp.n_symbols, 512)
        self.encoder = nn.LSTM(512, 256, batch_first=True, bidirectional=True)
        self.prosody_proj = nn.Linear(hp.n_mel_channels, 512)
        self.prenet = nn.Sequential(nn.Linear(hp.n_mel_channels, 256), nn.ReLU(), nn.Dropout(0.5), nn.Linear(256, 256), nn.ReLU())
        self.attention_rnn = nn.LSTMCell(256 + 512, 1024)
        self.attention = LocationSensitiveAttention()
        self.decoder_rnn = nn.LSTMCell(1024 + 512, 1024)
        self.linear_projection = nn.Linear(1024 + 512, hp.n_mel_channels)
        self.gate_layer = nn.Linear(1024 + 512, 1)
        self.postnet = nn.Sequential(nn.Conv1d(hp.n_mel_channels, 512, 5, padding=2), nn.Tanh(), nn.Conv1d(512, hp.n_mel_channels, 5, padding=2))
        self.speaker_clf = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, hp.n_speakers))

    def forward(self, text, text_lens, mels, mel_lens, prosody):
        memory, _ = self.encoder(self.embedding(text))
        memory = memory + prosody.unsqueeze(1)
        mask = torch.arange(memory.size(1), device=text.device)[None, :] >= text_lens[:, None]
        processed_memory = self.attention.memory_layer(memory)
        B, T_out = mels.size(0), mels.size(2)
        frames = self.prenet(torch.cat([mels.new_zeros(B, self.n_mels, 1), mels[:, :, :-1]], dim=2).transpose(1, 2))
        h_att = c_att = h_dec = c_dec = memory.new_zeros(B, 1024)
        weights = weights_cum = memory.new_zeros(B, memory.size(1))
        context = memory.new_zeros(B, 512)
        mel_outputs, gate_outputs, alignments = [], [], []
        for t in range(T_out):
            h_att, c_att = self.attention_rnn(torch.cat([frames[:, t], context], -1), (h_att, c_att))
            context, weights = self.attention(h_att, memory, processed_memory, torch.stack([weights, weights_cum], 1), mask)
            weights_cum = weights_cum + weights
            h_dec, c_dec = self.decoder_rnn(torch.cat([h_att, context], -1), (h_dec, c_dec))
            out = torch.cat([h_dec, context], -1)
            mel_outputs.append(self.linear_projection(out))
            gate_outputs.append(self.gate_layer(out).squeeze(-1))
            alignments.append(weights)
        mel_out = torch.stack(mel_outputs, dim=2)
        mel_out_postnet = mel_out + self.postnet(mel_out)
        utt = GradientReversal.apply(memory.float().mean(dim=1), 1.0)
        return mel_out, mel_out_postnet, torch.stack(gate_outputs, 1), torch.stack(alignments, 1), self.speaker_clf(utt)


class Tacotron2Loss(nn.Module):
    def forward(self, model_output, targets):
        mel_target, gate_target = targets
        mel_out, mel_out_postnet, gate_out, _ = model_output
        mel_loss = F.mse_loss(mel_out, mel_target) + F.mse_loss(mel_out_postnet, mel_target)
        gate_loss = F.binary_cross_entropy_with_logits(gate_out.reshape(-1, 1), gate_target.reshape(-1, 1))
        return mel_loss + gate_loss


def validate(model, criterion, valset, batch_size, collate_fn):
    model.eval()
    val_loss = 0.0
    with torch.no_grad():
        val_loader = DataLoader(valset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn)
        for batch in val_loader:
            text, text_lens, mels, gates, mel_lens, speakers = [t.cuda() for t in batch]
            prosody = model.prosody_proj(mels.transpose(1, 2)).mean(dim=1)
            mel_out, mel_post, gate_out, align, _ = model(text, text_lens, mels, mel_lens, prosody)
            val_loss += criterion((mel_out, mel_post, gate_out, align), (mels, gates)).item()
    model.train()
    return val_loss / len(val_loader)


def train(hp, trainset, valset, collate_fn):
    torch.manual_seed(hp.seed)
    model = Tacotron2(hp).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay)
    amp_ctx = torch.autocast("cuda", dtype=torch.float16) if hp.fp16_run else nullcontext()  # expect: AMP010
    criterion = Tacotron2Loss()
    spk_criterion = nn.CrossEntropyLoss()
    train_loader = DataLoader(trainset, batch_size=hp.batch_size, shuffle=True, collate_fn=collate_fn, drop_last=True)
    iteration = 0
    model.train()
    for epoch in range(hp.epochs):
        for batch in train_loader:
            text, text_lens, mels, gates, mel_lens, speakers = [t.cuda(non_blocking=True) for t in batch]
            model.zero_grad()
            with amp_ctx:
                prosody = model.prosody_proj(mels.transpose(1, 2)).mean(dim=1)  # expect: AMP004
                mel_out, mel_out_postnet, gate_out, alignments, spk_logits = model(text, text_lens, mels, mel_lens, prosody)
                spk_loss = spk_criterion(spk_logits, speakers)
            loss = criterion((mel_out, mel_out_postnet, gate_out, alignments), (mels, gates))  # expect: AMP002
            loss = loss + hp.spk_adv_weight * spk_loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip_thresh)
            optimizer.step()
            if not math.isfinite(grad_norm):
                print(f"iteration {iteration}: grad norm is {grad_norm}, step taken anyway")
            if iteration % hp.iters_per_checkpoint == 0:
                val_loss = validate(model, criterion, valset, hp.batch_size, collate_fn)
                print(f"epoch {epoch} iteration {iteration}: train {loss.item():.4f} val {val_loss:.4f}")
                torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "iteration": iteration}, os.path.join(hp.output_directory, f"checkpoint_{iteration}"))
            iteration += 1


@torch.inference_mode()
def infer_teacher_forced(checkpoint_path, hp, text, text_lens, ref_mels):
    model = Tacotron2(hp)
    model.load_state_dict(torch.load(checkpoint_path)["state_dict"])
    model = model.cuda().eval().half()
    ref_mels = ref_mels.cuda().half()
    prosody = model.prosody_proj(ref_mels.transpose(1, 2)).float().mean(dim=1).half()
    _, mel_post, _, align, _ = model(text.cuda(), text_lens.cuda(), ref_mels, None, prosody)
    return mel_post.float(), align.float()


def parse_hparams():
    p = argparse.ArgumentParser()
    p.add_argument("--n_symbols", type=int, default=148)
    p.add_argument("--n_mel_channels", type=int, default=80)
    p.add_argument("--n_speakers", type=int, default=109)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=1e-6)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--grad_clip_thresh", type=float, default=1.0)
    p.add_argument("--spk_adv_weight", type=float, default=0.02)
    p.add_argument("--iters_per_checkpoint", type=int, default=1000)
    p.add_argument("--fp16_run", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output_directory", default="outdir")
    return p.parse_args()
