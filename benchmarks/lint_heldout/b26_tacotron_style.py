"""Tacotron 2 with location-sensitive attention and an utterance-level reference (style)
encoder. Mixed-precision training loop adapted from NVIDIA's tacotron2 train.py."""
import argparse
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


@dataclass
class HParams:
    n_symbols: int = 148
    symbols_embedding_dim: int = 512
    encoder_embedding_dim: int = 512
    n_mel_channels: int = 80
    decoder_rnn_dim: int = 1024
    prenet_dim: int = 256
    max_decoder_steps: int = 1000
    gate_threshold: float = 0.5
    attention_rnn_dim: int = 1024
    attention_dim: int = 128
    attention_location_n_filters: int = 32
    attention_location_kernel_size: int = 31
    postnet_embedding_dim: int = 512
    postnet_n_convolutions: int = 5
    style_dim: int = 128
    learning_rate: float = 1e-3
    weight_decay: float = 1e-6
    grad_clip_thresh: float = 1.0
    epochs: int = 500
    fp16_run: bool = True


def get_mask_from_lengths(lengths):
    max_len = int(torch.max(lengths).item())
    ids = torch.arange(0, max_len, device=lengths.device)
    return ids < lengths.unsqueeze(1)


class LocationLayer(nn.Module):
    def __init__(self, n_filters, kernel_size, attention_dim):
        super().__init__()
        self.location_conv = nn.Conv1d(2, n_filters, kernel_size, padding=(kernel_size - 1) // 2, bias=False)
        self.location_dense = nn.Linear(n_filters, attention_dim, bias=False)

    def forward(self, attention_weights_cat):
        processed = self.location_conv(attention_weights_cat)
        return self.location_dense(processed.transpose(1, 2))


class Attention(nn.Module):
    def __init__(self, attention_rnn_dim, embedding_dim, attention_dim, n_filters, kernel_size):
        super().__init__()
        self.query_layer = nn.Linear(attention_rnn_dim, attention_dim, bias=False)
        self.memory_layer = nn.Linear(embedding_dim, attention_dim, bias=False)
        self.v = nn.Linear(attention_dim, 1, bias=False)
        self.location_layer = LocationLayer(n_filters, kernel_size, attention_dim)

    def get_alignment_energies(self, query, processed_memory, attention_weights_cat):
        processed_query = self.query_layer(query.unsqueeze(1))
        processed_attention = self.location_layer(attention_weights_cat)
        energies = self.v(torch.tanh(processed_query + processed_attention + processed_memory))
        return energies.squeeze(2)

    def forward(self, attention_hidden_state, memory, processed_memory, attention_weights_cat, mask):
        alignment = self.get_alignment_energies(attention_hidden_state, processed_memory, attention_weights_cat)
        if mask is not None:
            alignment = alignment.masked_fill(mask, -1e9)  # expect: AMP007
        attention_weights = F.softmax(alignment, dim=1)
        attention_context = torch.bmm(attention_weights.unsqueeze(1), memory).squeeze(1)
        return attention_context, attention_weights


class Prenet(nn.Module):
    def __init__(self, in_dim, sizes):
        super().__init__()
        in_sizes = [in_dim] + sizes[:-1]
        self.layers = nn.ModuleList([nn.Linear(i, o, bias=False) for i, o in zip(in_sizes, sizes)])

    def forward(self, x):
        for linear in self.layers:
            x = F.dropout(F.relu(linear(x)), p=0.5, training=True)
        return x


class Postnet(nn.Module):
    def __init__(self, hp):
        super().__init__()
        dims = [hp.n_mel_channels] + [hp.postnet_embedding_dim] * (hp.postnet_n_convolutions - 1) + [hp.n_mel_channels]
        self.convolutions = nn.ModuleList(
            nn.Sequential(nn.Conv1d(dims[i], dims[i + 1], 5, padding=2), nn.BatchNorm1d(dims[i + 1]))
            for i in range(hp.postnet_n_convolutions)
        )

    def forward(self, x):
        for i, conv in enumerate(self.convolutions):
            x = conv(x)
            if i < len(self.convolutions) - 1:
                x = torch.tanh(x)
            x = F.dropout(x, 0.5, self.training)
        return x


class Encoder(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.convolutions = nn.ModuleList(
            nn.Sequential(nn.Conv1d(hp.encoder_embedding_dim, hp.encoder_embedding_dim, 5, padding=2),
                          nn.BatchNorm1d(hp.encoder_embedding_dim))
            for _ in range(3)
        )
        self.lstm = nn.LSTM(hp.encoder_embedding_dim, hp.encoder_embedding_dim // 2, 1, batch_first=True, bidirectional=True)

    def forward(self, x, input_lengths):
        for conv in self.convolutions:
            x = F.dropout(F.relu(conv(x)), 0.5, self.training)
        x = nn.utils.rnn.pack_padded_sequence(x.transpose(1, 2), input_lengths.cpu(), batch_first=True, enforce_sorted=False)
        outputs, _ = self.lstm(x)
        outputs, _ = nn.utils.rnn.pad_packed_sequence(outputs, batch_first=True)
        return outputs


class ReferenceEncoder(nn.Module):
    """Utterance-level prosody vector from the target mel (training) or a reference clip."""

    def __init__(self, n_mels, channels=256, style_dim=128):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv1d(n_mels if i == 0 else channels, channels, 3, padding=1) for i in range(3)])
        self.proj = nn.Conv1d(channels, style_dim, kernel_size=1)
        self.style_fc = nn.Linear(style_dim, style_dim)

    def forward(self, mels):
        h = mels
        for conv in self.convs:
            h = F.relu(conv(h))
        h = self.proj(h)
        # normalise over time so the vector carries prosody rather than loudness
        mu = torch.mean(h, dim=2, keepdim=True)  # expect: AMP004
        var = h.var(dim=2, keepdim=True, unbiased=False)  # expect: AMP004
        h = (h - mu) / torch.sqrt(var + 1e-8)  # expect: AMP011
        return torch.tanh(self.style_fc(h.amax(dim=2)))


class Decoder(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.n_mel_channels = hp.n_mel_channels
        self.encoder_embedding_dim = hp.encoder_embedding_dim
        self.attention_rnn_dim = hp.attention_rnn_dim
        self.decoder_rnn_dim = hp.decoder_rnn_dim
        self.max_decoder_steps = hp.max_decoder_steps
        self.gate_threshold = hp.gate_threshold
        self.prenet = Prenet(hp.n_mel_channels, [hp.prenet_dim, hp.prenet_dim])
        self.attention_rnn = nn.LSTMCell(hp.prenet_dim + hp.encoder_embedding_dim, hp.attention_rnn_dim)
        self.attention_layer = Attention(hp.attention_rnn_dim, hp.encoder_embedding_dim, hp.attention_dim,
                                         hp.attention_location_n_filters, hp.attention_location_kernel_size)
        self.decoder_rnn = nn.LSTMCell(hp.attention_rnn_dim + hp.encoder_embedding_dim, hp.decoder_rnn_dim)
        self.linear_projection = nn.Linear(hp.decoder_rnn_dim + hp.encoder_embedding_dim, hp.n_mel_channels)
        self.gate_layer = nn.Linear(hp.decoder_rnn_dim + hp.encoder_embedding_dim, 1)

    def initialize_decoder_states(self, memory, mask):
        B, T, _ = memory.shape
        self.attention_hidden = memory.new_zeros(B, self.attention_rnn_dim)
        self.attention_cell = memory.new_zeros(B, self.attention_rnn_dim)
        self.decoder_hidden = memory.new_zeros(B, self.decoder_rnn_dim)
        self.decoder_cell = memory.new_zeros(B, self.decoder_rnn_dim)
        self.attention_weights = memory.new_zeros(B, T)
        self.attention_weights_cum = memory.new_zeros(B, T)
        self.attention_context = memory.new_zeros(B, self.encoder_embedding_dim)
        self.memory = memory
        self.processed_memory = self.attention_layer.memory_layer(memory)
        self.mask = mask

    def decode(self, decoder_input):
        cell_input = torch.cat((decoder_input, self.attention_context), -1)
        self.attention_hidden, self.attention_cell = self.attention_rnn(cell_input, (self.attention_hidden, self.attention_cell))
        self.attention_hidden = F.dropout(self.attention_hidden, 0.1, self.training)
        weights_cat = torch.cat((self.attention_weights.unsqueeze(1), self.attention_weights_cum.unsqueeze(1)), dim=1)
        self.attention_context, self.attention_weights = self.attention_layer(
            self.attention_hidden, self.memory, self.processed_memory, weights_cat, self.mask)
        self.attention_weights_cum = self.attention_weights_cum + self.attention_weights
        decoder_input = torch.cat((self.attention_hidden, self.attention_context), -1)
        self.decoder_hidden, self.decoder_cell = self.decoder_rnn(decoder_input, (self.decoder_hidden, self.decoder_cell))
        self.decoder_hidden = F.dropout(self.decoder_hidden, 0.1, self.training)
        hidden_and_context = torch.cat((self.decoder_hidden, self.attention_context), dim=1)
        return self.linear_projection(hidden_and_context), self.gate_layer(hidden_and_context), self.attention_weights

    def forward(self, memory, decoder_inputs, memory_lengths):
        go_frame = memory.new_zeros(1, memory.size(0), self.n_mel_channels)
        decoder_inputs = torch.cat((go_frame, decoder_inputs.permute(2, 0, 1)), dim=0)
        decoder_inputs = self.prenet(decoder_inputs)
        self.initialize_decoder_states(memory, mask=~get_mask_from_lengths(memory_lengths))
        mel_outputs, gate_outputs, alignments = [], [], []
        while len(mel_outputs) < decoder_inputs.size(0) - 1:
            mel, gate, weights = self.decode(decoder_inputs[len(mel_outputs)])
            mel_outputs.append(mel)
            gate_outputs.append(gate.squeeze(1))
            alignments.append(weights)
        return torch.stack(mel_outputs, dim=2), torch.stack(gate_outputs, dim=1), torch.stack(alignments, dim=1)

    @torch.no_grad()
    def inference(self, memory):
        frame = memory.new_zeros(memory.size(0), self.n_mel_channels)
        self.initialize_decoder_states(memory, mask=None)
        mel_outputs, gate_outputs, alignments = [], [], []
        while True:
            mel, gate, weights = self.decode(self.prenet(frame))
            mel_outputs.append(mel)
            gate_outputs.append(gate.squeeze(1))
            alignments.append(weights)
            if torch.sigmoid(gate.float()).min() > self.gate_threshold or len(mel_outputs) == self.max_decoder_steps:
                break
            frame = mel
        return torch.stack(mel_outputs, dim=2), torch.stack(gate_outputs, dim=1), torch.stack(alignments, dim=1)


class Tacotron2(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.n_mel_channels = hp.n_mel_channels
        self.embedding = nn.Embedding(hp.n_symbols, hp.symbols_embedding_dim)
        val = math.sqrt(3.0) * math.sqrt(2.0 / (hp.n_symbols + hp.symbols_embedding_dim))
        self.embedding.weight.data.uniform_(-val, val)
        self.encoder = Encoder(hp)
        self.reference_encoder = ReferenceEncoder(hp.n_mel_channels, style_dim=hp.style_dim)
        self.style_proj = nn.Linear(hp.style_dim, hp.encoder_embedding_dim)
        self.decoder = Decoder(hp)
        self.postnet = Postnet(hp)

    def parse_output(self, outputs, output_lengths):
        mask = ~get_mask_from_lengths(output_lengths)
        mask = mask.expand(self.n_mel_channels, mask.size(0), mask.size(1)).permute(1, 0, 2)
        outputs[0].data.masked_fill_(mask, 0.0)
        outputs[1].data.masked_fill_(mask, 0.0)
        outputs[2].data.masked_fill_(mask[:, 0, :], 1e3)  # gate energies
        return outputs

    def forward(self, inputs):
        text, text_lengths, mels, output_lengths = inputs
        encoder_outputs = self.encoder(self.embedding(text).transpose(1, 2), text_lengths)
        style = self.reference_encoder(mels)
        encoder_outputs = encoder_outputs + self.style_proj(style).unsqueeze(1)
        mel_outputs, gate_outputs, alignments = self.decoder(encoder_outputs, mels, memory_lengths=text_lengths)
        mel_outputs_postnet = mel_outputs + self.postnet(mel_outputs)
        return self.parse_output([mel_outputs, mel_outputs_postnet, gate_outputs, alignments], output_lengths)

    @torch.no_grad()
    def inference(self, text, ref_mels):
        encoder_outputs = self.encoder(self.embedding(text).transpose(1, 2), torch.tensor([text.size(1)] * text.size(0)))
        encoder_outputs = encoder_outputs + self.style_proj(self.reference_encoder(ref_mels)).unsqueeze(1)
        mel_outputs, gate_outputs, alignments = self.decoder.inference(encoder_outputs)
        return mel_outputs, mel_outputs + self.postnet(mel_outputs), gate_outputs, alignments


class Tacotron2Loss(nn.Module):
    def forward(self, model_output, targets):
        mel_target, gate_target = targets
        gate_target = gate_target.view(-1, 1)
        mel_out, mel_out_postnet, gate_out, _ = model_output
        gate_out = gate_out.view(-1, 1)
        mel_loss = F.mse_loss(mel_out, mel_target) + F.mse_loss(mel_out_postnet, mel_target)
        gate_loss = F.binary_cross_entropy(torch.sigmoid(gate_out), gate_target)  # expect: AMP003
        return mel_loss + gate_loss


class GuidedAttentionLoss(nn.Module):
    """Penalises attention far from the diagonal (Tachibana et al., 2017)."""

    def __init__(self, sigma=0.4):
        super().__init__()
        self.sigma = sigma

    def forward(self, alignments, text_lengths, mel_lengths):
        B, T_out, T_in = alignments.shape
        W = torch.zeros(B, T_out, T_in, device=alignments.device)
        for b in range(B):
            n = torch.arange(int(mel_lengths[b]), device=W.device, dtype=torch.float32) / float(mel_lengths[b])
            t = torch.arange(int(text_lengths[b]), device=W.device, dtype=torch.float32) / float(text_lengths[b])
            W[b, : n.numel(), : t.numel()] = 1.0 - torch.exp(-((n[:, None] - t[None, :]) ** 2) / (2 * self.sigma ** 2))
        return (alignments * W)[W > 0].mean()


def parse_batch(batch, device):
    text, text_lengths, mels, gate, output_lengths = (t.to(device, non_blocking=True) for t in batch)
    return (text, text_lengths, mels, output_lengths), (mels, gate)


@torch.no_grad()
def validate(model, criterion, val_loader, device):
    model.eval()
    losses = [criterion(model(x), y).item() for x, y in (parse_batch(b, device) for b in val_loader)]
    model.train()
    return sum(losses) / max(len(losses), 1)


def train(hp, args, train_loader, val_loader):
    device = torch.device("cuda")
    model = Tacotron2(hp).to(device)
    criterion = Tacotron2Loss()
    guided = GuidedAttentionLoss(sigma=0.4)
    optimizer = torch.optim.Adam(model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay)
    scaler = torch.amp.GradScaler("cuda", enabled=hp.fp16_run)

    iteration = 0
    for epoch in range(hp.epochs):
        for batch in train_loader:
            model.zero_grad()
            x, y = parse_batch(batch, device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=hp.fp16_run):
                y_pred = model(x)
                loss = criterion(y_pred, y) + args.guided_weight * guided(y_pred[3], x[1], x[3])
            scaler.scale(loss).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip_thresh)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()

            if iteration % args.log_every == 0:
                print(f"iter {iteration} loss {loss.item():.5f} grad norm {grad_norm:.3f} scale {scaler.get_scale():.0f}")
            if iteration % args.iters_per_checkpoint == 0:
                print(f"validation loss {iteration}: {validate(model, criterion, val_loader, device):.5f}")
                torch.save({"iteration": iteration, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()},
                           os.path.join(args.output_directory, f"checkpoint_{iteration}"))
            iteration += 1


def synthesize(checkpoint_path, text_ids, ref_mel, hp):
    model = Tacotron2(hp)
    model.load_state_dict(torch.load(checkpoint_path, map_location="cpu")["state_dict"])
    model = model.cuda().eval().half()
    with torch.inference_mode():
        _, mel_post, _, align = model.inference(text_ids.cuda(), ref_mel.cuda().half())
    return mel_post.float().cpu().numpy(), align.float().cpu().numpy()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_directory", default="outdir")
    parser.add_argument("--guided_weight", type=float, default=0.2)
    parser.add_argument("--log_every", type=int, default=50)
    parser.add_argument("--iters_per_checkpoint", type=int, default=1000)
    parser.add_argument("--data", default="filelists")
    args = parser.parse_args()
    os.makedirs(args.output_directory, exist_ok=True)
    hp = HParams()
    blob = torch.load(os.path.join(args.data, "batches.pt"))
    train(hp, args, DataLoader(blob["train"], batch_size=None, shuffle=True), DataLoader(blob["val"], batch_size=None))
