"""Log-mel feature extraction, fp16 on-disk cache and data loading for the ASR recipes.

Features are computed in fp32 (torchaudio), stored as float16 shards to halve the
disk/page-cache footprint, and converted back to fp32 in the collate function, so
the model always receives fp32 input. Per-shard CMVN statistics are written next
to each shard and merged by ``merge_cmvn``.
"""
import json
import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torchaudio
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Sampler

logger = logging.getLogger(__name__)


@dataclass
class FeatureConfig:
    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 80
    log_floor: float = 1e-10
    shard_size: int = 2000


class LogMelExtractor:
    def __init__(self, cfg: FeatureConfig):
        self.cfg = cfg
        self.melspec = torchaudio.transforms.MelSpectrogram(
            sample_rate=cfg.sample_rate, n_fft=cfg.n_fft, hop_length=cfg.hop_length,
            n_mels=cfg.n_mels, power=2.0,
        )

    def __call__(self, wav: torch.Tensor, sr: int) -> torch.Tensor:
        if sr != self.cfg.sample_rate:
            wav = torchaudio.functional.resample(wav, sr, self.cfg.sample_rate)
        wav = wav.mean(dim=0) if wav.dim() == 2 else wav
        wav = wav / (wav.abs().max() + 1e-8)
        mel = self.melspec(wav)                                   # (n_mels, T), fp32
        return torch.log(mel + self.cfg.log_floor).transpose(0, 1)  # (T, n_mels)


def write_shard(utts: Sequence[Tuple[str, str]], extractor: LogMelExtractor, out_path: Path) -> Dict:
    """Extract features for ``utts`` (id, wav path), write one fp16 .pt shard and its stats."""
    feats, index, offset = [], {}, 0
    for utt_id, wav_path in utts:
        wav, sr = torchaudio.load(wav_path)
        f = extractor(wav, sr)
        index[utt_id] = (offset, f.shape[0])
        offset += f.shape[0]
        feats.append(f)
    stacked = torch.cat(feats, dim=0).to(torch.float16)
    stats = {
        "frames": stacked.shape[0],
        "sum": stacked.sum(dim=0, dtype=torch.float64).tolist(),
        "sumsq": stacked.double().pow(2).sum(dim=0).tolist(),
        "mean": stacked.mean(dim=0).tolist(),  # expect: AMP004
    }
    torch.save({"feats": stacked, "index": index}, out_path)
    with open(out_path.with_suffix(".stats.json"), "w") as f:
        json.dump(stats, f)
    return stats


def write_shard_numpy(utts, extractor: LogMelExtractor, out_dir: Path):
    """Memmap variant used on the shared filesystem (one .npy per shard)."""
    arrays = [extractor(*torchaudio.load(p)).numpy() for _, p in utts]
    lengths = np.asarray([a.shape[0] for a in arrays], dtype=np.int64)
    data = np.concatenate(arrays, axis=0).astype(np.float16)
    np.save(out_dir / "feats.npy", data)
    np.save(out_dir / "lengths.npy", lengths)
    return float(data.astype(np.float32).mean())


def merge_cmvn(stats_files: Sequence[Path]) -> Tuple[torch.Tensor, torch.Tensor]:
    total = None
    total_sq = None
    frames = 0
    for p in stats_files:
        with open(p) as f:
            s = json.load(f)
        s_sum = torch.tensor(s["sum"], dtype=torch.float64)
        s_sq = torch.tensor(s["sumsq"], dtype=torch.float64)
        total = s_sum if total is None else total + s_sum
        total_sq = s_sq if total_sq is None else total_sq + s_sq
        frames += s["frames"]
    mean = total / frames
    var = (total_sq / frames - mean.pow(2)).clamp(min=1e-10)
    return mean.float(), var.sqrt().float()


class ShardDataset(Dataset):
    def __init__(self, shard_paths: Sequence[Path], cmvn: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                 transcripts: Optional[Dict[str, List[int]]] = None, spec_augment: bool = False):
        self.items = []
        self.shards = {}
        for p in shard_paths:
            shard = torch.load(p, map_location="cpu")
            self.shards[str(p)] = shard["feats"]
            for utt_id, (off, n) in shard["index"].items():
                self.items.append((str(p), utt_id, off, n))
        self.cmvn = cmvn
        self.transcripts = transcripts or {}
        self.spec_augment = spec_augment

    def __len__(self):
        return len(self.items)

    def _spec_augment(self, x: torch.Tensor) -> torch.Tensor:
        T, F_ = x.shape
        for _ in range(2):
            f = random.randint(0, 27)
            f0 = random.randint(0, max(0, F_ - f))
            x[:, f0:f0 + f] = 0.0
        for _ in range(2):
            t = random.randint(0, min(40, T // 5))
            t0 = random.randint(0, max(0, T - t))
            x[t0:t0 + t, :] = 0.0
        return x

    def __getitem__(self, idx):
        path, utt_id, off, n = self.items[idx]
        x = self.shards[path][off:off + n].float()
        if self.cmvn is not None:
            mean, std = self.cmvn
            x = (x - mean) / (std + 1e-8)
        if self.spec_augment:
            x = self._spec_augment(x.clone())
        y = torch.tensor(self.transcripts.get(utt_id, []), dtype=torch.long)
        return x, y


class MagnitudeCacheDataset(Dataset):
    """Linear-magnitude spectrogram cache (enhancement/vocoder recipes).

    Stored as fp16 .npy memmaps; the log compression happens at load time so the
    same cache serves models trained on linear and on log magnitudes.
    """

    def __init__(self, root: Path, log_compress: bool = True):
        self.data = np.load(root / "mags.npy", mmap_mode="r")
        self.lengths = np.load(root / "lengths.npy")
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        self.log_compress = log_compress

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, idx):
        off, n = int(self.offsets[idx]), int(self.lengths[idx])
        mag = torch.from_numpy(np.array(self.data[off:off + n])).half()
        if self.log_compress:
            mag = torch.log(mag + 1e-10)  # expect: AMP011
        return mag.float()


def collate_padded(batch: List[Tuple[torch.Tensor, torch.Tensor]]):
    feats, targets = zip(*batch)
    feat_lens = torch.tensor([f.shape[0] for f in feats], dtype=torch.long)
    target_lens = torch.tensor([t.shape[0] for t in targets], dtype=torch.long)
    x = pad_sequence([f.float() for f in feats], batch_first=True, padding_value=0.0)
    y = pad_sequence(list(targets), batch_first=True, padding_value=-1)
    mask = torch.arange(x.shape[1])[None, :] < feat_lens[:, None]
    return {"feats": x, "feat_lens": feat_lens, "targets": y, "target_lens": target_lens, "mask": mask}


class BucketBatchSampler(Sampler):
    """Groups utterances of similar length to limit padding."""

    def __init__(self, lengths: Sequence[int], max_frames: int = 20000, shuffle: bool = True, seed: int = 0):
        self.lengths = list(lengths)
        self.max_frames = max_frames
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self) -> Iterator[List[int]]:
        order = sorted(range(len(self.lengths)), key=lambda i: self.lengths[i])
        batches, cur, longest = [], [], 0
        for i in order:
            longest = max(longest, self.lengths[i])
            if cur and longest * (len(cur) + 1) > self.max_frames:
                batches.append(cur)
                cur, longest = [], self.lengths[i]
            cur.append(i)
        if cur:
            batches.append(cur)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(batches)
        return iter(batches)

    def __len__(self):
        return math.ceil(sum(self.lengths) / self.max_frames)


def build_dataloader(shard_dir: Path, split: str, cmvn_path: Optional[Path] = None,
                     transcripts=None, max_frames: int = 20000, num_workers: int = 4) -> DataLoader:
    shard_paths = sorted(Path(shard_dir, split).glob("*.pt"))
    cmvn = None
    if cmvn_path is not None and cmvn_path.exists():
        blob = torch.load(cmvn_path)
        cmvn = (blob["mean"].float(), blob["std"].float())
    ds = ShardDataset(shard_paths, cmvn=cmvn, transcripts=transcripts, spec_augment=(split == "train"))
    lengths = [n for _, _, _, n in ds.items]
    sampler = BucketBatchSampler(lengths, max_frames=max_frames, shuffle=(split == "train"))
    return DataLoader(ds, batch_sampler=sampler, collate_fn=collate_padded,
                      num_workers=num_workers, pin_memory=True, persistent_workers=num_workers > 0)


def export_cache_fp16(src: Path, dst: Path):
    """Re-encode an old fp32 shard as fp16 (one-off migration)."""
    blob = torch.load(src, map_location="cpu")
    blob["feats"] = blob["feats"].half()
    torch.save(blob, dst)
    logger.info("%s -> %s (%.1f MB)", src, dst, os.path.getsize(dst) / 2**20)
