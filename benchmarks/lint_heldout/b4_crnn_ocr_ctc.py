"""Scene-text recognition with a CRNN (CNN + BiLSTM) and CTC loss, synthetic-data pretraining then real-data fine-tuning."""
import torch
import torch.nn as nn

HALF = torch.float16


class StrLabelConverter:
    def __init__(self, alphabet):
        self.alphabet = alphabet
        self.dict = {c: i + 1 for i, c in enumerate(alphabet)}

    def encode(self, texts):
        lengths = torch.tensor([len(t) for t in texts], dtype=torch.long)
        flat = torch.tensor([self.dict[c] for t in texts for c in t], dtype=torch.long)
        return flat, lengths

    def decode(self, seq):
        out, prev = [], 0
        for s in seq:
            if s != 0 and s != prev:
                out.append(self.alphabet[s - 1])
            prev = s
        return "".join(out)


def conv_bn(cin, cout, pool=None):
    layers = [nn.Conv2d(cin, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.ReLU(True)]
    if pool is not None:
        layers.append(nn.MaxPool2d(*pool))
    return layers


class CRNN(nn.Module):
    def __init__(self, nclass, nh=256):
        super().__init__()
        self.cnn = nn.Sequential(
            *conv_bn(1, 64, (2, 2)), *conv_bn(64, 128, (2, 2)), *conv_bn(128, 256), *conv_bn(256, 256, ((2, 1), (2, 1))),
            *conv_bn(256, 512), *conv_bn(512, 512, ((2, 1), (2, 1))),
        )
        self.squeeze = nn.Conv2d(512, 512, kernel_size=1)
        self.rnn = nn.LSTM(512, nh, num_layers=2, bidirectional=True)
        self.embedding = nn.Linear(nh * 2, nclass)

    def forward(self, x):
        conv = self.cnn(x)
        conv = self.squeeze(conv).mean(dim=2)  # expect: AMP004
        conv = conv.permute(2, 0, 1)
        recurrent, _ = self.rnn(conv)
        return self.embedding(recurrent)


def make_scaler():
    try:
        return torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler()


def prepare_batch(batch, converter, device):
    images, texts = batch
    targets, target_lengths = converter.encode(texts)
    return images.to(device, dtype=HALF), targets, target_lengths  # expect: AMP001


def pretrain_synth(model, synth_loader, converter, steps=100_000, lr=1e-3):
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step, (images, texts) in zip(range(steps), synth_loader):
        targets, lengths = converter.encode(texts)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            preds = model(images.cuda(non_blocking=True))
            log_probs = preds.log_softmax(2)
            input_lengths = torch.full((preds.size(1),), preds.size(0), dtype=torch.long)
            loss = ctc(log_probs, targets, input_lengths, lengths)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 1000 == 0:
            print(f"synth step {step} loss {loss.item():.4f}")
    return model


def finetune(model, loader, converter, args):
    ctc = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scaler = make_scaler()
    model.train()
    for epoch in range(args.epochs):
        for i, batch in enumerate(loader):
            images, targets, target_lengths = prepare_batch(batch, converter, "cuda")
            with torch.autocast("cuda", dtype=torch.float16):
                preds = model(images)
            log_probs = preds.log_softmax(2)
            input_lengths = torch.full((preds.size(1),), preds.size(0), dtype=torch.long)
            loss = ctc(log_probs, targets, input_lengths, target_lengths)  # expect: AMP002
            optimizer.zero_grad()
            loss = scaler.scale(loss)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()
            if i % args.log_every == 0:
                print(f"epoch {epoch} iter {i} loss {loss.item() / scaler.get_scale():.4f}")
    return model


@torch.no_grad()
def predict(model, images, converter):
    model.eval().half()
    preds = model(images.cuda().half())
    best = preds.argmax(2).transpose(1, 0).cpu().tolist()
    return [converter.decode(seq) for seq in best]


def main(args, alphabet, synth_loader, real_loader, test_images):
    converter = StrLabelConverter(alphabet)
    model = CRNN(len(alphabet) + 1).cuda()
    model = pretrain_synth(model, synth_loader, converter, steps=args.synth_steps)
    model = finetune(model, real_loader, converter, args)
    torch.save(model.state_dict(), args.out)
    print(predict(model, test_images, converter)[:8])
