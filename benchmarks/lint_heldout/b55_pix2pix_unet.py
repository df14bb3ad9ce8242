"""pix2pix: image-to-image translation with a conditional GAN.

Single-file port of the pix2pix training script: aligned A|B dataset stub, U-Net generator
built recursively from skip-connection blocks, 70x70 PatchGAN discriminator, GAN + L1
objective, bf16 autocast on Ampere+, sampling, validation PSNR and checkpoints.
"""
import argparse
import copy
import itertools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class AlignedDataset(Dataset):
    """Stub for facades/maps: pairs of 256x256 images scaled to [-1, 1]."""

    def __init__(self, n=400, size=256):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        a = torch.rand(3, self.size, self.size) * 2 - 1
        b = torch.rand(3, self.size, self.size) * 2 - 1
        if torch.rand(1).item() < 0.5:
            a, b = a.flip(-1), b.flip(-1)
        return {"A": a, "B": b, "index": idx}


class UnetSkipConnectionBlock(nn.Module):
    """X -------------------identity---------------------- X
      |-- downsampling -- |submodule| -- upsampling --|"""

    def __init__(self, outer_nc, inner_nc, input_nc=None, submodule=None, outermost=False,
                 innermost=False, norm_layer=nn.InstanceNorm2d, use_dropout=False):
        super().__init__()
        self.outermost = outermost
        use_bias = norm_layer == nn.InstanceNorm2d
        input_nc = outer_nc if input_nc is None else input_nc
        downconv = nn.Conv2d(input_nc, inner_nc, kernel_size=4, stride=2, padding=1, bias=use_bias)
        downrelu, downnorm = nn.LeakyReLU(0.2, True), norm_layer(inner_nc)
        uprelu, upnorm = nn.ReLU(True), norm_layer(outer_nc)
        if outermost:
            upconv = nn.ConvTranspose2d(inner_nc * 2, outer_nc, kernel_size=4, stride=2, padding=1)
            model = [downconv, submodule, uprelu, upconv, nn.Tanh()]
        elif innermost:
            upconv = nn.ConvTranspose2d(inner_nc, outer_nc, kernel_size=4, stride=2, padding=1, bias=use_bias)
            model = [downrelu, downconv, uprelu, upconv, upnorm]
        else:
            upconv = nn.ConvTranspose2d(inner_nc * 2, outer_nc, kernel_size=4, stride=2, padding=1, bias=use_bias)
            model = [downrelu, downconv, downnorm, submodule, uprelu, upconv, upnorm]
            if use_dropout:
                model.append(nn.Dropout(0.5))
        self.model = nn.Sequential(*model)

    def forward(self, x):
        if self.outermost:
            return self.model(x)
        return torch.cat([x, self.model(x)], 1)


class UnetGenerator(nn.Module):
    def __init__(self, input_nc, output_nc, num_downs=8, ngf=64, norm_layer=nn.InstanceNorm2d, use_dropout=True):
        super().__init__()
        block = UnetSkipConnectionBlock(ngf * 8, ngf * 8, norm_layer=norm_layer, innermost=True)
        for _ in range(num_downs - 5):
            block = UnetSkipConnectionBlock(ngf * 8, ngf * 8, submodule=block, norm_layer=norm_layer, use_dropout=use_dropout)
        block = UnetSkipConnectionBlock(ngf * 4, ngf * 8, submodule=block, norm_layer=norm_layer)
        block = UnetSkipConnectionBlock(ngf * 2, ngf * 4, submodule=block, norm_layer=norm_layer)
        block = UnetSkipConnectionBlock(ngf, ngf * 2, submodule=block, norm_layer=norm_layer)
        self.model = UnetSkipConnectionBlock(output_nc, ngf, input_nc=input_nc, submodule=block,
                                             outermost=True, norm_layer=norm_layer)

    def forward(self, x):
        return self.model(x)


class NLayerDiscriminator(nn.Module):
    """PatchGAN: classifies overlapping 70x70 patches as real or fake (sigmoid output)."""

    def __init__(self, input_nc, ndf=64, n_layers=3, norm_layer=nn.InstanceNorm2d):
        super().__init__()
        seq = [nn.Conv2d(input_nc, ndf, 4, stride=2, padding=1), nn.LeakyReLU(0.2, True)]
        mult = 1
        for n in range(1, n_layers + 1):
            prev, mult = mult, min(2**n, 8)
            stride = 2 if n < n_layers else 1
            seq += [nn.Conv2d(ndf * prev, ndf * mult, 4, stride=stride, padding=1), norm_layer(ndf * mult), nn.LeakyReLU(0.2, True)]
        seq += [nn.Conv2d(ndf * mult, 1, 4, stride=1, padding=1), nn.Sigmoid()]
        self.model = nn.Sequential(*seq)

    def forward(self, x):
        return self.model(x)


class GANLoss(nn.Module):
    def __init__(self, target_real_label=1.0, target_fake_label=0.0):
        super().__init__()
        self.register_buffer("real_label", torch.tensor(target_real_label))
        self.register_buffer("fake_label", torch.tensor(target_fake_label))
        self.loss = nn.BCELoss()

    def get_target_tensor(self, prediction, target_is_real):
        target = self.real_label if target_is_real else self.fake_label
        return target.expand_as(prediction)

    def forward(self, prediction, target_is_real):
        return self.loss(prediction, self.get_target_tensor(prediction, target_is_real))  # expect: AMP003


def init_weights(net, init_gain=0.02):
    def init_func(m):
        name = m.__class__.__name__
        if hasattr(m, "weight") and name.find("Conv") != -1:
            nn.init.normal_(m.weight.data, 0.0, init_gain)
            if getattr(m, "bias", None) is not None:
                nn.init.constant_(m.bias.data, 0.0)

    net.apply(init_func)


def set_requires_grad(nets, requires_grad=False):
    for net in nets:
        for p in net.parameters():
            p.requires_grad = requires_grad


def discriminator_calibration(netD, real_A, real_B, fake_B):
    """BCE of the sigmoid discriminator on one batch, computed in fp32 for logging."""
    with torch.no_grad(), torch.autocast(device_type="cuda", enabled=False):
        p_real = netD(torch.cat((real_A, real_B), 1).float()).float()
        p_fake = netD(torch.cat((real_A, fake_B), 1).float()).float()
        bce = F.binary_cross_entropy(p_real, torch.ones_like(p_real)) + F.binary_cross_entropy(p_fake, torch.zeros_like(p_fake))
    return bce.item()


@torch.no_grad()
def validate(netG, loader, device):
    netG.eval()
    l1, psnr, n = 0.0, 0.0, 0
    for batch in loader:
        real_A, real_B = batch["A"].to(device), batch["B"].to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            fake_B = netG(real_A)
        fake = fake_B.float()
        l1 += F.l1_loss(fake, real_B).item()
        mse = ((fake - real_B) ** 2).mean(dim=(1, 2, 3))
        psnr += (10 * torch.log10(4.0 / (mse + 1e-10))).mean().item()
        n += 1
    netG.train()
    return l1 / max(n, 1), psnr / max(n, 1)


def save_networks(netG, netD, epoch, save_dir, compact=False):
    torch.save(netD.state_dict(), os.path.join(save_dir, f"{epoch}_net_D.pth"))
    if compact:
        torch.save(copy.deepcopy(netG).half().state_dict(), os.path.join(save_dir, f"{epoch}_net_G_fp16.pth"))
    else:
        torch.save(netG.state_dict(), os.path.join(save_dir, f"{epoch}_net_G.pth"))


def pretrain_generator_l1(netG, loader, device, steps, lr=2e-4):
    """Warm-up of G on the L1 term only. bf16, so the scaler stays off; it is kept so the
    loop has the same shape as the fp16 variant of this function."""
    opt = torch.optim.Adam(netG.parameters(), lr=lr, betas=(0.5, 0.999))
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    loss = torch.zeros(())
    for _, batch in zip(range(steps), itertools.cycle(loader)):
        real_A, real_B = batch["A"].to(device), batch["B"].to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = F.l1_loss(netG(real_A), real_B)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(netG.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    return loss.item()


def train(args):
    device = torch.device("cuda")
    netG = UnetGenerator(3, 3, 8, args.ngf, use_dropout=True).to(device)
    netD = NLayerDiscriminator(6, args.ndf, n_layers=3).to(device)
    init_weights(netG)
    init_weights(netD)
    criterionGAN = GANLoss().to(device)
    criterionL1 = nn.L1Loss()
    opt_G = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    opt_D = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    scaler = torch.amp.GradScaler("cuda")  # expect: AMP010

    def lambda_rule(epoch):
        return 1.0 - max(0, epoch + args.epoch_count - args.n_epochs) / float(args.n_epochs_decay + 1)

    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lambda_rule) for opt in (opt_G, opt_D)]
    loader = DataLoader(AlignedDataset(), batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True)
    val_loader = DataLoader(AlignedDataset(n=100), batch_size=args.batch_size)
    if args.l1_warmup_steps > 0:
        print(f"L1 warm-up done, L1 {pretrain_generator_l1(netG, loader, device, args.l1_warmup_steps):.4f}")
    best_l1 = 1e9
    for epoch in range(args.epoch_count, args.n_epochs + args.n_epochs_decay + 1):
        for i, batch in enumerate(loader):
            real_A = batch["A"].to(device, dtype=torch.bfloat16)  # expect: AMP001
            real_B = batch["B"].to(device, non_blocking=True)
            # ---- update D: maximise log(D(x, y)) + log(1 - D(x, G(x))) ----
            set_requires_grad([netD], True)
            opt_D.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                fake_B = netG(real_A)
                pred_fake = netD(torch.cat((real_A, fake_B.detach()), 1))
                loss_D_fake = criterionGAN(pred_fake, False)
                pred_real = netD(torch.cat((real_A, real_B), 1))
                loss_D_real = criterionGAN(pred_real, True)
                loss_D = (loss_D_fake + loss_D_real) * 0.5
                scaler.scale(loss_D).backward()  # expect: AMP008
            scaler.step(opt_D)
            # ---- update G: fool D and stay close to the target in L1 ----
            set_requires_grad([netD], False)
            opt_G.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                pred_fake = netD(torch.cat((real_A, fake_B), 1))
                loss_G_GAN = criterionGAN(pred_fake, True)
                loss_G_L1 = criterionL1(fake_B, real_B) * args.lambda_L1
                loss_G = loss_G_GAN + loss_G_L1
            scaler.scale(loss_G).backward()
            torch.nn.utils.clip_grad_norm_(netG.parameters(), args.max_grad_norm)  # expect: AMP005
            opt_G.step()  # expect: AMP006
            scaler.update()
            if i % args.print_freq == 0:
                with torch.no_grad():
                    d_acc = 0.5 * ((pred_real > 0.5).float().mean() + (pred_fake < 0.5).float().mean())
                calib = discriminator_calibration(netD, real_A, real_B, fake_B.detach())
                print(f"epoch {epoch} iter {i} G_GAN {loss_G_GAN.item():.3f} G_L1 {loss_G_L1.item():.3f} "
                      f"D {loss_D.item():.3f} D_acc {d_acc.item():.2f} D_bce32 {calib:.3f}")
        for s in schedulers:
            s.step()
        val_l1, val_psnr = validate(netG, val_loader, device)
        print(f"end of epoch {epoch}: val L1 {val_l1:.4f} PSNR {val_psnr:.2f} lr {opt_G.param_groups[0]['lr']:.6f}")
        if val_l1 < best_l1:
            best_l1 = val_l1
            save_networks(netG, netD, "best", args.checkpoints_dir)
        if epoch % args.save_epoch_freq == 0:
            save_networks(netG, netD, epoch, args.checkpoints_dir, compact=True)


def parse_args():
    p = argparse.ArgumentParser("pix2pix")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--ngf", type=int, default=64)
    p.add_argument("--ndf", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.0002)
    p.add_argument("--beta1", type=float, default=0.5)
    p.add_argument("--lambda-L1", dest="lambda_L1", type=float, default=100.0)
    p.add_argument("--max-grad-norm", type=float, default=10.0)
    p.add_argument("--l1-warmup-steps", type=int, default=0)
    p.add_argument("--epoch-count", type=int, default=1)
    p.add_argument("--n-epochs", type=int, default=100)
    p.add_argument("--n-epochs-decay", type=int, default=100)
    p.add_argument("--print-freq", type=int, default=100)
    p.add_argument("--save-epoch-freq", type=int, default=5)
    p.add_argument("--checkpoints-dir", default="./checkpoints/facades_pix2pix")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.checkpoints_dir, exist_ok=True)
    train(args)
