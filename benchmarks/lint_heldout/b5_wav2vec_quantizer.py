"""wav2vec 2.0-style contrastive pretraining with a Gumbel product quantizer, fp16 autocast and GradScaler."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class FeatureEncoder(nn.Module):
    def __init__(self, dim=512):
        super().__init__()
        spec = [(10, 5)] + [(3, 2)] * 4 + [(2, 2)] * 2
        layers, cin = [], 1
        for k, s in spec:
            layers += [nn.Conv1d(cin, dim, k, stride=s, bias=False), nn.GELU()]
            cin = dim
        self.conv = nn.Sequential(*layers)

    def forward(self, wav):
        return self.conv(wav.unsqueeze(1)).transpose(1, 2)


class GumbelQuantizer(nn.Module):
    def __init__(self, dim=512, groups=2, codes=320, out_dim=256):
        super().__init__()
        self.groups, self.codes = groups, codes
        self.logits = nn.Linear(dim, groups * codes)
        self.codevectors = nn.Parameter(torch.randn(1, groups * codes, out_dim // groups))
        self.tau = 2.0

    def forward(self, x):
        b, t, _ = x.shape
        logits = self.logits(x).view(b * t * self.groups, -1)
        soft = logits.float().softmax(dim=-1).view(b * t, self.groups, -1).mean(0)
        perplexity = torch.exp(-torch.sum(soft * torch.log(soft + 1e-7), dim=-1)).sum()
        hard = F.gumbel_softmax(logits.float(), tau=self.tau, hard=True)
        q = hard.view(b * t, -1, 1) * self.codevectors
        q = q.view(b * t, self.groups, self.codes, -1).sum(-2).view(b, t, -1)
        return q, perplexity


class Wav2Vec2(nn.Module):
    def __init__(self, dim=512, d_model=768, layers=12):
        super().__init__()
        self.features = FeatureEncoder(dim)
        self.post = nn.Linear(dim, d_model)
        self.mask_emb = nn.Parameter(torch.rand(d_model))
        layer = nn.TransformerEncoderLayer(d_model, 12, 3072, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.quantizer = GumbelQuantizer(dim)
        self.final = nn.Linear(d_model, 256)
        self.energy_proj = nn.Linear(dim, d_model)


def sample_negatives(y, n_neg=100):
    b, t, _ = y.shape
    idx = torch.randint(0, t - 1, (b, t * n_neg), device=y.device)
    idx = idx + (idx >= torch.arange(t, device=y.device).repeat_interleave(n_neg))
    negs = torch.gather(y, 1, idx.unsqueeze(-1).expand(-1, -1, y.size(-1)))
    return negs.view(b, t, n_neg, -1).permute(2, 0, 1, 3)


def train_step(model: Wav2Vec2, wav, mask, optimizer, scaler, temp=0.1, div_w=0.1, pen_w=10.0):
    with torch.autocast("cuda", dtype=torch.float16):
        feats = model.features(wav)
        log_energy = torch.log(feats.abs() + 1e-10)  # expect: AMP011
        feat_pen = feats.float().pow(2).mean()
        feat_var = feats.var(dim=-1).mean()  # expect: AMP004
        y, ppl = model.quantizer(feats)
        x = model.post(feats) + model.energy_proj(log_energy.detach())
        x[mask] = model.mask_emb.to(x.dtype)
        c = model.final(model.encoder(x))[mask].view(-1, 256)
        y = y[mask].view(-1, 256)
        negs = sample_negatives(y.unsqueeze(0)).squeeze(1)
        targets = torch.cat([y.unsqueeze(0), negs], dim=0)
        logits = torch.cosine_similarity(c.float().unsqueeze(0), targets.float(), dim=-1) / temp
        neg_is_pos = (y.unsqueeze(0) == negs).all(-1)
        logits[1:][neg_is_pos] = float("-inf")
        contrastive = F.cross_entropy(logits.t(), logits.new_zeros(logits.size(1), dtype=torch.long))
        diversity = (model.quantizer.groups * model.quantizer.codes - ppl) / (model.quantizer.groups * model.quantizer.codes)
        loss = contrastive + div_w * diversity + pen_w * feat_pen + 0.01 * feat_var
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    scaler.step(optimizer)
    scaler.update()
    model.quantizer.tau = max(0.5, model.quantizer.tau * 0.999995)
    return loss.detach()


def pretrain(loader, steps=400_000):
    model = Wav2Vec2().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-4, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.amp.GradScaler("cuda")
    for step, (wav, mask) in zip(range(steps), loader):
        loss = train_step(model, wav.cuda(), mask.cuda(), optimizer, scaler)
        if step % 500 == 0:
            print(step, loss.item(), scaler.get_scale())
    return model


def finetune_ctc(model: Wav2Vec2, loader, vocab=32, epochs=20):
    head = nn.Linear(768, vocab).cuda()
    model.half()  # expect: AMP001
    head.half()  # expect: AMP001
    params = list(model.encoder.parameters()) + list(model.post.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-5)  # expect: AMP011
    model.features.requires_grad_(False)
    for _ in range(epochs):
        for wav, targets, in_lens, tgt_lens in loader:
            h = model.encoder(model.post(model.features(wav.cuda().half())))  # expect: AMP001
            log_probs = head(h).float().log_softmax(-1).transpose(0, 1)
            loss = F.ctc_loss(log_probs, targets.cuda(), in_lens, tgt_lens, zero_infinity=True)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def extract_features(model, wav):
    model.eval()
    with torch.autocast("cuda", dtype=torch.float16):
        h = model.encoder(model.post(model.features(wav.cuda())))
    return h.float().mean(dim=1).cpu()
