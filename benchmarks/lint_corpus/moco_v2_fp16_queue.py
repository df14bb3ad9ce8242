"""MoCo v2 pre-training (single node, DDP) with AMP and a half-precision negative queue."""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as models


class MoCo(nn.Module):
    def __init__(self, base_encoder, dim=128, K=65536, m=0.999, T=0.2, mlp=True):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q = base_encoder(num_classes=dim)
        self.encoder_k = base_encoder(num_classes=dim)
        if mlp:
            dim_mlp = self.encoder_q.fc.weight.shape[1]
            self.encoder_q.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_q.fc)
            self.encoder_k.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_k.fc)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)
            param_k.requires_grad = False
        # 65536 x 128 keys; fp16 halves the queue and matches the autocast keys
        self.register_buffer("queue", torch.randn(dim, K, dtype=torch.float16))
        self.queue = F.normalize(self.queue, dim=0)  # expect: AMP011
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        keys = concat_all_gather(keys)
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % batch_size == 0
        self.queue[:, ptr:ptr + batch_size] = keys.T
        self.queue_ptr[0] = (ptr + batch_size) % self.K

    @torch.no_grad()
    def queue_stats(self):
        return {"queue_norm": self.queue.norm(dim=0).mean().item()}  # expect: AMP004

    def forward(self, im_q, im_k):
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        self._dequeue_and_enqueue(k)
        return logits, labels


@torch.no_grad()
def concat_all_gather(tensor):
    tensors_gather = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(tensors_gather, tensor, async_op=False)
    return torch.cat(tensors_gather, dim=0)


def clip_gradients(model, max_norm):
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / target.size(0)) for k in topk]


def adjust_learning_rate(optimizer, epoch, args):
    lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / args.epochs))
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


def train(train_loader, model, criterion, optimizer, scaler, epoch, args):
    model.train()
    end = time.time()
    for i, (images, _) in enumerate(train_loader):
        images[0] = images[0].cuda(args.gpu, non_blocking=True)
        images[1] = images[1].cuda(args.gpu, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output, target = model(im_q=images[0], im_k=images[1])
        loss = criterion(output, target)  # expect: AMP002
        acc1, acc5 = accuracy(output, target, topk=(1, 5))

        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if args.clip_grad > 0:
            grad_norm = clip_gradients(model, args.clip_grad)  # expect: AMP005
        scaler.step(optimizer)
        scaler.update()

        if i % args.print_freq == 0 and args.rank == 0:
            stats = model.module.queue_stats()
            print(f"Epoch [{epoch}][{i}/{len(train_loader)}] loss {loss.item():.4f} acc@1 {acc1.item():.2f} "
                  f"acc@5 {acc5.item():.2f} queue_norm {stats['queue_norm']:.3f} time {time.time() - end:.3f}")
        end = time.time()


def main_worker(gpu, args):
    args.gpu = gpu
    args.rank = int(os.environ.get("RANK", 0)) + gpu
    dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    torch.cuda.set_device(gpu)
    model = MoCo(models.__dict__[args.arch], args.moco_dim, args.moco_k, args.moco_m, args.moco_t).cuda(gpu)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[gpu])
    criterion = nn.CrossEntropyLoss().cuda(gpu)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    from moco_data import build_loader  # local

    train_loader = build_loader(args)
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)
        adjust_learning_rate(optimizer, epoch, args)
        train(train_loader, model, criterion, optimizer, scaler, epoch, args)
        if args.rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict()}, f"checkpoint_{epoch:04d}.pth.tar")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="MoCo v2 pre-training")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", default=200, type=int)
    parser.add_argument("--lr", default=0.03, type=float)
    parser.add_argument("--clip-grad", default=0.0, type=float)
    parser.add_argument("--moco-dim", default=128, type=int)
    parser.add_argument("--moco-k", default=65536, type=int)
    parser.add_argument("--moco-m", default=0.999, type=float)
    parser.add_argument("--moco-t", default=0.2, type=float)
    parser.add_argument("--print-freq", default=10, type=int)
    parser.add_argument("--world-size", default=1, type=int)
    parser.add_argument("--dist-url", default="tcp://localhost:10001")
    main_worker(0, parser.parse_args())
