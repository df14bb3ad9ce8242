"""Momentum-contrast pre-training for video clips (R(2+1)D backbone) with an
auxiliary prototype-distillation term and a frame-attention temporal head.

Launch:  torchrun --nproc_per_node 8 pretrain_video.py --cfg configs/k400_r2p1d.yaml
"""
import argparse
import logging
import math
import os
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from video_ssl.data import build_pretrain_loader
from video_ssl.utils import cosine_scheduler, MetricLogger, concat_all_gather, init_distributed

logger = logging.getLogger("video_moco")


class Conv2Plus1D(nn.Sequential):
    def __init__(self, in_planes, out_planes, mid_planes, stride=1):
        super().__init__(
            nn.Conv3d(in_planes, mid_planes, (1, 3, 3), (1, stride, stride), (0, 1, 1), bias=False),
            nn.BatchNorm3d(mid_planes),
            nn.ReLU(inplace=True),
            nn.Conv3d(mid_planes, out_planes, (3, 1, 1), (stride, 1, 1), (1, 0, 0), bias=False))


class BasicBlock3d(nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        mid = (inplanes * planes * 3 * 3 * 3) // (inplanes * 3 * 3 + 3 * planes)
        self.conv1 = nn.Sequential(Conv2Plus1D(inplanes, planes, mid, stride), nn.BatchNorm3d(planes), nn.ReLU(True))
        self.conv2 = nn.Sequential(Conv2Plus1D(planes, planes, mid), nn.BatchNorm3d(planes))
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv3d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm3d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(self.conv2(self.conv1(x)) + identity)


class EncoderOutput(NamedTuple):
    proj: torch.Tensor       # un-normalised projection
    proto: torch.Tensor      # prototype scores
    clip_emb: torch.Tensor   # attention-pooled frame embedding
    att_entropy: torch.Tensor


class VideoEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        widths = cfg["widths"]
        self.stem = nn.Sequential(nn.Conv3d(3, 45, (1, 7, 7), (1, 2, 2), (0, 3, 3), bias=False),
                                  nn.BatchNorm3d(45), nn.ReLU(True),
                                  nn.Conv3d(45, widths[0], (3, 1, 1), 1, (1, 0, 0), bias=False),
                                  nn.BatchNorm3d(widths[0]), nn.ReLU(True))
        stages, inplanes = [], widths[0]
        for i, w in enumerate(widths):
            stages.append(nn.Sequential(BasicBlock3d(inplanes, w, stride=1 if i == 0 else 2), BasicBlock3d(w, w)))
            inplanes = w
        self.stages = nn.Sequential(*stages)
        dim = widths[-1]
        self.projector = nn.Sequential(nn.Linear(dim, cfg["mlp_dim"]), nn.BatchNorm1d(cfg["mlp_dim"]),
                                       nn.ReLU(True), nn.Linear(cfg["mlp_dim"], cfg["out_dim"]))
        self.prototypes = nn.Linear(cfg["out_dim"], cfg["num_prototypes"], bias=False)
        self.frame_proj = nn.Linear(dim, cfg["out_dim"])
        self.frame_att = nn.Linear(cfg["out_dim"], 1)

    def forward(self, clip):
        x = self.stages(self.stem(clip))                         # B, C, T, H, W
        feat = F.adaptive_avg_pool3d(x, 1).flatten(1)
        proj = self.projector(feat)
        proto = self.prototypes(F.normalize(proj, dim=1))

        frames = F.adaptive_avg_pool3d(x, (None, 1, 1)).flatten(2).transpose(1, 2)  # B, T, C
        frame_emb = self.frame_proj(frames)
        slow_emb = frame_emb.mean(dim=1)  # expect: AMP004
        att = torch.sigmoid(self.frame_att(frame_emb))           # B, T, 1
        entropy = -(att * torch.log(att + 1e-10)).sum(dim=1)  # expect: AMP011
        att = att / (att.sum(dim=1, keepdim=True) + 1e-8)
        clip_emb = (att * frame_emb).sum(dim=1) + slow_emb
        return EncoderOutput(proj=proj, proto=proto, clip_emb=clip_emb, att_entropy=entropy)


class SSLOutput(NamedTuple):
    loss_nce: torch.Tensor
    loss_proto: torch.Tensor
    var_reg: torch.Tensor
    att_entropy: torch.Tensor
    acc: torch.Tensor


class VideoMoCo(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.K, self.m, self.T = cfg["queue_size"], cfg["momentum"], cfg["temperature"]
        self.encoder_q = VideoEncoder(cfg)
        self.encoder_k = VideoEncoder(cfg)
        for p_q, p_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            p_k.data.copy_(p_q.data)
            p_k.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(cfg["out_dim"], self.K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))
        self.register_buffer("center", torch.zeros(1, cfg["num_prototypes"]))
        self.center_momentum = cfg.get("center_momentum", 0.9)

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for p_q, p_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            p_k.data.mul_(self.m).add_(p_q.data, alpha=1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        keys = concat_all_gather(keys)
        ptr = int(self.queue_ptr)
        self.queue[:, ptr:ptr + keys.shape[0]] = keys.T
        self.queue_ptr[0] = (ptr + keys.shape[0]) % self.K

    @torch.no_grad()
    def _update_center(self, teacher_proto):
        batch_center = teacher_proto.mean(dim=0, keepdim=True)  # expect: AMP004
        if dist.is_initialized():
            dist.all_reduce(batch_center)
            batch_center = batch_center / dist.get_world_size()
        self.center.mul_(self.center_momentum).add_(batch_center, alpha=1 - self.center_momentum)

    def _variance_term(self, z):
        std = torch.sqrt(z.var(dim=0) + 1e-4)  # expect: AMP004
        return torch.mean(F.relu(1.0 - std))  # expect: AMP004

    def forward(self, clip_q, clip_k):
        out_q = self.encoder_q(clip_q)
        q = F.normalize(out_q.proj, dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            out_k = self.encoder_k(clip_k)
            k = F.normalize(out_k.proj, dim=1)

        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        loss_nce = F.cross_entropy(logits, labels)

        # prototype distillation: sharpened, centred teacher scores
        p_s = F.log_softmax(out_q.proto / 0.1, dim=-1)
        p_t = F.softmax((out_k.proto - self.center) / 0.04, dim=-1)
        loss_proto = torch.sum(-p_t * p_s, dim=-1).mean()
        self._update_center(out_k.proto)

        var_reg = self._variance_term(out_q.proj)
        acc = (logits.argmax(dim=1) == 0).float().mean()
        self._dequeue_and_enqueue(k)
        return SSLOutput(loss_nce, loss_proto, var_reg, out_q.att_entropy.mean(), acc)


def train_one_epoch(model, loader, optimizer, scaler, lr_schedule, epoch, cfg, log_every=20):
    model.train()
    metrics = MetricLogger(delimiter="  ")
    accum = cfg["accum_iter"]
    optimizer.zero_grad(set_to_none=True)
    for it, (clip_q, clip_k) in enumerate(metrics.log_every(loader, log_every, f"Epoch [{epoch}]")):
        step = epoch * len(loader) + it
        for g in optimizer.param_groups:
            g["lr"] = lr_schedule[step]
        clip_q = clip_q.cuda(non_blocking=True)
        clip_k = clip_k.cuda(non_blocking=True)

        with torch.autocast("cuda", dtype=torch.float16):
            out = model(clip_q, clip_k)
            loss = (out.loss_nce + cfg["proto_weight"] * out.loss_proto + cfg["var_weight"] * out.var_reg
                    - cfg["entropy_weight"] * out.att_entropy)
            scaler.scale(loss / accum).backward()  # expect: AMP008

        if not math.isfinite(loss.item()):
            logger.error("loss is %s, stopping", loss.item())
            raise SystemExit(1)

        if (it + 1) % accum == 0:
            scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg["clip_grad"])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            metrics.update(grad_norm=grad_norm.item())
        metrics.update(loss=loss.item(), nce=out.loss_nce.item(), acc=out.acc.item(), lr=lr_schedule[step])
    return {k: m.global_avg for k, m in metrics.meters.items()}


def main():
    parser = argparse.ArgumentParser("video moco pre-training")
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--output_dir", default="./output/video_moco")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    init_distributed()
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    os.makedirs(args.output_dir, exist_ok=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN)

    loader = build_pretrain_loader(cfg)
    model = VideoMoCo(cfg).cuda()
    model = DDP(model, device_ids=[torch.cuda.current_device()])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=cfg["lr"], momentum=0.9, weight_decay=cfg["weight_decay"])
    scaler = torch.amp.GradScaler("cuda")
    lr_schedule = cosine_scheduler(cfg["lr"] * cfg["batch_size"] * dist.get_world_size() / 256, 1e-6,
                                   cfg["epochs"], len(loader), warmup_epochs=cfg["warmup_epochs"])

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, cfg["epochs"]):
        loader.sampler.set_epoch(epoch)
        t0 = time.time()
        stats = train_one_epoch(model, loader, optimizer, scaler, lr_schedule, epoch, cfg)
        if rank == 0:
            logger.info("epoch %d done in %.1f min: %s", epoch, (time.time() - t0) / 60, stats)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "cfg": cfg},
                       os.path.join(args.output_dir, "checkpoint.pth"))


if __name__ == "__main__":
    main()
