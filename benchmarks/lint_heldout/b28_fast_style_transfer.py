"""Fast neural style transfer (Johnson et al. 2016) with perceptual losses.

Image transformation network trained against a frozen VGG-16 loss network:
content loss on relu2_2, style loss on Gram matrices of four VGG layers, plus a
total-variation regulariser.
"""
import argparse
import copy
import os
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision.models import VGG16_Weights, vgg16


# --------------------------------------------------------------------------- networks
class InstanceNorm2d(nn.Module):
    """Affine instance norm written out by hand so the net converts cleanly to CoreML."""

    def __init__(self, num_features):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x):
        mu = x.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        var = x.var(dim=(2, 3), keepdim=True, unbiased=False)  # expect: AMP004
        x = (x - mu) / torch.sqrt(var + 1e-8)  # expect: AMP011
        return x * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


class ConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride):
        super().__init__()
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        out = self.reflection_pad(x)
        return self.conv2d(out)


class UpsampleConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, upsample=None):
        super().__init__()
        self.upsample = upsample
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        if self.upsample:
            x = F.interpolate(x, mode="nearest", scale_factor=self.upsample)
        return self.conv2d(self.reflection_pad(x))


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in1 = InstanceNorm2d(channels)
        self.conv2 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in2 = InstanceNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x):
        residual = x
        out = self.relu(self.in1(self.conv1(x)))
        out = self.in2(self.conv2(out))
        return out + residual


class TransformerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = ConvLayer(3, 32, kernel_size=9, stride=1)
        self.in1 = InstanceNorm2d(32)
        self.conv2 = ConvLayer(32, 64, kernel_size=3, stride=2)
        self.in2 = InstanceNorm2d(64)
        self.conv3 = ConvLayer(64, 128, kernel_size=3, stride=2)
        self.in3 = InstanceNorm2d(128)
        self.res = nn.Sequential(*[ResidualBlock(128) for _ in range(5)])
        self.deconv1 = UpsampleConvLayer(128, 64, kernel_size=3, stride=1, upsample=2)
        self.in4 = InstanceNorm2d(64)
        self.deconv2 = UpsampleConvLayer(64, 32, kernel_size=3, stride=1, upsample=2)
        self.in5 = InstanceNorm2d(32)
        self.deconv3 = ConvLayer(32, 3, kernel_size=9, stride=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.relu(self.in1(self.conv1(x)))
        y = self.relu(self.in2(self.conv2(y)))
        y = self.relu(self.in3(self.conv3(y)))
        y = self.res(y)
        y = self.relu(self.in4(self.deconv1(y)))
        y = self.relu(self.in5(self.deconv2(y)))
        return self.deconv3(y)


class VggOutputs(NamedTuple):
    relu1_2: torch.Tensor
    relu2_2: torch.Tensor
    relu3_3: torch.Tensor
    relu4_3: torch.Tensor


class Vgg16(nn.Module):
    def __init__(self, requires_grad=False):
        super().__init__()
        features = vgg16(weights=VGG16_Weights.IMAGENET1K_V1).features
        self.slice1 = nn.Sequential(*[features[i] for i in range(4)])
        self.slice2 = nn.Sequential(*[features[i] for i in range(4, 9)])
        self.slice3 = nn.Sequential(*[features[i] for i in range(9, 16)])
        self.slice4 = nn.Sequential(*[features[i] for i in range(16, 23)])
        if not requires_grad:
            for p in self.parameters():
                p.requires_grad = False

    def forward(self, x):
        h1 = self.slice1(x)
        h2 = self.slice2(h1)
        h3 = self.slice3(h2)
        h4 = self.slice4(h3)
        return VggOutputs(h1, h2, h3, h4)


# --------------------------------------------------------------------------- losses / utils
def gram_matrix(y):
    b, ch, h, w = y.size()
    features = y.view(b, ch, w * h)
    return features.bmm(features.transpose(1, 2)) / (ch * h * w)


def normalize_batch(batch):
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    return (batch / 255.0 - mean) / std


def total_variation_loss(img):
    dh = torch.abs(img[:, :, 1:, :] - img[:, :, :-1, :])
    dw = torch.abs(img[:, :, :, 1:] - img[:, :, :, :-1])
    return torch.sum(dh) + torch.sum(dw)


def load_image(filename, size=None, scale=None):
    img = Image.open(filename).convert("RGB")
    if size is not None:
        img = img.resize((size, size), Image.LANCZOS)
    elif scale is not None:
        img = img.resize((int(img.size[0] / scale), int(img.size[1] / scale)), Image.LANCZOS)
    return img


def save_image(filename, data):
    img = data.clone().clamp(0, 255).numpy().transpose(1, 2, 0).astype("uint8")
    Image.fromarray(img).save(filename)


def save_checkpoint(model, path, half=True):
    to_save = copy.deepcopy(model).cpu().eval()
    if half:
        to_save = to_save.half()
    torch.save(to_save.state_dict(), path)


# --------------------------------------------------------------------------- train
def train(args):
    device = torch.device("cuda")
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    transform = transforms.Compose([
        transforms.Resize(args.image_size),
        transforms.CenterCrop(args.image_size),
        transforms.ToTensor(),
        transforms.Lambda(lambda x: x.mul(255)),
    ])
    train_dataset = datasets.ImageFolder(args.dataset, transform)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)

    transformer = TransformerNet().to(device)
    optimizer = torch.optim.Adam(transformer.parameters(), args.lr)
    mse_loss = nn.MSELoss()
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    vgg = Vgg16(requires_grad=False).to(device)
    vgg.eval()
    if args.half_vgg:
        vgg.half()

    style_transform = transforms.Compose([transforms.ToTensor(), transforms.Lambda(lambda x: x.mul(255))])
    style = style_transform(load_image(args.style_image, size=args.style_size))
    style = style.repeat(args.batch_size, 1, 1, 1).to(device)
    with torch.no_grad(), torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.amp):
        features_style = vgg(normalize_batch(style))
        gram_style = [gram_matrix(y) for y in features_style]

    for e in range(args.epochs):
        transformer.train()
        agg_content, agg_style, count = 0.0, 0.0, 0
        for batch_id, (x, _) in enumerate(train_loader):
            n_batch = len(x)
            count += n_batch
            x = x.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)

            with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=args.amp):
                y = transformer(x)
                features_y = vgg(normalize_batch(y))
                features_x = vgg(normalize_batch(x))
                content_loss = args.content_weight * mse_loss(features_y.relu2_2, features_x.relu2_2)
                style_loss = 0.0
                for ft_y, gm_s in zip(features_y, gram_style):
                    style_loss += mse_loss(gram_matrix(ft_y), gm_s[:n_batch, :, :])
                style_loss = style_loss * args.style_weight
                if args.color_weight > 0:
                    # keep the luminance of the content image
                    y_lum = y.mean(dim=1, keepdim=True)  # expect: AMP004
                    x_lum = x.mean(dim=1, keepdim=True)
                    content_loss = content_loss + args.color_weight * mse_loss(y_lum, x_lum)
            tv_loss = args.tv_weight * total_variation_loss(y)  # expect: AMP002
            total_loss = content_loss + style_loss + tv_loss

            scaler.scale(total_loss).backward()
            torch.nn.utils.clip_grad_norm_(transformer.parameters(), args.max_grad_norm)  # expect: AMP005
            scaler.step(optimizer)
            scaler.update()

            agg_content += content_loss.item()
            agg_style += style_loss.item()
            if (batch_id + 1) % args.log_interval == 0:
                print(f"epoch {e + 1} [{count}/{len(train_dataset)}] content {agg_content / (batch_id + 1):.2f} "
                      f"style {agg_style / (batch_id + 1):.2f} tv {tv_loss.item():.2f}")
            if args.checkpoint_dir and (batch_id + 1) % args.checkpoint_interval == 0:
                path = os.path.join(args.checkpoint_dir, f"ckpt_epoch_{e}_batch_{batch_id + 1}.pth")
                save_checkpoint(transformer, path)

    transformer.eval().cpu()
    name = f"epoch_{args.epochs}_{os.path.basename(args.style_image).split('.')[0]}.model"
    torch.save(transformer.state_dict(), os.path.join(args.save_model_dir, name))
    print("Done, trained model saved at", os.path.join(args.save_model_dir, name))


@torch.no_grad()
def stylize(args):
    device = torch.device("cuda" if args.cuda else "cpu")
    content_image = load_image(args.content_image, scale=args.content_scale)
    content_image = transforms.Compose([transforms.ToTensor(), transforms.Lambda(lambda x: x.mul(255))])(content_image)
    content_image = content_image.unsqueeze(0).to(device)
    style_model = TransformerNet()
    state_dict = torch.load(args.model, map_location="cpu")
    style_model.load_state_dict({k: v.float() for k, v in state_dict.items()})
    style_model.to(device).eval()
    if args.fp16:
        style_model.half()
        content_image = content_image.half()
    output = style_model(content_image).float().cpu()
    save_image(args.output_image, output[0])


def main():
    parser = argparse.ArgumentParser(description="fast-neural-style")
    sub = parser.add_subparsers(dest="subcommand")
    tr = sub.add_parser("train")
    tr.add_argument("--epochs", type=int, default=2)
    tr.add_argument("--batch-size", type=int, default=4)
    tr.add_argument("--dataset", type=str, required=True)
    tr.add_argument("--style-image", type=str, default="images/style-images/mosaic.jpg")
    tr.add_argument("--save-model-dir", type=str, required=True)
    tr.add_argument("--checkpoint-dir", type=str, default=None)
    tr.add_argument("--image-size", type=int, default=256)
    tr.add_argument("--style-size", type=int, default=None)
    tr.add_argument("--seed", type=int, default=42)
    tr.add_argument("--content-weight", type=float, default=1e5)
    tr.add_argument("--style-weight", type=float, default=1e10)
    tr.add_argument("--tv-weight", type=float, default=1e-6)
    tr.add_argument("--color-weight", type=float, default=0.0)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--max-grad-norm", type=float, default=5.0)
    tr.add_argument("--log-interval", type=int, default=500)
    tr.add_argument("--checkpoint-interval", type=int, default=2000)
    tr.add_argument("--amp", action="store_true")
    tr.add_argument("--half-vgg", action="store_true")
    ev = sub.add_parser("eval")
    ev.add_argument("--content-image", type=str, required=True)
    ev.add_argument("--content-scale", type=float, default=None)
    ev.add_argument("--output-image", type=str, required=True)
    ev.add_argument("--model", type=str, required=True)
    ev.add_argument("--cuda", type=int, default=1)
    ev.add_argument("--fp16", action="store_true")
    args = parser.parse_args()

    if args.subcommand == "train":
        os.makedirs(args.save_model_dir, exist_ok=True)
        if args.checkpoint_dir:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
        train(args)
    elif args.subcommand == "eval":
        stylize(args)
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
