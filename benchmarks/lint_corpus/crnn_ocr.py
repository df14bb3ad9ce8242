"""CRNN text recognition (CNN + BiLSTM + CTC) with AMP and a fp16 export path."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class CRNN(nn.Module):
    def __init__(self, num_classes, hidden=256):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 64, 3, 1, 1), nn.ReLU(True), nn.MaxPool2d(2, 2),
            nn.Conv2d(64, 128, 3, 1, 1), nn.ReLU(True), nn.MaxPool2d(2, 2),
            nn.Conv2d(128, 256, 3, 1, 1), nn.BatchNorm2d(256), nn.ReLU(True), nn.MaxPool2d((2, 1), (2, 1)),
        )
        self.rnn = nn.LSTM(256 * 4, hidden, num_layers=2, bidirectional=True)
        self.fc = nn.Linear(2 * hidden, num_classes)

    def forward(self, x):
        f = self.cnn(x)
        b, c, h, w = f.size()
        f = f.view(b, c * h, w).permute(2, 0, 1)
        out, _ = self.rnn(f)
        return self.fc(out)


class CTCLabelConverter:
    def __init__(self, alphabet):
        self.alphabet = alphabet
        self.dict = {ch: i + 1 for i, ch in enumerate(alphabet)}

    def encode(self, texts):
        lengths = torch.tensor([len(t) for t in texts], dtype=torch.long)
        flat = torch.tensor([self.dict[c] for t in texts for c in t], dtype=torch.long)
        return flat, lengths

    def decode(self, preds):
        out = []
        for seq in preds.argmax(2).permute(1, 0).tolist():
            chars, prev = [], 0
            for idx in seq:
                if idx != prev and idx != 0:
                    chars.append(self.alphabet[idx - 1])
                prev = idx
            out.append("".join(chars))
        return out


def train(model, loader, converter, epochs, lr=1e-3):
    device = torch.device("cuda")
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.5, 0.999))
    criterion = nn.CTCLoss(zero_infinity=True)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(epochs):
        model.train()
        for images, texts in loader:
            images = images.to(device)
            targets, target_lengths = converter.encode(texts)
            with torch.autocast("cuda", dtype=torch.float16):
                preds = model(images)
            log_probs = preds.log_softmax(2)
            input_lengths = torch.full((images.size(0),), preds.size(0), dtype=torch.long)
            loss = criterion(log_probs, targets, input_lengths, target_lengths)  # expect: AMP002
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5)
            scaler.step(optimizer)
            scaler.update()
        torch.save(model.state_dict(), f"crnn_{epoch}.pth")


def train_fixed(model, loader, converter, optimizer, scaler):
    criterion = nn.CTCLoss(zero_infinity=True)
    for images, texts in loader:
        targets, target_lengths = converter.encode(texts)
        with torch.autocast("cuda", dtype=torch.float16):
            preds = model(images.cuda())
        log_probs = preds.float().log_softmax(2)
        input_lengths = torch.full((images.size(0),), preds.size(0), dtype=torch.long)
        loss = criterion(log_probs, targets, input_lengths, target_lengths)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def export_half(model, path, height=32, width=128):
    model = model.eval().half().cuda()
    dummy = torch.randn(1, 1, height, width, device="cuda").half()
    torch.onnx.export(model, dummy, path, opset_version=17)


@torch.no_grad()
def recognize(model, converter, images):
    model.eval()
    preds = model(images.cuda().half())
    return converter.decode(F.softmax(preds.float(), dim=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
