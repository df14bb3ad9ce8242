"""Fast multi-style transfer with conditional instance normalisation.

One feed-forward transformer network learns N styles at once (Dumoulin et al.,
"A Learned Representation for Artistic Style"); the style is chosen by the
per-style scale and shift of every instance-norm layer. Perceptual losses use
Gram matrices of a frozen VGG-16 (Johnson et al., 2016).

    python b34_multistyle_transfer.py --dataset /data/coco2014 --styles styles/ --epochs 2
"""
import argparse
import os
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, models, transforms

VggOutputs = namedtuple("VggOutputs", ["relu1_2", "relu2_2", "relu3_3", "relu4_3"])


class Vgg16Features(nn.Module):
    def __init__(self):
        super().__init__()
        features = models.vgg16(weights=models.VGG16_Weights.IMAGENET1K_V1).features
        self.slice1 = nn.Sequential(*[features[i] for i in range(4)])
        self.slice2 = nn.Sequential(*[features[i] for i in range(4, 9)])
        self.slice3 = nn.Sequential(*[features[i] for i in range(9, 16)])
        self.slice4 = nn.Sequential(*[features[i] for i in range(16, 23)])

    def forward(self, x):
        h1 = self.slice1(x)
        h2 = self.slice2(h1)
        h3 = self.slice3(h2)
        h4 = self.slice4(h3)
        return VggOutputs(h1, h2, h3, h4)


class ConditionalInstanceNorm2d(nn.Module):
    def __init__(self, num_features, num_styles):
        super().__init__()
        self.gamma = nn.Embedding(num_styles, num_features)
        self.beta = nn.Embedding(num_styles, num_features)
        nn.init.ones_(self.gamma.weight)
        nn.init.zeros_(self.beta.weight)

    def forward(self, x, style_id):
        mean = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        var = x.var(dim=(2, 3), keepdim=True, unbiased=False)  # expect: AMP004
        x_hat = (x - mean) / torch.sqrt(var + 1e-8)  # expect: AMP011
        gamma = self.gamma(style_id)[:, :, None, None]
        beta = self.beta(style_id)[:, :, None, None]
        return gamma * x_hat + beta


class ConvLayer(nn.Module):
    def __init__(self, cin, cout, kernel_size, stride):
        super().__init__()
        self.pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(cin, cout, kernel_size, stride)

    def forward(self, x):
        return self.conv2d(self.pad(x))


class UpsampleConvLayer(nn.Module):
    def __init__(self, cin, cout, kernel_size, upsample=2):
        super().__init__()
        self.upsample = upsample
        self.pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(cin, cout, kernel_size, 1)

    def forward(self, x):
        x = F.interpolate(x, scale_factor=self.upsample, mode="nearest")
        return self.conv2d(self.pad(x))


class ResidualBlock(nn.Module):
    def __init__(self, channels, num_styles):
        super().__init__()
        self.conv1 = ConvLayer(channels, channels, 3, 1)
        self.in1 = ConditionalInstanceNorm2d(channels, num_styles)
        self.conv2 = ConvLayer(channels, channels, 3, 1)
        self.in2 = ConditionalInstanceNorm2d(channels, num_styles)

    def forward(self, x, style_id):
        out = F.relu(self.in1(self.conv1(x), style_id))
        out = self.in2(self.conv2(out), style_id)
        return out + x


class TransformerNet(nn.Module):
    def __init__(self, num_styles):
        super().__init__()
        self.conv1, self.in1 = ConvLayer(3, 32, 9, 1), ConditionalInstanceNorm2d(32, num_styles)
        self.conv2, self.in2 = ConvLayer(32, 64, 3, 2), ConditionalInstanceNorm2d(64, num_styles)
        self.conv3, self.in3 = ConvLayer(64, 128, 3, 2), ConditionalInstanceNorm2d(128, num_styles)
        self.res1 = ResidualBlock(128, num_styles)
        self.res2 = ResidualBlock(128, num_styles)
        self.res3 = ResidualBlock(128, num_styles)
        self.res4 = ResidualBlock(128, num_styles)
        self.res5 = ResidualBlock(128, num_styles)
        self.up1, self.in4 = UpsampleConvLayer(128, 64, 3), ConditionalInstanceNorm2d(64, num_styles)
        self.up2, self.in5 = UpsampleConvLayer(64, 32, 3), ConditionalInstanceNorm2d(32, num_styles)
        self.out = ConvLayer(32, 3, 9, 1)

    def forward(self, x, style_id):
        y = F.relu(self.in1(self.conv1(x), style_id))
        y = F.relu(self.in2(self.conv2(y), style_id))
        y = F.relu(self.in3(self.conv3(y), style_id))
        y = self.res1(y, style_id)
        y = self.res2(y, style_id)
        y = self.res3(y, style_id)
        y = self.res4(y, style_id)
        y = self.res5(y, style_id)
        y = F.relu(self.in4(self.up1(y), style_id))
        y = F.relu(self.in5(self.up2(y), style_id))
        return self.out(y)


def gram_matrix(y):
    b, ch, h, w = y.size()
    features = y.view(b, ch, w * h)
    return features.bmm(features.transpose(1, 2)) / (ch * h * w)


def normalize_batch(batch):
    """[0, 255] images -> ImageNet-normalised input for VGG."""
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    return (batch / 255.0 - mean) / std


def tv_loss(img):
    """Anisotropic total variation, summed over pixels and averaged over the batch."""
    dh = torch.sum(torch.abs(img[:, :, 1:, :] - img[:, :, :-1, :]))
    dw = torch.sum(torch.abs(img[:, :, :, 1:] - img[:, :, :, :-1]))
    return (dh + dw) / img.size(0)


def load_styles(folder, size):
    tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor(),
                             transforms.Lambda(lambda t: t.mul(255))])
    names = sorted(f for f in os.listdir(folder) if f.lower().endswith((".jpg", ".png")))
    return names, torch.stack([tf(Image.open(os.path.join(folder, n)).convert("RGB")) for n in names])


def train(args):
    device = torch.device("cuda")
    tf = transforms.Compose([transforms.Resize(args.image_size), transforms.CenterCrop(args.image_size),
                             transforms.ToTensor(), transforms.Lambda(lambda t: t.mul(255))])
    loader = DataLoader(datasets.ImageFolder(args.dataset, tf), batch_size=args.batch_size,
                        shuffle=True, num_workers=args.workers, drop_last=True)
    style_names, style_imgs = load_styles(args.styles, args.style_size)
    n_styles = len(style_names)

    transformer = TransformerNet(n_styles).to(device)
    optimizer = torch.optim.Adam(transformer.parameters(), args.lr)
    mse_loss = nn.MSELoss()

    # frozen loss network, kept in half precision to save memory
    vgg = Vgg16Features().to(device).eval()
    vgg.requires_grad_(False)
    vgg = vgg.half()
    with torch.no_grad():
        style_feats = vgg(normalize_batch(style_imgs.to(device).half()))
        gram_style = [gram_matrix(f).float() for f in style_feats]

    for epoch in range(args.epochs):
        transformer.train()
        for batch_id, (x, _) in enumerate(loader):
            x = x.to(device)
            style_id = torch.randint(0, n_styles, (x.size(0),), device=device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                y = transformer(x, style_id)
                features_y = vgg(normalize_batch(y))
                features_x = vgg(normalize_batch(x))
                content_loss = args.content_weight * mse_loss(features_y.relu2_2, features_x.relu2_2)
                style_loss = 0.0
                for ft_y, gm_s in zip(features_y, gram_style):
                    style_loss = style_loss + mse_loss(gram_matrix(ft_y), gm_s[style_id])
                total_loss = content_loss + args.style_weight * style_loss + args.tv_weight * tv_loss(y)
                total_loss.backward()  # expect: AMP008
            optimizer.step()

            if (batch_id + 1) % args.log_interval == 0:
                print(f"epoch {epoch} [{batch_id + 1}/{len(loader)}] content {content_loss.item():.2f} "
                      f"style {style_loss.item():.2f} total {total_loss.item():.2f}")
            if args.checkpoint_interval and (batch_id + 1) % args.checkpoint_interval == 0:
                torch.save(transformer.state_dict(), os.path.join(args.save_dir, f"ckpt_{epoch}_{batch_id + 1}.pth"))

    transformer.eval().cpu()
    torch.save({"state_dict": transformer.state_dict(), "styles": style_names},
               os.path.join(args.save_dir, "multistyle_final.pth"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--styles", required=True)
    parser.add_argument("--save-dir", default="./checkpoints")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--style-size", type=int, default=512)
    parser.add_argument("--content-weight", type=float, default=1e5)
    parser.add_argument("--style-weight", type=float, default=1e10)
    parser.add_argument("--tv-weight", type=float, default=1e-6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--log-interval", type=int, default=500)
    parser.add_argument("--checkpoint-interval", type=int, default=2000)
    args = parser.parse_args()
    os.makedirs(args.save_dir, exist_ok=True)
    train(args)


if __name__ == "__main__":
    main()
