"""StyleGAN-like training loop: non-saturating loss, R1 penalty, path length regularization."""
import torch
import torch.nn.functional as F


def d_logistic_loss(real_pred, fake_pred):
    return F.softplus(-real_pred).mean() + F.softplus(fake_pred).mean()


def g_nonsaturating_loss(fake_pred):
    return F.softplus(-fake_pred).mean()


def d_r1_penalty(real_pred, real_img):
    (grad_real,) = torch.autograd.grad(outputs=real_pred.sum(), inputs=real_img, create_graph=True)
    return grad_real.pow(2).reshape(grad_real.shape[0], -1).sum(1).mean()


def train(generator, discriminator, loader, g_optim, d_optim, args):
    scaler = torch.amp.GradScaler("cuda")
    for i, real_img in enumerate(loader):
        real_img = real_img.cuda()
        noise = torch.randn(real_img.size(0), args.latent, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            fake_img = generator(noise)
            fake_pred = discriminator(fake_img.detach())
            real_pred = discriminator(real_img)
        d_loss = d_logistic_loss(real_pred, fake_pred)  # expect: AMP002
        d_optim.zero_grad()
        scaler.scale(d_loss).backward()
        if i % args.d_reg_every == 0:
            real_img.requires_grad = True
            with torch.autocast("cuda", dtype=torch.float16):
                real_pred = discriminator(real_img)
            r1 = d_r1_penalty(real_pred.float(), real_img)
            scaler.scale(args.r1 / 2 * r1 * args.d_reg_every).backward()
        scaler.step(d_optim)
        with torch.autocast("cuda", dtype=torch.float16):
            fake_pred = discriminator(generator(noise))
            g_loss = g_nonsaturating_loss(fake_pred)
        g_optim.zero_grad()
        scaler.scale(g_loss).backward()
        scaler.step(g_optim)
        scaler.update()


def accumulate(model1, model2, decay=0.999):
    par1 = dict(model1.named_parameters())
    par2 = dict(model2.named_parameters())
    for k in par1.keys():
        par1[k].data.mul_(decay).add_(par2[k].data, alpha=1 - decay)
