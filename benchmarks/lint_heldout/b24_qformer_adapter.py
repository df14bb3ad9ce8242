"""Q-Former style vision-language adapter (BLIP-2 stage 1 plus a gated LLM prefix):
learned queries cross-attend to frozen image features; ITC + ITM objectives."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiHeadAttention(nn.Module):
    def __init__(self, dim, heads, kv_dim=None, dropout=0.1):
        super().__init__()
        kv_dim = kv_dim or dim
        self.heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim**-0.5
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(kv_dim, dim)
        self.value = nn.Linear(kv_dim, dim)
        self.dropout = nn.Dropout(dropout)

    def _split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        q = self._split(self.query(x))
        k = self._split(self.key(context))
        v = self._split(self.value(context))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if mask is not None:
            keep = mask[:, None, None, :].bool()
            scores = torch.where(keep, scores, torch.tensor(-1e9, device=scores.device))  # expect: AMP007
        probs = self.dropout(scores.softmax(dim=-1))
        out = torch.matmul(probs, v).transpose(1, 2)
        return out.reshape(out.shape[0], out.shape[1], -1)


class AddNorm(nn.Module):
    def __init__(self, dim, dropout=0.1):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h, residual):
        return self.norm(self.dropout(self.dense(h)) + residual)


class QFormerLayer(nn.Module):
    def __init__(self, dim, heads, vision_dim, cross=True, mlp_ratio=4):
        super().__init__()
        self.self_attn = MultiHeadAttention(dim, heads)
        self.self_out = AddNorm(dim)
        self.cross_attn = MultiHeadAttention(dim, heads, kv_dim=vision_dim) if cross else None
        self.cross_out = AddNorm(dim) if cross else None
        self.ffn_q = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))
        self.ffn_t = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))
        self.norm_q = nn.LayerNorm(dim, eps=1e-12)
        self.norm_t = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, h, num_query, mask, image_embeds=None):
        h = self.self_out(self.self_attn(h, mask=mask), h)
        q, t = h[:, :num_query], h[:, num_query:]
        if num_query and self.cross_attn is not None and image_embeds is not None:
            q = self.cross_out(self.cross_attn(q, context=image_embeds), q)
        q = self.norm_q(q + self.ffn_q(q))
        if t.shape[1] > 0:
            t = self.norm_t(t + self.ffn_t(t))
        return torch.cat([q, t], dim=1)


class QFormer(nn.Module):
    def __init__(self, vocab=30523, dim=768, depth=12, heads=12, vision_dim=1408, num_query=32, max_len=64):
        super().__init__()
        self.query_tokens = nn.Parameter(torch.randn(1, num_query, dim) * 0.02)
        self.word_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(max_len, dim)
        self.emb_norm = nn.LayerNorm(dim, eps=1e-12)
        self.vision_norm = nn.LayerNorm(vision_dim)
        self.layers = nn.ModuleList(QFormerLayer(dim, heads, vision_dim, cross=(i % 2 == 0)) for i in range(depth))
        self.num_query = num_query

    def embed_text(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.emb_norm(self.word_emb(ids) + self.pos_emb(pos)[None])

    def forward(self, image_embeds=None, text_ids=None, text_mask=None):
        parts, masks, nq = [], [], 0
        if image_embeds is not None:
            b = image_embeds.shape[0]
            parts.append(self.query_tokens.expand(b, -1, -1))
            masks.append(torch.ones(b, self.num_query, dtype=torch.long, device=image_embeds.device))
            nq = self.num_query
            image_embeds = self.vision_norm(image_embeds)
        if text_ids is not None:
            parts.append(self.embed_text(text_ids))
            masks.append(text_mask)
        h = torch.cat(parts, dim=1)
        mask = torch.cat(masks, dim=1)
        for layer in self.layers:
            h = layer(h, nq, mask, image_embeds)
        return h


class GatedPrefixAdapter(nn.Module):
    """Projects query outputs to the LLM width; a per-query gate decides how much passes."""

    def __init__(self, dim, llm_dim):
        super().__init__()
        self.proj = nn.Linear(dim, llm_dim)
        self.gate = nn.Linear(dim, 1)

    def forward(self, q):
        prefix = self.proj(q)
        gate = torch.sigmoid(self.gate(q))
        ent = -(gate * torch.log(gate + 1e-10) + (1 - gate) * torch.log(1 - gate + 1e-10))  # expect: AMP011
        return prefix * gate, ent.mean()


class VisionLanguageAdapter(nn.Module):
    def __init__(self, dim=768, vision_dim=1408, embed_dim=256, llm_dim=2560, num_query=32):
        super().__init__()
        self.qformer = QFormer(dim=dim, vision_dim=vision_dim, num_query=num_query)
        self.vision_proj = nn.Linear(dim, embed_dim)
        self.text_proj = nn.Linear(dim, embed_dim)
        self.itm_head = nn.Linear(dim, 2)
        self.adapter = GatedPrefixAdapter(dim, llm_dim)
        self.temp = 0.07
        self.num_query = num_query

    def forward(self, image_embeds, text_ids, text_mask):
        b = image_embeds.shape[0]
        q_out = self.qformer(image_embeds=image_embeds)
        t_out = self.qformer(text_ids=text_ids, text_mask=text_mask)
        image_feats = F.normalize(self.vision_proj(q_out), dim=-1)
        text_feat = F.normalize(self.text_proj(t_out[:, 0]), dim=-1)

        # image-text contrastive: average the similarity over the query tokens
        sim_q2t = torch.matmul(image_feats.unsqueeze(1), text_feat.unsqueeze(-1)).squeeze(-1)
        sim_i2t = sim_q2t.mean(-1) / self.temp  # expect: AMP004
        sim_t2i = sim_i2t.t()
        targets = torch.arange(b, device=image_embeds.device)
        loss_itc = (
            F.cross_entropy(sim_i2t, targets, label_smoothing=0.1)
            + F.cross_entropy(sim_t2i, targets, label_smoothing=0.1)
        ) / 2

        # image-text matching with hard negatives mined from the contrastive similarities
        with torch.no_grad():
            w_t2i = F.softmax(sim_t2i, dim=1) + 1e-4
            w_t2i.fill_diagonal_(0)
            w_i2t = F.softmax(sim_i2t, dim=1) + 1e-4
            w_i2t.fill_diagonal_(0)
            neg_img = torch.multinomial(w_t2i, 1).squeeze(1)
            neg_txt = torch.multinomial(w_i2t, 1).squeeze(1)
        ids = torch.cat([text_ids, text_ids[neg_txt], text_ids], dim=0)
        msk = torch.cat([text_mask, text_mask[neg_txt], text_mask], dim=0)
        img = torch.cat([image_embeds, image_embeds, image_embeds[neg_img]], dim=0)
        vl = self.qformer(image_embeds=img, text_ids=ids, text_mask=msk)
        itm_logits = self.itm_head(vl[:, : self.num_query]).mean(dim=1)  # expect: AMP004
        itm_labels = torch.cat([torch.ones(b, dtype=torch.long), torch.zeros(2 * b, dtype=torch.long)])
        loss_itm = F.cross_entropy(itm_logits, itm_labels.to(image_embeds.device))

        prefix, gate_entropy = self.adapter(q_out)
        return {"itc": loss_itc, "itm": loss_itm, "gate_entropy": gate_entropy, "prefix": prefix}


def build_frozen_vit(name="vit_giant_patch14_clip_224"):
    import timm

    return timm.create_model(name, pretrained=True, num_classes=0)


@torch.no_grad()
def encode_images(vit, images):
    return vit.forward_features(images.half())


def train_stage1(loader, epochs=10, lr=1e-4, device="cuda", log_every=100):
    vit = build_frozen_vit().to(device).half().eval()
    vit.requires_grad_(False)
    model = VisionLanguageAdapter().to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cuda")
    step = 0
    for epoch in range(epochs):
        model.train()
        for images, text_ids, text_mask in loader:
            image_embeds = encode_images(vit, images.to(device, non_blocking=True))
            with torch.autocast("cuda", dtype=torch.float16):
                losses = model(image_embeds, text_ids.to(device), text_mask.to(device))
                loss = losses["itc"] + losses["itm"] + 0.01 * losses["gate_entropy"]
            loss = scaler.scale(loss)
            loss.backward()
            optimizer.step()  # expect: AMP006
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % log_every == 0:
                print(f"epoch {epoch} step {step}: itc {losses['itc'].item():.3f} itm {losses['itm'].item():.3f}")
        torch.save(model.state_dict(), f"qformer_stage1_ep{epoch}.pt")
    return model
