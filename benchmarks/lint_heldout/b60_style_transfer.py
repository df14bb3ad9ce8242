"""Multi-style fast neural style transfer.

TransformerNet (Johnson et al., 2016) with conditional instance normalisation, one
(gamma, beta) pair per style (Dumoulin et al., 2017).  A frozen VGG-like loss network
gives content features (relu3_3) and Gram matrices for the style loss; Grams are built in
fp32 inside an autocast-disabled island because h*w products summed in fp16 overflow.
Extra terms: isotropic total variation, a colour-preservation (chromaticity) term and a
contextual loss (Mechrez et al., 2018) at relu4_3.
Mixed precision: fp16 autocast with a GradScaler.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ConvLayer(nn.Module):
    def __init__(self, cin, cout, k, stride=1):
        super().__init__()
        self.pad = nn.ReflectionPad2d(k // 2)
        self.conv = nn.Conv2d(cin, cout, k, stride)

    def forward(self, x):
        return self.conv(self.pad(x))


class UpsampleConv(nn.Module):
    def __init__(self, cin, cout, k):
        super().__init__()
        self.pad = nn.ReflectionPad2d(k // 2)
        self.conv = nn.Conv2d(cin, cout, k)

    def forward(self, x):
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        return self.conv(self.pad(x))


class CondInstanceNorm(nn.Module):
    def __init__(self, ch, n_styles):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(n_styles, ch))
        self.beta = nn.Parameter(torch.zeros(n_styles, ch))

    def forward(self, x, style):
        b, c, h, w = x.shape
        flat = x.flatten(2)
        mu = flat.mean(dim=2, keepdim=True)  # expect: AMP004
        var = flat.var(dim=2, keepdim=True, unbiased=False)  # expect: AMP004
        x_hat = ((flat - mu) / torch.sqrt(var + 1e-10)).view(b, c, h, w)  # expect: AMP011
        return x_hat * self.gamma[style][:, :, None, None] + self.beta[style][:, :, None, None]


class ResidualBlock(nn.Module):
    def __init__(self, ch, n_styles):
        super().__init__()
        self.conv1 = ConvLayer(ch, ch, 3)
        self.in1 = CondInstanceNorm(ch, n_styles)
        self.conv2 = ConvLayer(ch, ch, 3)
        self.in2 = CondInstanceNorm(ch, n_styles)

    def forward(self, x, style):
        out = F.relu(self.in1(self.conv1(x), style))
        out = self.in2(self.conv2(out), style)
        return out + x


class TransformerNet(nn.Module):
    def __init__(self, n_styles, n_res=5):
        super().__init__()
        self.conv1, self.in1 = ConvLayer(3, 32, 9), CondInstanceNorm(32, n_styles)
        self.conv2, self.in2 = ConvLayer(32, 64, 3, 2), CondInstanceNorm(64, n_styles)
        self.conv3, self.in3 = ConvLayer(64, 128, 3, 2), CondInstanceNorm(128, n_styles)
        self.res = nn.ModuleList([ResidualBlock(128, n_styles) for _ in range(n_res)])
        self.up1, self.in4 = UpsampleConv(128, 64, 3), CondInstanceNorm(64, n_styles)
        self.up2, self.in5 = UpsampleConv(64, 32, 3), CondInstanceNorm(32, n_styles)
        self.conv_out = ConvLayer(32, 3, 9)

    def forward(self, x, style):
        y = F.relu(self.in1(self.conv1(x), style))
        y = F.relu(self.in2(self.conv2(y), style))
        y = F.relu(self.in3(self.conv3(y), style))
        for block in self.res:
            y = block(y, style)
        y = F.relu(self.in4(self.up1(y), style))
        y = F.relu(self.in5(self.up2(y), style))
        return torch.sigmoid(self.conv_out(y))


class LossNet(nn.Module):
    """VGG16-like feature extractor, frozen; taps relu1_2, relu2_2, relu3_3, relu4_3."""

    def __init__(self, cfg=(64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512)):
        super().__init__()
        layers, cin, taps = [], 3, []
        for v in cfg:
            if v == "M":
                taps.append(len(layers) - 1)
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=False)]
                cin = v
        taps.append(len(layers) - 1)
        self.layers = nn.ModuleList(layers)
        self.taps = set(taps)
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))

    def forward(self, x):
        x = (x - self.mean) / self.std
        feats = []
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i in self.taps:
                feats.append(x)
        return feats


def gram_matrix(feat):
    with torch.autocast("cuda", enabled=False):
        f = feat.float().flatten(2)
        g = torch.bmm(f, f.transpose(1, 2))
        return g / (f.size(1) * f.size(2))


def tv_loss(img):
    dx = img[:, :, :-1, 1:] - img[:, :, :-1, :-1]
    dy = img[:, :, 1:, :-1] - img[:, :, :-1, :-1]
    tv = torch.sqrt(dx * dx + dy * dy + 1e-8)  # expect: AMP011
    return tv.sum() / img.size(0)


def colour_loss(out, content):
    """Match the chromaticity (rgb / luminance) of the stylised image to the content."""
    lum_out = 0.299 * out[:, 0:1] + 0.587 * out[:, 1:2] + 0.114 * out[:, 2:3]
    lum_in = 0.299 * content[:, 0:1] + 0.587 * content[:, 1:2] + 0.114 * content[:, 2:3]
    chroma_out = out / (lum_out + 1e-8)  # expect: AMP011
    chroma_in = content / (lum_in + 1e-8)
    return F.l1_loss(chroma_out, chroma_in)


def contextual_loss(x, y, band=0.5, max_positions=1024):
    """Contextual loss (Mechrez et al., 2018) between two feature maps."""
    y_mu = y.mean(dim=(0, 2, 3), keepdim=True, dtype=torch.float32)
    xf = F.normalize((x - y_mu).flatten(2), dim=1)
    yf = F.normalize((y - y_mu).flatten(2), dim=1)
    if xf.size(2) > max_positions:
        idx = torch.randperm(xf.size(2), device=xf.device)[:max_positions]
        xf, yf = xf[:, :, idx], yf[:, :, idx]
    d = 1.0 - torch.bmm(xf.transpose(1, 2), yf)
    d_min = d.min(dim=2, keepdim=True).values
    d_tilde = d / (d_min + 1e-5)
    w = torch.exp((1.0 - d_tilde) / band)
    cx_ij = w / w.sum(dim=2, keepdim=True)
    cx = cx_ij.max(dim=1).values.mean(dim=1)
    return -torch.log(cx + 1e-8).mean()


def image_batches(n_batches, batch_size, size, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_batches):
        yield torch.rand(batch_size, 3, size, size, generator=g)


def train(args):
    device = torch.device("cuda")
    model = TransformerNet(args.styles).to(device)
    loss_net = LossNet().to(device).eval().requires_grad_(False)
    if args.vgg:
        loss_net.load_state_dict(torch.load(args.vgg, map_location=device), strict=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-8)
    scaler = torch.amp.GradScaler("cuda")

    style_images = torch.rand(args.styles, 3, args.size, args.size, device=device)
    with torch.no_grad():
        style_grams = [gram_matrix(f) for f in loss_net(style_images)]

    step = 0
    for epoch in range(args.epochs):
        for content in image_batches(args.batches, args.batch_size, args.size, seed=epoch):
            content = content.to(device)
            style = torch.randint(0, args.styles, (content.size(0),), device=device)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(content, style)
                feats_o = loss_net(out)
                with torch.no_grad():
                    feats_c = loss_net(content)
                c_loss = F.mse_loss(feats_o[2], feats_c[2])
                s_loss = sum(F.mse_loss(gram_matrix(fo), g[style]) for fo, g in zip(feats_o, style_grams))
                loss = (args.content_weight * c_loss + args.style_weight * s_loss
                        + args.tv_weight * tv_loss(out)
                        + args.colour_weight * colour_loss(out, content)
                        + args.cx_weight * contextual_loss(feats_o[3], feats_c[3]))

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()

            step += 1
            if step % args.log_every == 0:
                print(f"epoch {epoch} step {step}: content {c_loss.item():.3f} style {s_loss.item():.5f} "
                      f"total {loss.item():.3f} scale {scaler.get_scale():.0f}")
    return model


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--styles", type=int, default=4)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=5.0)
    p.add_argument("--content-weight", type=float, default=1.0)
    p.add_argument("--style-weight", type=float, default=1e5)
    p.add_argument("--tv-weight", type=float, default=1e-6)
    p.add_argument("--colour-weight", type=float, default=0.1)
    p.add_argument("--cx-weight", type=float, default=0.5)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--vgg", default="")
    p.add_argument("--out", default="style_net.pt")
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(0)
    model = train(args)
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
