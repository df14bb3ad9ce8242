"""ProtoPNet ("This looks like that") for multi-label chest X-ray findings.

Each finding owns a fixed number of prototypes; a patch's similarity to a prototype is
log((d + 1) / (d + eps)) of the squared L2 distance in the add-on latent space.
"""
import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Backbone(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.stem = conv_bn(1, width, 2)
        self.layer1 = nn.Sequential(conv_bn(width, width), conv_bn(width, width))
        self.layer2 = nn.Sequential(conv_bn(width, 2 * width, 2), conv_bn(2 * width, 2 * width))
        self.layer3 = nn.Sequential(conv_bn(2 * width, 4 * width, 2), conv_bn(4 * width, 4 * width))
        self.layer4 = nn.Sequential(conv_bn(4 * width, 8 * width, 2), conv_bn(8 * width, 8 * width))
        self.out_channels = 8 * width

    def forward(self, x):
        return self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))


class AddOn(nn.Module):
    """Bottleneck mapping backbone features into the prototype space (values in (0, 1))."""

    def __init__(self, cin, proto_dim):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, proto_dim, 1)
        self.conv2 = nn.Conv2d(proto_dim, proto_dim, 1)

    def forward(self, x):
        return torch.sigmoid(self.conv2(F.relu(self.conv1(x))))


class ProtoPNet(nn.Module):
    def __init__(self, num_classes=14, protos_per_class=10, proto_dim=128, width=64):
        super().__init__()
        self.num_classes = num_classes
        self.num_prototypes = num_classes * protos_per_class
        self.prototype_shape = (self.num_prototypes, proto_dim, 1, 1)
        self.epsilon = 1e-4
        self.backbone = Backbone(width)
        self.add_on = AddOn(self.backbone.out_channels, proto_dim)
        self.prototype_vectors = nn.Parameter(torch.rand(self.prototype_shape))
        self.register_buffer("ones", torch.ones(self.prototype_shape))
        identity = torch.zeros(self.num_prototypes, num_classes)
        identity[torch.arange(self.num_prototypes), torch.arange(self.num_prototypes) // protos_per_class] = 1
        self.register_buffer("prototype_class_identity", identity)
        self.last_layer = nn.Linear(self.num_prototypes, num_classes, bias=False)
        self.set_last_layer_incorrect_connection(-0.5)

    def set_last_layer_incorrect_connection(self, strength):
        positive = self.prototype_class_identity.t()
        self.last_layer.weight.data.copy_(positive + strength * (1 - positive))

    def _l2_convolution(self, z):
        x2_patch_sum = F.conv2d(z ** 2, weight=self.ones)
        p2 = torch.sum(self.prototype_vectors ** 2, dim=(1, 2, 3)).view(-1, 1, 1)
        xp = F.conv2d(z, weight=self.prototype_vectors)
        return F.relu(x2_patch_sum + (-2 * xp + p2))

    def distance_2_similarity(self, distances):
        return torch.log((distances + 1) / (distances + self.epsilon))

    def forward(self, x):
        z = self.add_on(self.backbone(x))
        var = z.var(dim=(0, 2, 3))  # expect: AMP004
        var_reg = F.relu(0.05 - var).mean()  # expect: AMP004
        distances = self._l2_convolution(z)
        min_distances = -F.max_pool2d(-distances, kernel_size=distances.shape[-2:]).flatten(1)
        logits = self.last_layer(self.distance_2_similarity(min_distances))
        return logits, min_distances, var_reg


def proto_costs(model, min_distances, labels):
    """Multi-label cluster and separation costs (positive prototypes: any present finding)."""
    max_dist = model.prototype_shape[1] * model.prototype_shape[2] * model.prototype_shape[3]
    pos = (labels @ model.prototype_class_identity.t()).clamp(max=1)
    inverted = torch.max((max_dist - min_distances) * pos, dim=1).values
    cluster = torch.mean(max_dist - inverted)
    inverted_sep = torch.max((max_dist - min_distances) * (1 - pos), dim=1).values
    separation = torch.mean(max_dist - inverted_sep)
    return cluster, separation


def last_layer_l1(model):
    mask = 1 - model.prototype_class_identity.t()
    return (model.last_layer.weight * mask).norm(p=1)


@torch.no_grad()
def push_prototypes(model, loader, device):
    """Project every prototype onto the nearest latent patch of a training image."""
    model.eval()
    P, D = model.prototype_shape[:2]
    best = torch.full((P,), float("inf"), device=device)
    best_vec = torch.zeros(P, D, device=device)
    for images, labels in loader:
        z = model.add_on(model.backbone(images.to(device)))
        dist = model._l2_convolution(z)
        B, _, H, W = dist.shape
        flat = dist.permute(1, 0, 2, 3).reshape(P, -1)
        allowed = (labels.to(device) @ model.prototype_class_identity.t()).t() > 0
        flat = flat.masked_fill(~allowed.repeat_interleave(H * W, dim=1), float("inf"))
        d_min, idx = flat.min(dim=1)
        patches = z.permute(0, 2, 3, 1).reshape(-1, D)
        upd = d_min < best
        best = torch.where(upd, d_min, best)
        best_vec[upd] = patches[idx[upd]]
    model.prototype_vectors.data.copy_(best_vec.view(model.prototype_shape))
    model.train()


def export_onnx(model, path, size=448):
    m = copy.deepcopy(model).half().eval()
    dummy = torch.randn(1, 1, size, size, dtype=torch.float16, device=next(m.parameters()).device)
    torch.onnx.export(m, dummy, path, input_names=["image"], output_names=["logits", "min_distances", "var_reg"])


def train(args, train_set, push_set):
    device = torch.device("cuda")
    model = ProtoPNet(num_classes=args.num_classes, protos_per_class=args.ppc).to(device)
    criterion = nn.BCELoss()
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True)
    push_loader = DataLoader(push_set, batch_size=args.batch_size, num_workers=8)
    warm_opt = torch.optim.Adam([{"params": model.add_on.parameters(), "lr": 3e-3},
                                 {"params": [model.prototype_vectors], "lr": 3e-3}])
    joint_opt = torch.optim.Adam([{"params": model.backbone.parameters(), "lr": 1e-4, "weight_decay": 1e-3},
                                  {"params": model.add_on.parameters(), "lr": 3e-3, "weight_decay": 1e-3},
                                  {"params": [model.prototype_vectors], "lr": 3e-3}])
    scaler = torch.cuda.amp.GradScaler()  # expect: AMP009
    for epoch in range(args.epochs):
        warm = epoch < args.warm_epochs
        model.backbone.requires_grad_(not warm)
        opt = warm_opt if warm else joint_opt
        model.train()
        seen, running = 0, 0.0
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True).float()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, min_distances, var_reg = model(images)
                probs = torch.sigmoid(logits)
                bce = criterion(probs, labels)  # expect: AMP003
                cluster, separation = proto_costs(model, min_distances, labels)
                loss = bce + args.clst * cluster - args.sep * separation + args.var_weight * var_reg
                loss = loss + args.l1 * last_layer_l1(model)
            scaler.scale(loss).backward()
            if args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # expect: AMP005
            scaler.step(opt)
            scaler.update()
            seen += images.size(0)
            running += loss.item() * images.size(0)
        print(f"epoch {epoch} ({'warm' if warm else 'joint'}) loss {running / max(seen, 1):.4f}")
        if epoch >= args.push_start and (epoch - args.push_start) % args.push_every == 0:
            push_prototypes(model, push_loader, device)
            torch.save(model.state_dict(), os.path.join(args.out, f"protopnet_push_{epoch:03d}.pt"))
    export_onnx(model, os.path.join(args.out, "protopnet.onnx"))
    return model


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/protopnet")
    p.add_argument("--num-classes", type=int, default=14)
    p.add_argument("--ppc", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--warm-epochs", type=int, default=5)
    p.add_argument("--push-start", type=int, default=10)
    p.add_argument("--push-every", type=int, default=10)
    p.add_argument("--clst", type=float, default=0.8)
    p.add_argument("--sep", type=float, default=0.08)
    p.add_argument("--l1", type=float, default=1e-4)
    p.add_argument("--var-weight", type=float, default=1.0)
    p.add_argument("--max-grad-norm", type=float, default=5.0)
    args = p.parse_args()
    sets = torch.load(args.data)
    train(args, sets["train"], sets["push"])
