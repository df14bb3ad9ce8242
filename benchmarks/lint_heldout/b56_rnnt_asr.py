"""RNN-Transducer ASR: log-mel frontend, ContextNet-style conv encoder with
squeeze-excitation, LSTM prediction network and a HAT joiner (separate blank
distribution). fp16 autocast; the transducer loss runs with autocast off."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.utils.data import DataLoader

ENCODER_SPEC = [  # (channels, kernel, stride, repeat)
    (256, 5, 1, 2),
    (256, 5, 2, 3),
    (384, 5, 1, 3),
    (384, 5, 2, 3),
    (512, 5, 1, 3),
]


def mel_filterbank(n_fft, n_mels, sr):
    fb = torchaudio.functional.melscale_fbanks(n_fft // 2 + 1, 0.0, sr / 2, n_mels, sr, norm="slaney")
    return fb.float()


class LogMelFrontend(nn.Module):
    def __init__(self, sr=16000, n_fft=512, hop=160, n_mels=80):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft))
        self.register_buffer("fb", mel_filterbank(n_fft, n_mels, sr))

    def forward(self, wave, lengths):
        spec = torch.stft(wave, self.n_fft, self.hop, window=self.window, return_complex=True)
        power = spec.abs().pow(2).transpose(1, 2)
        mel = torch.matmul(power, self.fb)
        logmel = torch.log(mel + 1e-10)  # expect: AMP011
        logmel = (logmel - logmel.mean(1, keepdim=True)) / (logmel.std(1, keepdim=True) + 1e-5)
        return logmel.transpose(1, 2), lengths // self.hop + 1


class SqueezeExcite1d(nn.Module):
    def __init__(self, channels, reduction=8):
        super().__init__()
        self.fc1 = nn.Linear(channels, channels // reduction)
        self.fc2 = nn.Linear(channels // reduction, channels)

    def forward(self, x):
        s = x.mean(dim=2)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.silu(self.fc1(s))))
        return x * s.unsqueeze(-1)


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, kernel, stride, repeat):
        super().__init__()
        layers = []
        for i in range(repeat):
            c = cin if i == 0 else cout
            s = stride if i == repeat - 1 else 1
            layers += [nn.Conv1d(c, c, kernel, stride=s, padding=kernel // 2, groups=c), nn.Conv1d(c, cout, 1), nn.SiLU()]
        self.convs = nn.Sequential(*layers)
        self.out_conv = nn.Conv1d(cout, cout, 1)
        self.se = SqueezeExcite1d(cout)
        self.skip = nn.Conv1d(cin, cout, 1, stride=stride)

    def forward(self, x):
        return F.silu(self.se(self.out_conv(self.convs(x))) + self.skip(x))


class Encoder(nn.Module):
    def __init__(self, n_mels, spec, d_model):
        super().__init__()
        blocks, cin = [], n_mels
        for cout, k, s, r in spec:
            blocks.append(ConvBlock(cin, cout, k, s, r))
            cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.frame_gate = nn.Linear(cin, 1)
        self.proj = nn.Linear(cin, d_model)
        self.gate_reg = None

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        x = x.transpose(1, 2)
        gate = torch.sigmoid(self.frame_gate(x))
        self.gate_reg = gate.mean()  # expect: AMP004
        return self.proj(x * gate)


class PredictionNet(nn.Module):
    def __init__(self, vocab, d_emb, d_hidden, d_model, blank):
        super().__init__()
        self.blank = blank
        self.embed = nn.Embedding(vocab, d_emb)
        self.lstm = nn.LSTM(d_emb, d_hidden, num_layers=1, batch_first=True)
        self.proj = nn.Linear(d_hidden, d_model)

    def forward(self, labels, state=None):
        y = F.pad(labels, (1, 0), value=self.blank)
        out, state = self.lstm(self.embed(y), state)
        return self.proj(out), state


class HATJoiner(nn.Module):
    def __init__(self, d_model, d_joint, vocab):
        super().__init__()
        self.enc = nn.Linear(d_model, d_joint)
        self.pred = nn.Linear(d_model, d_joint, bias=False)
        self.blank_head = nn.Linear(d_joint, 1)
        self.label_head = nn.Linear(d_joint, vocab - 1)

    def forward(self, enc, pred):
        h = torch.tanh(self.enc(enc).unsqueeze(2) + self.pred(pred).unsqueeze(1))
        b = torch.sigmoid(self.blank_head(h))
        log_blank = torch.log(b + 1e-10)  # expect: AMP011
        log_labels = F.logsigmoid(-self.blank_head(h)) + F.log_softmax(self.label_head(h), dim=-1)
        return torch.cat([log_blank, log_labels], dim=-1)


class Transducer(nn.Module):
    def __init__(self, vocab=1024, d_model=640, blank=0):
        super().__init__()
        self.blank = blank
        self.frontend = LogMelFrontend()
        self.encoder = Encoder(80, ENCODER_SPEC, d_model)
        self.predictor = PredictionNet(vocab, 320, 640, d_model, blank)
        self.joiner = HATJoiner(d_model, 640, vocab)
        self.ctc_head = nn.Linear(d_model, vocab)

    def forward(self, wave, wave_lens, labels):
        feats, feat_lens = self.frontend(wave, wave_lens)
        enc = self.encoder(feats)
        enc_lens = (feat_lens + 3) // 4
        pred, _ = self.predictor(labels)
        log_probs = self.joiner(enc, pred)
        ctc_lp = F.log_softmax(self.ctc_head(enc), dim=-1)
        return log_probs, ctc_lp, enc_lens.clamp(max=enc.shape[1])


@torch.inference_mode()
def greedy_decode(model, wave, wave_lens, max_symbols=10):
    model.eval()
    feats, lens = model.frontend(wave, wave_lens)
    enc = model.encoder(feats)
    hyps = [[] for _ in range(enc.shape[0])]
    label = torch.full((enc.shape[0], 1), model.blank, dtype=torch.long, device=enc.device)
    pred, state = model.predictor.proj(model.predictor.lstm(model.predictor.embed(label))[0]), None
    for t in range(enc.shape[1]):
        for _ in range(max_symbols):
            lp = model.joiner(enc[:, t:t + 1], pred)[:, 0, 0]
            k = lp.argmax(-1)
            if (k == model.blank).all():
                break
            for i, tok in enumerate(k.tolist()):
                if tok != model.blank:
                    hyps[i].append(tok)
            out, state = model.predictor.lstm(model.predictor.embed(k[:, None]), state)
            pred = model.predictor.proj(out)
    model.train()
    return hyps


def train(model, loader, epochs=100, accum=4, lr=1e-3, ctc_weight=0.3, gate_weight=0.01):
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=epochs * len(loader) // accum)
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    for epoch in range(epochs):
        for i, (wave, wave_lens, labels, label_lens) in enumerate(loader):
            wave, wave_lens = wave.cuda(non_blocking=True), wave_lens.cuda()
            labels, label_lens = labels.cuda(), label_lens.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                log_probs, ctc_lp, enc_lens = model(wave, wave_lens, labels)
                ctc = F.ctc_loss(ctc_lp.transpose(0, 1), labels, enc_lens, label_lens, blank=model.blank, zero_infinity=True)
                with torch.autocast("cuda", enabled=False):
                    rnnt = torchaudio.functional.rnnt_loss(log_probs.float(), labels.int(), enc_lens.int(), label_lens.int(),
                                                           blank=model.blank, fused_log_softmax=False)
                loss = (1 - ctc_weight) * rnnt + ctc_weight * ctc + gate_weight * model.encoder.gate_reg
            loss = scaler.scale(loss / accum)
            loss.backward()
            if (i + 1) % accum == 0:
                optimizer.step()  # expect: AMP006
                optimizer.zero_grad(set_to_none=True)
                sched.step()
            if i % 200 == 0:
                print(f"epoch {epoch} it {i} loss {loss.item() * accum / scaler.get_scale():.3f}")


def main(train_set, collate_fn):
    model = Transducer(vocab=1024, d_model=640)
    loader = DataLoader(train_set, batch_size=32, shuffle=True, num_workers=8, collate_fn=collate_fn, drop_last=True)
    train(model, loader)
    torch.save(model.state_dict(), "rnnt_hat.pt")
