"""TabNet for tabular data: ghost batch norm, GLU feature transformers, sparsemax
attentive transformers, self-supervised pretraining and bf16 CPU training."""
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn


def sparsemax(z, dim=-1):
    z = z - z.max(dim=dim, keepdim=True).values
    z_sorted, _ = torch.sort(z, dim=dim, descending=True)
    k = torch.arange(1, z.size(dim) + 1, device=z.device, dtype=z.dtype)
    z_cumsum = z_sorted.cumsum(dim) - 1
    support = k * z_sorted > z_cumsum
    k_z = support.sum(dim=dim, keepdim=True)
    tau = z_cumsum.gather(dim, k_z - 1) / k_z.to(z.dtype)
    return torch.clamp(z - tau, min=0)


class GhostBatchNorm(nn.Module):
    """Batch norm over virtual batches, written out so it can be scripted and exported."""

    def __init__(self, dim, virtual_batch_size=128, momentum=0.02, eps=1e-5):
        super().__init__()
        self.vbs = virtual_batch_size
        self.momentum = momentum
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))

    def forward(self, x):
        if not self.training:
            x = (x - self.running_mean) / torch.sqrt(self.running_var + self.eps)
            return x * self.weight + self.bias
        n_chunks = max(1, x.size(0) // self.vbs)
        xv = x.reshape(n_chunks, -1, x.size(-1))
        mu = xv.sum(dim=1, keepdim=True) / xv.size(1)  # expect: AMP004
        var = ((xv - mu) ** 2).mean(dim=1, keepdim=True)  # expect: AMP004
        with torch.no_grad():
            self.running_mean.lerp_(mu.detach().float().mean(dim=(0, 1)), self.momentum)
            self.running_var.lerp_(var.detach().float().mean(dim=(0, 1)), self.momentum)
        out = (xv - mu) / torch.sqrt(var + self.eps)
        return out.reshape_as(x) * self.weight + self.bias


class GLULayer(nn.Module):
    def __init__(self, in_dim, out_dim, virtual_batch_size=128):
        super().__init__()
        self.out_dim = out_dim
        self.fc = nn.Linear(in_dim, 2 * out_dim, bias=False)
        self.bn = GhostBatchNorm(2 * out_dim, virtual_batch_size)

    def forward(self, x):
        x = self.bn(self.fc(x))
        return x[:, : self.out_dim] * torch.sigmoid(x[:, self.out_dim:])


class FeatBlock(nn.Module):
    def __init__(self, in_dim, out_dim, n_layers, virtual_batch_size=128):
        super().__init__()
        dims = [in_dim] + [out_dim] * n_layers
        self.layers = nn.ModuleList([GLULayer(dims[i], out_dim, virtual_batch_size) for i in range(n_layers)])
        self.residual_first = in_dim == out_dim

    def forward(self, x):
        scale = math.sqrt(0.5)
        for i, layer in enumerate(self.layers):
            if i == 0 and not self.residual_first:
                x = layer(x)
            else:
                x = (x + layer(x)) * scale
        return x


class FeatTransformer(nn.Module):
    def __init__(self, shared, in_dim, out_dim, n_independent=2, virtual_batch_size=128):
        super().__init__()
        self.shared = shared
        self.specific = FeatBlock(out_dim, out_dim, n_independent, virtual_batch_size)

    def forward(self, x):
        return self.specific(self.shared(x))


class AttentiveTransformer(nn.Module):
    def __init__(self, n_a, input_dim, virtual_batch_size=128):
        super().__init__()
        self.fc = nn.Linear(n_a, input_dim, bias=False)
        self.bn = GhostBatchNorm(input_dim, virtual_batch_size)

    def forward(self, priors, processed_feat):
        x = self.bn(self.fc(processed_feat))
        return sparsemax(x * priors, dim=-1)


class TabNetEncoder(nn.Module):
    def __init__(self, input_dim, n_d=16, n_a=16, n_steps=4, gamma=1.3, n_shared=2, vbs=128):
        super().__init__()
        self.n_d, self.n_steps, self.gamma = n_d, n_steps, gamma
        self.initial_bn = nn.BatchNorm1d(input_dim, momentum=0.01)
        shared = FeatBlock(input_dim, n_d + n_a, n_shared, vbs)
        self.initial_splitter = FeatTransformer(shared, input_dim, n_d + n_a, 2, vbs)
        self.feat_transformers = nn.ModuleList(
            [FeatTransformer(shared, input_dim, n_d + n_a, 2, vbs) for _ in range(n_steps)])
        self.att_transformers = nn.ModuleList([AttentiveTransformer(n_a, input_dim, vbs) for _ in range(n_steps)])

    def forward(self, x):
        x = self.initial_bn(x)
        prior = torch.ones(x.shape, device=x.device)
        m_loss = 0.0
        att = self.initial_splitter(x)[:, self.n_d:]
        steps_out = []
        for step in range(self.n_steps):
            mask = self.att_transformers[step](prior, att)
            m_loss = m_loss + torch.mean(torch.sum(mask * torch.log(mask + 1e-15), dim=1))
            prior = (self.gamma - mask) * prior
            out = self.feat_transformers[step](mask * x)
            steps_out.append(F.relu(out[:, : self.n_d]))
            att = out[:, self.n_d:]
        return steps_out, m_loss / self.n_steps


class TabNetClassifier(nn.Module):
    def __init__(self, input_dim, n_classes, n_d=16, **kw):
        super().__init__()
        self.encoder = TabNetEncoder(input_dim, n_d=n_d, **kw)
        self.final_mapping = nn.Linear(n_d, n_classes, bias=False)

    def forward(self, x):
        steps_out, m_loss = self.encoder(x)
        res = torch.sum(torch.stack(steps_out, dim=0), dim=0)
        return self.final_mapping(res), m_loss


class TabNetPretrainer(nn.Module):
    def __init__(self, input_dim, n_d=16, n_steps=4, **kw):
        super().__init__()
        self.encoder = TabNetEncoder(input_dim, n_d=n_d, n_steps=n_steps, **kw)
        self.decoder_blocks = nn.ModuleList([FeatBlock(n_d, n_d, 2) for _ in range(n_steps)])
        self.reconstruction = nn.Linear(n_d, input_dim, bias=False)

    def forward(self, x):
        steps_out, _ = self.encoder(x)
        res = 0
        for block, step_out in zip(self.decoder_blocks, steps_out):
            res = res + block(step_out)
        return self.reconstruction(res)


def unsupervised_loss(y_pred, embedded_x, obf_vars, eps=1e-9):
    errors = y_pred - embedded_x
    reconstruction_errors = torch.mul(errors, obf_vars) ** 2
    batch_means = torch.mean(embedded_x, dim=0)
    batch_means[batch_means == 0] = 1
    batch_stds = torch.std(embedded_x, dim=0) ** 2
    batch_stds[batch_stds == 0] = batch_means[batch_stds == 0]
    features_loss = torch.matmul(reconstruction_errors, 1 / batch_stds)
    features_loss = features_loss / (torch.sum(obf_vars, dim=1) + eps)
    return torch.mean(features_loss)


def label_smoothing_loss(logits, target, smoothing=0.1):
    logp = F.log_softmax(logits, dim=-1)
    nll = -logp.gather(1, target.unsqueeze(1)).squeeze(1)
    smooth = -logp.mean(dim=-1)  # expect: AMP004
    return ((1.0 - smoothing) * nll + smoothing * smooth).mean()  # expect: AMP004


def pretrain(model, loader, epochs, lr=2e-2, pretraining_ratio=0.2):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(epochs):
        model.train()
        total = 0.0
        for x in loader:
            obf = torch.bernoulli(torch.full(x.shape, pretraining_ratio))
            with torch.cpu.amp.autocast(dtype=torch.bfloat16):  # expect: AMP009
                recon = model(x * (1 - obf))
                loss = unsupervised_loss(recon, x, obf)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item()
        print(f"pretrain epoch {epoch}: {total / max(len(loader), 1):.4f}")


def train_supervised(model, loader, epochs, n_classes, lr=2e-2, lambda_sparse=1e-3, clip=2.0):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    criterion = nn.BCELoss()
    for epoch in range(epochs):
        model.train()
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits, m_loss = model(x)
                if n_classes == 1:
                    loss = criterion(torch.sigmoid(logits).squeeze(-1), y.float())  # expect: AMP003
                else:
                    loss = label_smoothing_loss(logits, y, smoothing=0.1)
                loss = loss - lambda_sparse * m_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
        scheduler.step()


@torch.inference_mode()
def predict_proba(model, x):
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(x)
    return torch.softmax(logits.float(), dim=-1)


def export_bf16_checkpoint(model, path):
    compact = copy.deepcopy(model).bfloat16()
    torch.save(compact.state_dict(), path)


def transfer_encoder(pretrainer, classifier):
    classifier.encoder.load_state_dict(pretrainer.encoder.state_dict())
    return classifier


def main(unlabeled_loader, labeled_loader, input_dim, n_classes):
    pretrainer = TabNetPretrainer(input_dim)
    pretrain(pretrainer, unlabeled_loader, epochs=20)
    model = transfer_encoder(pretrainer, TabNetClassifier(input_dim, n_classes))
    train_supervised(model, labeled_loader, epochs=100, n_classes=n_classes)
    export_bf16_checkpoint(model, "tabnet_bf16.pt")
    return model
