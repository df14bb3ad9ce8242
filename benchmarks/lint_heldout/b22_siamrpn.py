"""SiamRPN++-style Siamese tracker: AlexNet backbone, adjust neck, depthwise
cross-correlation RPN heads with response normalisation, and the training loop."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class AlexNetBackbone(nn.Module):
    configs = (3, 96, 256, 384, 384, 256)

    def __init__(self, width_mult=1.0):
        super().__init__()
        c = [3] + [int(x * width_mult) for x in self.configs[1:]]
        self.features = nn.Sequential(
            nn.Conv2d(c[0], c[1], 11, stride=2), nn.BatchNorm2d(c[1]), nn.MaxPool2d(3, 2), nn.ReLU(inplace=True),
            nn.Conv2d(c[1], c[2], 5), nn.BatchNorm2d(c[2]), nn.MaxPool2d(3, 2), nn.ReLU(inplace=True),
            nn.Conv2d(c[2], c[3], 3), nn.BatchNorm2d(c[3]), nn.ReLU(inplace=True),
            nn.Conv2d(c[3], c[4], 3), nn.BatchNorm2d(c[4]), nn.ReLU(inplace=True),
            nn.Conv2d(c[4], c[5], 3), nn.BatchNorm2d(c[5]),
        )
        self.out_channels = c[5]

    def forward(self, x):
        return self.features(x)


class AdjustLayer(nn.Module):
    def __init__(self, c_in, c_out, center_size=7):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.center_size = center_size

    def forward(self, x):
        x = self.down(x)
        if x.size(3) < 20:
            lo = (x.size(3) - self.center_size) // 2
            x = x[:, :, lo:lo + self.center_size, lo:lo + self.center_size]
        return x


def xcorr_depthwise(x, kernel):
    batch, channel = kernel.shape[:2]
    x = x.reshape(1, batch * channel, x.size(2), x.size(3))
    kernel = kernel.reshape(batch * channel, 1, kernel.size(2), kernel.size(3))
    out = F.conv2d(x, kernel, groups=batch * channel)
    return out.reshape(batch, channel, out.size(2), out.size(3))


class ResponseNorm(nn.Module):
    """Per-channel standardisation of the correlation maps, which differ in scale
    by orders of magnitude between templates."""

    def forward(self, r):
        mu = r.mean(dim=(2, 3), keepdim=True)  # expect: AMP004
        sigma = r.std(dim=(2, 3), keepdim=True)  # expect: AMP004
        return (r - mu) / (sigma + 1e-8)  # expect: AMP011


class DepthwiseXCorr(nn.Module):
    def __init__(self, c_in, hidden, c_out, kernel_size=3):
        super().__init__()
        self.conv_kernel = nn.Sequential(nn.Conv2d(c_in, hidden, kernel_size, bias=False),
                                         nn.BatchNorm2d(hidden), nn.ReLU(inplace=True))
        self.conv_search = nn.Sequential(nn.Conv2d(c_in, hidden, kernel_size, bias=False),
                                         nn.BatchNorm2d(hidden), nn.ReLU(inplace=True))
        self.response_norm = ResponseNorm()
        self.head = nn.Sequential(nn.Conv2d(hidden, hidden, 1, bias=False), nn.BatchNorm2d(hidden),
                                  nn.ReLU(inplace=True), nn.Conv2d(hidden, c_out, 1))

    def forward(self, kernel, search):
        kernel = self.conv_kernel(kernel)
        search = self.conv_search(search)
        feature = xcorr_depthwise(search, kernel)
        return self.head(self.response_norm(feature))


class DepthwiseRPN(nn.Module):
    def __init__(self, anchor_num=5, c_in=256, hidden=256):
        super().__init__()
        self.cls = DepthwiseXCorr(c_in, hidden, 2 * anchor_num)
        self.loc = DepthwiseXCorr(c_in, hidden, 4 * anchor_num)

    def forward(self, z_f, x_f):
        return self.cls(z_f, x_f), self.loc(z_f, x_f)


def log_softmax_cls(cls):
    b, a2, h, w = cls.size()
    cls = cls.view(b, 2, a2 // 2, h, w).permute(0, 2, 3, 4, 1).contiguous()
    return F.log_softmax(cls, dim=4)


def get_cls_loss(pred, label, select):
    if select.numel() == 0:
        return pred.sum() * 0.0
    pred = torch.index_select(pred, 0, select)
    label = torch.index_select(label, 0, select)
    return F.nll_loss(pred, label)


def select_cross_entropy_loss(pred, label):
    pred = pred.view(-1, 2)
    label = label.view(-1)
    pos = label.eq(1).nonzero().squeeze(1)
    neg = label.eq(0).nonzero().squeeze(1)
    return get_cls_loss(pred, label, pos) * 0.5 + get_cls_loss(pred, label, neg) * 0.5


def weight_l1_loss(pred_loc, label_loc, loss_weight):
    b, _, sh, sw = pred_loc.size()
    pred_loc = pred_loc.view(b, 4, -1, sh, sw)
    diff = (pred_loc - label_loc).abs()
    diff = diff.sum(dim=1).view(b, -1, sh, sw)
    return (diff * loss_weight).sum().div(b)


class SiamRPN(nn.Module):
    def __init__(self, anchor_num=5, cls_weight=1.0, loc_weight=1.2):
        super().__init__()
        self.backbone = AlexNetBackbone()
        self.neck = AdjustLayer(self.backbone.out_channels, 256)
        self.rpn_head = DepthwiseRPN(anchor_num, 256, 256)
        self.cls_weight = cls_weight
        self.loc_weight = loc_weight

    def template(self, z):
        self.zf = self.neck(self.backbone(z))

    def track(self, x):
        xf = self.neck(self.backbone(x))
        cls, loc = self.rpn_head(self.zf, xf)
        return {"cls": cls, "loc": loc}

    def forward(self, data):
        zf = self.neck(self.backbone(data["template"]))
        xf = self.neck(self.backbone(data["search"]))
        cls, loc = self.rpn_head(zf, xf)
        cls_loss = select_cross_entropy_loss(log_softmax_cls(cls), data["label_cls"])
        loc_loss = weight_l1_loss(loc, data["label_loc"], data["label_loc_weight"])
        total = self.cls_weight * cls_loss + self.loc_weight * loc_loss
        return {"total_loss": total, "cls_loss": cls_loss, "loc_loss": loc_loss}


def is_valid_number(x):
    return not (np.isnan(x) or np.isinf(x) or x > 1e4)


def build_optimizer(model, base_lr, backbone_lr_mult=0.1, weight_decay=1e-4):
    params = [
        {"params": [p for p in model.backbone.parameters() if p.requires_grad], "lr": base_lr * backbone_lr_mult},
        {"params": model.neck.parameters(), "lr": base_lr},
        {"params": model.rpn_head.parameters(), "lr": base_lr},
    ]
    return torch.optim.SGD(params, lr=base_lr, momentum=0.9, weight_decay=weight_decay)


def train_epoch(model, loader, optimizer, scheduler, epoch, grad_clip=10.0, log_every=20):
    model.train()
    for it, data in enumerate(loader):
        data = {k: v.cuda(non_blocking=True) for k, v in data.items()}
        with torch.autocast("cuda", dtype=torch.float16):  # expect: AMP010
            outputs = model(data)
            loss = outputs["total_loss"]
        if not is_valid_number(loss.item()):
            continue
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        scheduler.step()
        if it % log_every == 0:
            print(f"epoch {epoch} iter {it}: " + " ".join(f"{k} {v.item():.4f}" for k, v in outputs.items()))


class SiamRPNTracker:
    """Inference-side tracker: fp16 weights, cosine window and scale penalty."""

    def __init__(self, model, score_size=17, window_influence=0.42):
        self.model = model.eval().half()
        hanning = np.hanning(score_size)
        self.window = np.tile(np.outer(hanning, hanning).flatten(), 5)
        self.window_influence = window_influence

    @torch.inference_mode()
    def init(self, template_crop):
        self.model.template(template_crop.half())

    @torch.inference_mode()
    def track(self, search_crop):
        outputs = self.model.track(search_crop.half())
        score = F.softmax(outputs["cls"].float().view(2, -1).permute(1, 0), dim=1)[:, 1].cpu().numpy()
        pscore = score * (1 - self.window_influence) + self.window * self.window_influence
        best = int(np.argmax(pscore))
        return best, float(score[best])


def main(train_loader, epochs=20, base_lr=5e-3):
    model = SiamRPN().cuda()
    for p in model.backbone.features[:8].parameters():
        p.requires_grad_(False)
    optimizer = build_optimizer(model, base_lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=base_lr,
                                                    total_steps=epochs * len(train_loader))
    for epoch in range(epochs):
        train_epoch(model, train_loader, optimizer, scheduler, epoch)
        torch.save(model.state_dict(), f"siamrpn_e{epoch}.pth")
    return SiamRPNTracker(model)
