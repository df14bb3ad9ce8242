# Joint CTC / attention ASR with a frame-level endpoint detector.
#
# Encoder: conv subsampling + transformer blocks (optionally chunk-restricted for streaming).
# Decoder: location-aware attention LSTM decoder (ESPnet "rnn" style).
import argparse
import logging
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from asr.data import build_dataloader, load_token_list
from asr.frontend import GlobalCMVN, spec_augment
from asr.utils import add_sos_eos, make_pad_mask, th_accuracy, save_checkpoint, edit_distance

IGNORE_ID = -1


class Conv2dSubsampling4(nn.Module):
    def __init__(self, idim, odim, dropout_rate):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, odim, 3, 2), nn.ReLU(),
            nn.Conv2d(odim, odim, 3, 2), nn.ReLU(),
        )
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, x, x_mask):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.dropout(self.out(x.transpose(1, 2).contiguous().view(b, t, c * f)))
        return x, x_mask[:, :, :-2:2][:, :, :-2:2]


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(self.dropout(attn), value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class ChunkedMultiHeadedAttention(MultiHeadedAttention):
    """Self-attention restricted to the current chunk and ``left_chunks`` chunks before it."""

    def __init__(self, n_head, n_feat, dropout_rate, chunk_size, left_chunks=-1):
        super().__init__(n_head, n_feat, dropout_rate)
        self.chunk_size = chunk_size
        self.left_chunks = left_chunks

    def chunk_mask(self, size, device):
        chunk_idx = torch.arange(size, device=device) // self.chunk_size
        visible = chunk_idx[None, :] <= chunk_idx[:, None]
        if self.left_chunks >= 0:
            visible &= chunk_idx[None, :] >= (chunk_idx[:, None] - self.left_chunks)
        return visible

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        visible = self.chunk_mask(scores.size(-1), scores.device)
        scores = scores.masked_fill(~visible, -1e5)  # expect: AMP007
        return self.forward_attention(v, scores, mask)


class EncoderLayer(nn.Module):
    def __init__(self, size, self_attn, ff_units, dropout_rate):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = nn.Sequential(
            nn.Linear(size, ff_units), nn.SiLU(), nn.Dropout(dropout_rate), nn.Linear(ff_units, size)
        )
        self.norm1 = nn.LayerNorm(size)
        self.norm2 = nn.LayerNorm(size)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, x, mask):
        y = self.norm1(x)
        x = x + self.dropout(self.self_attn(y, y, y, mask))
        x = x + self.dropout(self.feed_forward(self.norm2(x)))
        return x, mask


class TransformerEncoder(nn.Module):
    def __init__(self, idim, adim=256, heads=4, units=2048, blocks=12, dropout_rate=0.1, chunk_size=0):
        super().__init__()
        self.embed = Conv2dSubsampling4(idim, adim, dropout_rate)
        layers = []
        for _ in range(blocks):
            if chunk_size > 0:
                attn = ChunkedMultiHeadedAttention(heads, adim, dropout_rate, chunk_size, left_chunks=4)
            else:
                attn = MultiHeadedAttention(heads, adim, dropout_rate)
            layers.append(EncoderLayer(adim, attn, units, dropout_rate))
        self.encoders = nn.ModuleList(layers)
        self.after_norm = nn.LayerNorm(adim)

    def forward(self, xs, ilens):
        masks = (~make_pad_mask(ilens)[:, None, :]).to(xs.device)
        xs, masks = self.embed(xs, masks)
        for layer in self.encoders:
            xs, masks = layer(xs, masks)
        return self.after_norm(xs), masks.squeeze(1).sum(1), masks.squeeze(1)


class CTC(nn.Module):
    def __init__(self, odim, eprojs, dropout_rate=0.0):
        super().__init__()
        self.dropout_rate = dropout_rate
        self.ctc_lo = nn.Linear(eprojs, odim)
        self.ctc_loss = nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)

    def forward(self, hs_pad):
        return self.ctc_lo(F.dropout(hs_pad, p=self.dropout_rate, training=self.training))

    def get_loss(self, logits, hlens, ys_pad, ys_lens):
        # cudnn/native CTC wants fp32 log-probs, (T, B, V)
        log_probs = logits.float().log_softmax(2).transpose(0, 1)
        loss = self.ctc_loss(log_probs, ys_pad, hlens, ys_lens)
        return loss / logits.size(0)

    def log_softmax(self, hs_pad):
        return F.log_softmax(self.ctc_lo(hs_pad), dim=2)


class LocationAwareAttention(nn.Module):
    def __init__(self, eprojs, dunits, att_dim, aconv_chans=10, aconv_filts=100):
        super().__init__()
        self.mlp_enc = nn.Linear(eprojs, att_dim)
        self.mlp_dec = nn.Linear(dunits, att_dim, bias=False)
        self.mlp_att = nn.Linear(aconv_chans, att_dim, bias=False)
        self.loc_conv = nn.Conv2d(1, aconv_chans, (1, 2 * aconv_filts + 1), padding=(0, aconv_filts), bias=False)
        self.gvec = nn.Linear(att_dim, 1)
        self.pre_compute_enc_h = None

    def reset(self):
        self.pre_compute_enc_h = None

    def forward(self, enc_h, enc_mask, dec_z, att_prev, scaling=2.0):
        if self.pre_compute_enc_h is None:
            self.pre_compute_enc_h = self.mlp_enc(enc_h)
        att_conv = self.loc_conv(att_prev.view(att_prev.size(0), 1, 1, -1))
        att_conv = self.mlp_att(att_conv.squeeze(2).transpose(1, 2))
        dec_z_tiled = self.mlp_dec(dec_z).unsqueeze(1)
        e = self.gvec(torch.tanh(att_conv + self.pre_compute_enc_h + dec_z_tiled)).squeeze(2)
        e[~enc_mask] = -1e9  # expect: AMP007
        w = F.softmax(scaling * e, dim=1)
        c = torch.sum(enc_h * w.unsqueeze(-1), dim=1)
        return c, w


class LabelSmoothingLoss(nn.Module):
    def __init__(self, size, padding_idx, smoothing, normalize_length=False):
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="none")
        self.padding_idx = padding_idx
        self.confidence = 1.0 - smoothing
        self.smoothing = smoothing
        self.size = size
        self.normalize_length = normalize_length

    def forward(self, x, target):
        batch_size = x.size(0)
        x = x.view(-1, self.size)
        target = target.reshape(-1)
        with torch.no_grad():
            true_dist = torch.full_like(x, self.smoothing / (self.size - 1))
            ignore = target == self.padding_idx
            total = len(target) - ignore.sum().item()
            target = target.masked_fill(ignore, 0)
            true_dist.scatter_(1, target.unsqueeze(1), self.confidence)
        kl = self.criterion(torch.log_softmax(x, dim=1), true_dist)
        denom = total if self.normalize_length else batch_size
        return kl.masked_fill(ignore.unsqueeze(1), 0).sum() / denom


class AttentionDecoder(nn.Module):
    def __init__(self, odim, eprojs, dunits, att_dim, sos, eos, lsm_weight=0.1, dropout_rate=0.1):
        super().__init__()
        self.odim, self.dunits, self.sos, self.eos = odim, dunits, sos, eos
        self.embed = nn.Embedding(odim, dunits)
        self.decoder = nn.LSTMCell(dunits + eprojs, dunits)
        self.att = LocationAwareAttention(eprojs, dunits, att_dim)
        self.dropout = nn.Dropout(dropout_rate)
        self.output = nn.Linear(dunits + eprojs, odim)
        self.criterion = LabelSmoothingLoss(odim, IGNORE_ID, lsm_weight)

    def forward(self, hs_pad, hs_mask, ys_in_pad):
        batch = hs_pad.size(0)
        z = hs_pad.new_zeros(batch, self.dunits)
        c = hs_pad.new_zeros(batch, self.dunits)
        att_w = hs_mask.float() / hs_mask.sum(1, keepdim=True).float()
        self.att.reset()
        eys = self.dropout(self.embed(ys_in_pad))
        logits = []
        for i in range(ys_in_pad.size(1)):
            att_c, att_w = self.att(hs_pad, hs_mask, z, att_w)
            z, c = self.decoder(torch.cat([eys[:, i], att_c], dim=1), (z, c))
            logits.append(self.output(torch.cat([self.dropout(z), att_c], dim=1)))
        return torch.stack(logits, dim=1)

    def get_loss(self, logits, ys_out_pad):
        loss = self.criterion(logits, ys_out_pad)
        acc = th_accuracy(logits.reshape(-1, self.odim), ys_out_pad, ignore_label=IGNORE_ID)
        return loss, acc


class EndpointHead(nn.Module):
    """Predicts, per encoder frame, whether the utterance has ended."""

    def __init__(self, eprojs, hidden=256):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(eprojs, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.criterion = nn.BCELoss()

    def forward(self, hs_pad):
        return self.proj(hs_pad).squeeze(-1)

    def get_loss(self, logits, labels, mask):
        probs = torch.sigmoid(logits)
        return self.criterion(probs[mask], labels[mask].float())  # expect: AMP003


class ASRModel(nn.Module):
    def __init__(self, idim, odim, args):
        super().__init__()
        self.sos = self.eos = odim - 1
        self.suppress_ids = list(args.suppress_ids)
        self.encoder = TransformerEncoder(idim, args.adim, args.aheads, args.eunits, args.elayers,
                                          args.dropout_rate, chunk_size=args.chunk_size)
        self.ctc = CTC(odim, args.adim, args.dropout_rate)
        self.decoder = AttentionDecoder(odim, args.adim, args.dunits, args.att_dim, self.sos, self.eos,
                                        lsm_weight=args.lsm_weight)
        self.endpoint = EndpointHead(args.adim)

    def forward(self, xs_pad, ilens, ys_pad):
        hs, hlens, hmask = self.encoder(xs_pad, ilens)
        ys_in, ys_out = add_sos_eos(ys_pad, self.sos, self.eos, IGNORE_ID)
        return {
            "hlens": hlens,
            "hmask": hmask,
            "ys_out": ys_out,
            "ctc_logits": self.ctc(hs),
            "dec_logits": self.decoder(hs, hmask, ys_in),
            "ep_logits": self.endpoint(hs),
        }

    @torch.no_grad()
    def ctc_greedy_search(self, xs_pad, ilens):
        hs, hlens, hmask = self.encoder(xs_pad, ilens)
        logp = self.ctc.log_softmax(hs)
        if self.suppress_ids:
            logp[:, :, self.suppress_ids] = -1e10
        best = logp.argmax(-1).masked_fill(~hmask, 0)
        hyps = []
        for seq, n in zip(best, hlens):
            seq = torch.unique_consecutive(seq[:n])
            hyps.append([t for t in seq.tolist() if t != 0])
        return hyps


def train_epoch(model, cmvn, loader, optimizer, scheduler, scaler, args, epoch):
    model.train()
    for batch_idx, (xs, ilens, ys, ys_lens, ep_labels) in enumerate(loader):
        xs, ilens, ys, ys_lens, ep_labels = (t.cuda(non_blocking=True) for t in (xs, ilens, ys, ys_lens, ep_labels))
        xs = spec_augment(cmvn(xs), ilens)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(xs, ilens, ys)
            loss_ep = model.endpoint.get_loss(out["ep_logits"], ep_labels, out["hmask"])
        loss_ctc = model.ctc.get_loss(out["ctc_logits"], out["hlens"], ys, ys_lens)
        loss_att, acc = model.decoder.get_loss(out["dec_logits"], out["ys_out"])  # expect: AMP002
        loss = args.ctc_weight * loss_ctc + (1 - args.ctc_weight) * loss_att + args.ep_weight * loss_ep
        scaler.scale(loss / args.accum_grad).backward()

        if (batch_idx + 1) % args.accum_grad == 0:
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            if not torch.isfinite(grad_norm):
                logging.warning("grad norm is %s, the step will be skipped", grad_norm.item())
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if batch_idx % args.log_interval == 0:
            logging.info("ep %d it %d loss %.3f ctc %.3f att %.3f ep %.3f acc %.3f", epoch, batch_idx,
                         loss.item(), loss_ctc.item(), loss_att.item(), loss_ep.item(), acc)


@torch.no_grad()
def validate(model, cmvn, loader, token_list):
    model.eval()
    errs = words = 0
    ctc_total = 0.0
    for xs, ilens, ys, ys_lens, _ in loader:
        xs, ilens, ys, ys_lens = (t.cuda() for t in (xs, ilens, ys, ys_lens))
        xs = cmvn(xs)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(xs, ilens, ys)
            loss_att, _ = model.decoder.get_loss(out["dec_logits"], out["ys_out"])
            hyps = model.ctc_greedy_search(xs, ilens)
        ctc_total += model.ctc.get_loss(out["ctc_logits"], out["hlens"], ys, ys_lens).item()
        for hyp, ref, n in zip(hyps, ys, ys_lens):
            errs += edit_distance(hyp, ref[:n].tolist())
            words += int(n)
    return {"cer": errs / max(words, 1), "ctc_loss": ctc_total / len(loader)}


def get_parser():
    p = argparse.ArgumentParser(description="Train a joint CTC/attention model")
    p.add_argument("--train-json", required=True)
    p.add_argument("--valid-json", required=True)
    p.add_argument("--dict", required=True)
    p.add_argument("--cmvn", default=None)
    p.add_argument("--outdir", default="exp/ctc_att")
    p.add_argument("--adim", type=int, default=256)
    p.add_argument("--aheads", type=int, default=4)
    p.add_argument("--eunits", type=int, default=2048)
    p.add_argument("--elayers", type=int, default=12)
    p.add_argument("--dunits", type=int, default=320)
    p.add_argument("--att-dim", type=int, default=320)
    p.add_argument("--chunk-size", type=int, default=0)
    p.add_argument("--dropout-rate", type=float, default=0.1)
    p.add_argument("--lsm-weight", type=float, default=0.1)
    p.add_argument("--ctc-weight", type=float, default=0.3)
    p.add_argument("--ep-weight", type=float, default=0.1)
    p.add_argument("--suppress-ids", type=int, nargs="*", default=())
    p.add_argument("--accum-grad", type=int, default=4)
    p.add_argument("--grad-clip", type=float, default=5.0)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--log-interval", type=int, default=100)
    return p


def main():
    args = get_parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    token_list = load_token_list(args.dict)
    train_loader, idim = build_dataloader(args.train_json, train=True)
    valid_loader, _ = build_dataloader(args.valid_json, train=False)

    model = ASRModel(idim, len(token_list), args).cuda()
    cmvn = GlobalCMVN.from_stats(args.cmvn).cuda() if args.cmvn else nn.Identity()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) ** -0.5, (step + 1) * 25000 ** -1.5) * 25000 ** 0.5
    )
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 12)  # expect: AMP009

    best_cer = float("inf")
    for epoch in range(args.epochs):
        train_epoch(model, cmvn, train_loader, optimizer, scheduler, scaler, args, epoch)
        stats = validate(model, cmvn, valid_loader, token_list)
        logging.info("epoch %d: %s", epoch, stats)
        if stats["cer"] < best_cer:
            best_cer = stats["cer"]
            save_checkpoint(os.path.join(args.outdir, "model.acc.best"), model, optimizer, scaler, epoch)


if __name__ == "__main__":
    main()
