"""VideoMAE pretraining (tube masking, 90%) with an extra feature-prediction
target from an EMA copy of the encoder, plus a linear-probe evaluation."""
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def patchify(videos, tubelet=2, patch=16):
    b, c, t, h, w = videos.shape
    x = videos.reshape(b, c, t // tubelet, tubelet, h // patch, patch, w // patch, patch)
    x = x.permute(0, 2, 4, 6, 3, 5, 7, 1)
    return x.reshape(b, (t // tubelet) * (h // patch) * (w // patch), tubelet * patch * patch * c)


def sincos_table(n_pos, dim):
    pos = torch.arange(n_pos, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_pos, dim)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)
    return table.unsqueeze(0)


def tube_mask(batch, t_tokens, s_tokens, ratio, device):
    keep = int(s_tokens * (1 - ratio))
    noise = torch.rand(batch, s_tokens, device=device)
    ids = noise.argsort(dim=1)
    mask = torch.ones(batch, s_tokens, dtype=torch.bool, device=device)
    mask.scatter_(1, ids[:, :keep], False)
    return mask.repeat(1, t_tokens)


@dataclass
class MAEOutput:
    pix_loss: torch.Tensor
    feat_loss: torch.Tensor
    pred: torch.Tensor


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        attn = attn.softmax(dim=-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class VideoEncoder(nn.Module):
    def __init__(self, frames=16, img=224, tubelet=2, patch=16, dim=768, depth=12, heads=12):
        super().__init__()
        self.patch_embed = nn.Conv3d(3, dim, (tubelet, patch, patch), stride=(tubelet, patch, patch))
        n = (frames // tubelet) * (img // patch) ** 2
        self.register_buffer("pos_embed", sincos_table(n, dim), persistent=False)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, videos, mask=None):
        x = self.patch_embed(videos).flatten(2).transpose(1, 2) + self.pos_embed
        if mask is not None:
            x = x[~mask].reshape(x.size(0), -1, x.size(-1))
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class VideoMAE(nn.Module):
    def __init__(self, dim=768, dec_dim=384, dec_depth=4, n_tokens=1568, patch_dim=1536, norm_pix_loss=True):
        super().__init__()
        self.norm_pix_loss = norm_pix_loss
        self.encoder = VideoEncoder(dim=dim)
        self.decoder_embed = nn.Linear(dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.register_buffer("dec_pos", sincos_table(n_tokens, dec_dim), persistent=False)
        self.decoder_blocks = nn.ModuleList([Block(dec_dim, 6) for _ in range(dec_depth)])
        self.decoder_norm = nn.LayerNorm(dec_dim, eps=1e-6)
        self.decoder_pred = nn.Linear(dec_dim, patch_dim)
        self.feat_pred = nn.Linear(dec_dim, dim)

    def _align(self, pred_feat, target_feat):
        # standardize the predicted features per token, like the targets
        p_mu = pred_feat.mean(dim=-1, keepdim=True)  # expect: AMP004
        p_var = pred_feat.var(dim=-1, keepdim=True)  # expect: AMP004
        pred_feat = (pred_feat - p_mu) / torch.sqrt(p_var + 1e-10)  # expect: AMP011
        return F.smooth_l1_loss(pred_feat, target_feat, reduction="none").mean(dim=-1)

    def forward(self, videos, mask, target_feat):
        latent = self.encoder(videos, mask)
        x = self.decoder_embed(latent)
        b, n_vis, c = x.shape
        full = self.mask_token.expand(b, mask.size(1), c).clone()
        full[~mask] = x.reshape(-1, c)
        x = full + self.dec_pos
        for blk in self.decoder_blocks:
            x = blk(x)
        x = self.decoder_norm(x)
        pred = self.decoder_pred(x)
        target = patchify(videos)
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        m = mask.float()
        pix = ((pred - target) ** 2).mean(dim=-1)
        feat = self._align(self.feat_pred(x), target_feat)
        return MAEOutput(pix_loss=(pix * m).sum() / m.sum(), feat_loss=(feat * m).sum() / m.sum(), pred=pred)


@torch.no_grad()
def ema_update(teacher, student, momentum):
    for pt, ps in zip(teacher.parameters(), student.parameters()):
        pt.mul_(momentum).add_(ps.detach(), alpha=1.0 - momentum)


def pretrain(args, loader):
    model = VideoMAE(norm_pix_loss=args.norm_pix_loss).cuda()
    teacher = copy.deepcopy(model.encoder).requires_grad_(False).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    scaler = torch.amp.GradScaler("cuda")
    t_tok, s_tok = args.frames // 2, (args.img // 16) ** 2
    for epoch in range(args.epochs):
        for it, (videos, _) in enumerate(loader):
            videos = videos.cuda(non_blocking=True)
            mask = tube_mask(videos.size(0), t_tok, s_tok, args.mask_ratio, videos.device)
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    t = teacher(videos)
                    t = (t - t.mean(dim=-1, keepdim=True)) / (t.var(dim=-1, keepdim=True) + 1e-8).sqrt()
                out = model(videos, mask, t)
                loss = out.pix_loss + args.feat_weight * out.feat_loss
            with torch.no_grad():
                pred_std = out.pred.std(dim=-1)  # expect: AMP004
            scaler.scale(loss / args.accum_iter).backward()
            if (it + 1) % args.accum_iter == 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                scaler.step(optimizer)  # expect: AMP006
                optimizer.zero_grad(set_to_none=True)
                ema_update(teacher, model.encoder, args.ema_momentum)
        print(
            f"epoch {epoch} loss {loss.item():.4f} pix {out.pix_loss.item():.4f} "
            f"feat {out.feat_loss.item():.4f} pred_std {pred_std.float().mean().item():.3f}"
        )
    return model


def linear_probe(encoder, loader, num_classes, epochs=20, dim=768):
    encoder.requires_grad_(False)
    encoder.eval()
    bn = nn.BatchNorm1d(dim, affine=False).cuda()
    head = nn.Linear(dim, num_classes).cuda()
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9, weight_decay=0.0)
    for epoch in range(epochs):
        correct, seen = 0, 0
        for clips, labels in loader:
            clips, labels = clips.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
                with torch.no_grad():
                    feats = encoder(clips).mean(dim=1)
                logits = head(bn(feats))
                loss = F.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            correct += (logits.argmax(-1) == labels).sum().item()
            seen += labels.numel()
        print(f"probe epoch {epoch}: acc {correct / max(seen, 1):.4f}")
    return head


def main(args, pretrain_loader, probe_loader):
    torch.backends.cuda.matmul.allow_tf32 = True
    model = pretrain(args, pretrain_loader)
    torch.save(model.state_dict(), args.output)
    head = linear_probe(model.encoder, probe_loader, args.num_classes)
    torch.save(head.state_dict(), args.output.replace(".pt", "_probe.pt"))
