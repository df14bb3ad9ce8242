"""Tiny YOLOv8-style detector: anchor-free decoupled head, DFL box regression,
task-aligned assignment and a quality focal classification loss."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvBNAct(nn.Module):
    def __init__(self, c1, c2, k=1, s=1):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class SqueezeExcite(nn.Module):
    def __init__(self, c, r=0.25):
        super().__init__()
        hidden = max(8, int(c * r))
        self.fc1 = nn.Conv2d(c, hidden, 1)
        self.fc2 = nn.Conv2d(hidden, c, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)  # expect: AMP004
        s = self.fc2(F.silu(self.fc1(s)))
        return x * torch.sigmoid(s)


class Bottleneck(nn.Module):
    def __init__(self, c, shortcut=True, e=0.5):
        super().__init__()
        c_ = int(c * e)
        self.cv1 = ConvBNAct(c, c_, 3)
        self.cv2 = nn.Conv2d(c_, c, 3, 1, 1, bias=False)
        self.se = SqueezeExcite(c)
        self.add = shortcut

    def forward(self, x):
        y = F.silu(self.se(self.cv2(self.cv1(x))))
        return x + y if self.add else y


class C2f(nn.Module):
    def __init__(self, c1, c2, n=1, shortcut=True):
        super().__init__()
        self.c = c2 // 2
        self.cv1 = ConvBNAct(c1, 2 * self.c, 1)
        self.cv2 = ConvBNAct((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class SPPF(nn.Module):
    def __init__(self, c1, c2, k=5):
        super().__init__()
        self.k = k
        self.cv1 = ConvBNAct(c1, c1 // 2, 1)
        self.cv2 = nn.Conv2d(c1 // 2 * 4, c2, 1)

    def _pool_same(self, x):
        # TF 'SAME' max pooling: pad explicitly so the spatial size is kept
        total = self.k - 1
        x = F.pad(x, [total // 2, total - total // 2] * 2, value=-1e9)  # expect: AMP007
        return F.max_pool2d(x, self.k, stride=1)

    def forward(self, x):
        y = [self.cv1(x)]
        y.extend(self._pool_same(y[-1]) for _ in range(3))
        return F.silu(self.cv2(torch.cat(y, 1)))


class SpatialAttention(nn.Module):
    def __init__(self, k=7):
        super().__init__()
        self.cv1 = nn.Conv2d(2, 1, k, padding=k // 2, bias=False)

    def forward(self, x):
        avg = torch.mean(x, 1, keepdim=True)  # expect: AMP004
        mx = torch.max(x, 1, keepdim=True)[0]
        return x * torch.sigmoid(self.cv1(torch.cat([avg, mx], 1)))


class Detect(nn.Module):
    def __init__(self, nc=80, ch=(64, 128, 256), reg_max=16):
        super().__init__()
        self.nc, self.nl, self.reg_max = nc, len(ch), reg_max
        self.stride = torch.tensor([8.0, 16.0, 32.0])
        c2, c3 = max(16, ch[0] // 4, reg_max * 4), max(ch[0], min(nc, 100))
        self.cv2 = nn.ModuleList(nn.Sequential(ConvBNAct(x, c2, 3), ConvBNAct(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1)) for x in ch)
        self.cv3 = nn.ModuleList(nn.Sequential(ConvBNAct(x, c3, 3), ConvBNAct(c3, c3, 3), nn.Conv2d(c3, nc, 1)) for x in ch)

    def forward(self, x):
        for i in range(self.nl):
            x[i] = torch.cat((self.cv2[i](x[i]), self.cv3[i](x[i])), 1)
        return x


class TinyYOLOv8(nn.Module):
    def __init__(self, nc=80, w=(32, 64, 128, 256)):
        super().__init__()
        self.stem = nn.Sequential(ConvBNAct(3, w[0], 3, 2), ConvBNAct(w[0], w[0], 3, 2), C2f(w[0], w[0], 1))
        self.stage3 = nn.Sequential(ConvBNAct(w[0], w[1], 3, 2), C2f(w[1], w[1], 2))
        self.stage4 = nn.Sequential(ConvBNAct(w[1], w[2], 3, 2), C2f(w[2], w[2], 2))
        self.stage5 = nn.Sequential(ConvBNAct(w[2], w[3], 3, 2), C2f(w[3], w[3], 1))
        self.sppf = SPPF(w[3], w[3])
        self.sa = SpatialAttention()
        self.lat4 = C2f(w[3] + w[2], w[2], 1, shortcut=False)
        self.lat3 = C2f(w[2] + w[1], w[1], 1, shortcut=False)
        self.head = Detect(nc, ch=(w[1], w[2], w[3]))

    def forward(self, x):
        c3 = self.stage3(self.stem(x))
        c4 = self.stage4(c3)
        c5 = self.sa(self.sppf(self.stage5(c4)))
        p4 = self.lat4(torch.cat([F.interpolate(c5, scale_factor=2.0, mode="nearest"), c4], 1))
        p3 = self.lat3(torch.cat([F.interpolate(p4, scale_factor=2.0, mode="nearest"), c3], 1))
        return self.head([p3, p4, c5])


def make_anchors(feats, strides, offset=0.5):
    anchor_points, stride_tensor = [], []
    dtype, device = feats[0].dtype, feats[0].device
    for i, stride in enumerate(strides):
        _, _, h, w = feats[i].shape
        sx = torch.arange(end=w, device=device, dtype=dtype) + offset
        sy = torch.arange(end=h, device=device, dtype=dtype) + offset
        sy, sx = torch.meshgrid(sy, sx, indexing="ij")
        anchor_points.append(torch.stack((sx, sy), -1).view(-1, 2))
        stride_tensor.append(torch.full((h * w, 1), float(stride), dtype=dtype, device=device))
    return torch.cat(anchor_points), torch.cat(stride_tensor)


def bbox_iou(b1, b2, eps=1e-7):
    (x1, y1, x2, y2), (u1, v1, u2, v2) = b1.chunk(4, -1), b2.chunk(4, -1)
    inter = (torch.min(x2, u2) - torch.max(x1, u1)).clamp(0) * (torch.min(y2, v2) - torch.max(y1, v1)).clamp(0)
    union = (x2 - x1) * (y2 - y1) + (u2 - u1) * (v2 - v1) - inter + eps
    return (inter / union).squeeze(-1)


class TaskAlignedAssigner(nn.Module):
    def __init__(self, topk=10, num_classes=80, alpha=0.5, beta=6.0):
        super().__init__()
        self.topk, self.nc, self.alpha, self.beta = topk, num_classes, alpha, beta

    @torch.no_grad()
    def forward(self, pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt):
        bs = gt_bboxes.shape[0]
        lt, rb = gt_bboxes[..., None, :2], gt_bboxes[..., None, 2:]
        deltas = torch.cat([anc_points[None, None] - lt, rb - anc_points[None, None]], -1)
        mask_in = (deltas.amin(-1) > 1e-9) & mask_gt.bool()
        ind = gt_labels.long().squeeze(-1)
        scores = pd_scores.sigmoid().gather(2, ind[:, None, :].expand(-1, pd_scores.shape[1], -1)).permute(0, 2, 1)
        overlaps = bbox_iou(gt_bboxes[:, :, None], pd_bboxes[:, None]).clamp_(0)
        align = scores.pow(self.alpha) * overlaps.pow(self.beta) * mask_in
        topk_idx = align.topk(self.topk, dim=-1).indices
        mask_pos = torch.zeros_like(mask_in).scatter_(-1, topk_idx, True) & mask_in
        # an anchor claimed by several objects goes to the one it overlaps most
        gt_idx = overlaps.masked_fill(~mask_pos, -1.0).argmax(1)
        fg_mask = mask_pos.any(1)
        batch_idx = torch.arange(bs, device=gt_bboxes.device)[:, None]
        target_bboxes = gt_bboxes[batch_idx, gt_idx]
        target_scores = F.one_hot(ind[batch_idx, gt_idx], self.nc).float() * fg_mask[..., None]
        align = align * mask_pos
        norm = (align * overlaps.amax(-1, keepdim=True) / (align.amax(-1, keepdim=True) + 1e-9)).amax(1)
        return target_bboxes, target_scores * norm.unsqueeze(-1), fg_mask


def quality_focal_loss(pred_logits, target, beta=2.0):
    pt = pred_logits.sigmoid()
    pos = target * torch.log(pt + 1e-9)  # expect: AMP011
    neg = (1.0 - target) * torch.log(1.0 - pt + 1e-9)  # expect: AMP011
    return -(pos + neg) * (pt - target).abs().pow(beta)


class DetectionLoss:
    def __init__(self, model, tal_topk=10):
        head = model.head
        self.nc, self.reg_max, self.stride = head.nc, head.reg_max, head.stride
        self.assigner = TaskAlignedAssigner(topk=tal_topk, num_classes=self.nc)
        self.proj = torch.arange(self.reg_max, dtype=torch.float)
        self.hyp = {"box": 7.5, "cls": 0.5, "dfl": 1.5}

    def bbox_decode(self, anchor_points, pred_dist):
        b, a, c = pred_dist.shape
        pred_dist = pred_dist.view(b, a, 4, c // 4).softmax(3).matmul(self.proj.to(pred_dist.device))
        lt, rb = pred_dist.chunk(2, -1)
        return torch.cat((anchor_points - lt, anchor_points + rb), -1)

    @staticmethod
    def df_loss(pred_dist, target):
        tl = target.long()
        wl = tl + 1 - target
        left = F.cross_entropy(pred_dist, tl.view(-1), reduction="none").view(tl.shape) * wl
        right = F.cross_entropy(pred_dist, (tl + 1).view(-1), reduction="none").view(tl.shape) * (1 - wl)
        return (left + right).mean(-1, keepdim=True)

    def __call__(self, preds, targets):
        bs = preds[0].shape[0]
        pred_distri = torch.cat([xi[:, : self.reg_max * 4].flatten(2) for xi in preds], 2).permute(0, 2, 1)
        pred_scores = torch.cat([xi[:, self.reg_max * 4 :].flatten(2) for xi in preds], 2).permute(0, 2, 1)
        anchor_points, stride_tensor = make_anchors(preds, self.stride, 0.5)
        gt_labels, gt_bboxes = targets["cls"], targets["bboxes"]
        mask_gt = gt_bboxes.sum(2, keepdim=True).gt_(0.0)
        pred_bboxes = self.bbox_decode(anchor_points, pred_distri)
        target_bboxes, target_scores, fg_mask = self.assigner(
            pred_scores.detach(), (pred_bboxes.detach() * stride_tensor).type(gt_bboxes.dtype),
            anchor_points * stride_tensor, gt_labels, gt_bboxes, mask_gt,
        )
        target_scores_sum = max(target_scores.sum(), 1)
        loss_cls = quality_focal_loss(pred_scores, target_scores).sum() / target_scores_sum
        loss_iou = loss_dfl = torch.zeros((), device=pred_scores.device)
        if fg_mask.sum():
            target_bboxes = target_bboxes / stride_tensor
            weight = target_scores.sum(-1)[fg_mask].unsqueeze(-1)
            iou = bbox_iou(pred_bboxes[fg_mask], target_bboxes[fg_mask])
            loss_iou = ((1.0 - iou) * weight.squeeze(-1)).sum() / target_scores_sum
            x1y1, x2y2 = target_bboxes.chunk(2, -1)
            ltrb = torch.cat((anchor_points - x1y1, x2y2 - anchor_points), -1).clamp_(0, self.reg_max - 1.01)
            dfl = self.df_loss(pred_distri[fg_mask].view(-1, self.reg_max), ltrb[fg_mask])
            loss_dfl = (dfl * weight).sum() / target_scores_sum
        loss = self.hyp["box"] * loss_iou + self.hyp["cls"] * loss_cls + self.hyp["dfl"] * loss_dfl
        return loss * bs, torch.stack([loss_iou, loss_cls, loss_dfl]).detach()


def make_scaler(enabled):
    try:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler(enabled=enabled)


def train(loader, epochs=100, nc=80, device="cuda", amp=True):
    model = TinyYOLOv8(nc=nc).to(device)
    criterion = DetectionLoss(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True, weight_decay=5e-4)
    scaler = make_scaler(amp)
    for epoch in range(epochs):
        model.train()
        for imgs, targets in loader:
            imgs = imgs.to(device, non_blocking=True).float() / 255
            targets = {k: v.to(device) for k, v in targets.items()}
            with torch.cuda.amp.autocast(enabled=amp):  # expect: AMP009
                preds = model(imgs)
                loss, items = criterion(preds, targets)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        print(f"epoch {epoch}: box {items[0]:.4f} cls {items[1]:.4f} dfl {items[2]:.4f}")
    return model
