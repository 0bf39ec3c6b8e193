"""PyTorch ``DataLoader`` fallback with the DALI loader's contract.

Yields ``(images float32 (B, 3, S, S), tokens int64 (B, 3 x ctx_len))`` from
``.rec``/``.idx`` and WebDataset shards with a ``tok`` component. Sharding, full batches, per-sample seeded
augmentation and ``skip_corrupt`` counting are described in docs/data.md.
"""

from __future__ import annotations

import math
import os
import random
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..errors import DataError
from .decoding import decode_image, undecodable
from .recordio import RecordIOReader, unpack
from .tokens import CONTEXT_LENGTH, normalize_labels

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_SKIP_TRIES = 64


# ----------------------------------------------------------------------------- sources

class RecSource:
    """Random access to (image bytes, tokens) of a ``.rec`` (optionally a subset of keys)."""

    def __init__(self, prefix: str, entries=None, ctx_len: int = CONTEXT_LENGTH):
        self.ctx_len = int(ctx_len)  # tokens per caption handed on (stored 77 are fitted)
        self.reader = RecordIOReader(prefix, check_index=entries is None)
        self.entries = list(entries) if entries is not None else list(self.reader.index)
        if not self.entries:
            raise DataError("no records to read", self.reader.rec_path)

    def __len__(self):
        return len(self.entries)

    def name(self, i):
        return self.reader.rec_path, self.entries[i][0]

    def get(self, i):
        key, off = self.entries[i]
        payload = self.reader.read_at(off, key)
        _, labels, image = unpack(payload, self.reader.rec_path, key)
        if labels is None:
            raise DataError("record has no label vector (flag 0)", self.reader.rec_path, key)
        return image, normalize_labels(labels, self.reader.rec_path, key, self.ctx_len)


class WdsSource:
    """Random access to samples of indexed WebDataset shards."""

    def __init__(self, index, ctx_len: int = CONTEXT_LENGTH):
        self.ctx_len = int(ctx_len)
        self.samples = index.samples
        if not self.samples:
            raise DataError("no samples to read", ", ".join(index.shards[:3]))
        self._fhs: dict = {}
        self._pid: int | None = None

    def __getstate__(self):
        st = self.__dict__.copy()
        st["_fhs"], st["_pid"] = {}, None
        return st

    def __len__(self):
        return len(self.samples)

    def name(self, i):
        s = self.samples[i]
        return s.shard, s.key

    def _read(self, path, off, size):
        if self._pid != os.getpid():
            self._fhs, self._pid = {}, os.getpid()
        f = self._fhs.get(path)
        if f is None:
            try:
                f = self._fhs[path] = open(path, "rb")
            except OSError as e:
                raise DataError(f"cannot open shard ({e.strerror})", path) from None
        f.seek(off)
        data = f.read(size)
        return data

    def get(self, i):
        s = self.samples[i]
        img = self._read(s.shard, s.image[0], s.image[1])
        tok = self._read(s.shard, s.tok[0], s.tok[1])
        if len(img) != s.image[1] or len(tok) != s.tok[1]:
            raise DataError("truncated sample", s.shard, s.key)
        toks = np.frombuffer(tok, dtype="<i4")
        return img, normalize_labels(toks, s.shard, s.key, self.ctx_len)


# ----------------------------------------------------------------------------- transforms

def random_resized_crop_params(w: int, h: int, rng: random.Random, scale=(0.7, 1.0),
                               ratio=(0.8, 1.25), attempts: int = 100):
    area = w * h
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(attempts):
        target = area * rng.uniform(*scale)
        ar = math.exp(rng.uniform(*log_r))
        cw = int(round(math.sqrt(target * ar)))
        ch = int(round(math.sqrt(target / ar)))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, w - cw), rng.randint(0, h - ch), cw, ch
    # fallback: centre crop with the ratio clamped into range
    in_r = w / h
    if in_r < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_r > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return (w - cw) // 2, (h - ch) // 2, cw, ch


def _to_tensor(im: Image.Image, mean, std) -> torch.Tensor:
    arr = np.asarray(im, dtype=np.float32)  # H W 3
    t = torch.from_numpy(arr).permute(2, 0, 1)
    m = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1) * 255.0
    s = torch.tensor(std, dtype=torch.float32).view(3, 1, 1) * 255.0
    return (t - m) / s


def train_transform(im: Image.Image, size: int, rng: random.Random) -> torch.Tensor:
    x, y, cw, ch = random_resized_crop_params(im.width, im.height, rng)
    im = im.resize((size, size), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return _to_tensor(im, CLIP_MEAN, CLIP_STD)


def eval_transform(im: Image.Image, size: int) -> torch.Tensor:
    short = int(256 / 224 * size)
    w, h = im.size
    if w <= h:
        nw, nh = short, max(1, int(round(h * short / w)))
    else:
        nh, nw = short, max(1, int(round(w * short / h)))
    im = im.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    im = im.crop((left, top, left + size, top + size))
    return _to_tensor(im, CLIP_MEAN, CLIP_STD)


def image_tensor(data: bytes, size: int, train: bool, draw: tuple, where: tuple) -> torch.Tensor:
    """Decode and transform one image; the train augmentation draws come from a
    ``random.Random`` seeded by ``draw`` (e.g. (seed, rank, epoch, index)), so they do
    not depend on which worker runs it. ``where`` = (file, record) for the error."""
    try:
        im = decode_image(data, 2 * size)
    except Exception as e:  # PIL/OSError/... while decoding
        raise DataError(undecodable(e), *where) from None
    if train:
        return train_transform(im, size, random.Random(hash(draw) & 0xFFFFFFFF))
    return eval_transform(im, size)


class TokenArraySource:
    """A source whose caption tokens come from a :class:`~.tokens.CaptionTokens` array,
    row ``ids[i]`` for sample ``i`` (merged over the sample's own tokens)."""

    def __init__(self, source, tokens, ids):
        self.source, self.tokens, self.ids = source, tokens, list(ids)

    def __len__(self):
        return len(self.source)

    def name(self, i):
        return self.source.name(i)

    def get(self, i):
        data, own = self.source.get(i)
        return data, self.tokens.tokens(self.ids[i], own)


# ----------------------------------------------------------------------------- dataset

class ImageTextDataset(torch.utils.data.Dataset):
    def __init__(self, source, size: int, train: bool, seed: int = 0, rank: int = 0,
                 skip_corrupt: bool = False):
        self.source, self.size, self.train = source, int(size), train
        self.seed, self.rank, self.skip_corrupt = seed, rank, skip_corrupt
        self.epoch = 0

    def __len__(self):
        return len(self.source)

    def _load(self, i):
        data, tokens = self.source.get(i)
        img = image_tensor(data, self.size, self.train, (self.seed, self.rank, self.epoch, i),
                           self.source.name(i))
        return img, torch.from_numpy(tokens)

    def __getitem__(self, item):
        # the sampler sends (index, epoch) so persistent workers see the current epoch
        i, self.epoch = item if isinstance(item, tuple) else (item, self.epoch)
        failed: list[int] = []  # the bad records tried in place of sample i
        n = len(self.source)
        j = i
        while True:
            try:
                img, tok = self._load(j)
                return img, tok, failed
            except DataError as e:
                if not self.skip_corrupt or len(failed) >= min(MAX_SKIP_TRIES, n - 1):
                    # returned, not raised: raised in a worker it would reach the user as
                    # a worker traceback; the main process raises it (TorchLoader.__iter__)
                    return FailedSample(e)
                failed.append(j)
                j = (j + 1) % n


class FailedSample:
    """A sample that could not be loaded: its DataError, carried to the main process."""

    def __init__(self, error: DataError):
        self.error = error


def _collate(batch):
    failed = [b for b in batch if isinstance(b, FailedSample)]
    if failed:
        return failed[0]
    imgs = torch.stack([b[0] for b in batch])
    toks = torch.stack([b[1] for b in batch]).to(torch.int64)
    return imgs, toks, [j for b in batch for j in b[2]]


def stop_workers(loader: torch.utils.data.DataLoader) -> None:
    """Shut ``loader``'s worker processes down before an error leaves it, so none is left
    starting up against a main process that is exiting (their noise buried the error)."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    loader._iterator = None


class ShardSampler(torch.utils.data.Sampler):
    """Per-rank index stream (see module docstring)."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, train: bool,
                 seed: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.n, self.bs, self.rank, self.world = n, batch_size, rank, world_size
        self.train, self.seed, self.epoch = train, seed, 0
        max_shard = -(-n // world_size)
        if self.train:
            self.num_batches = -(-max_shard // batch_size)
        else:
            lo, hi = self._bounds()
            self.num_batches = -(-(hi - lo) // batch_size)

    def _bounds(self):
        return self.n * self.rank // self.world, self.n * (self.rank + 1) // self.world

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def indices(self) -> list[int]:
        lo, hi = self._bounds()
        if not self.train:
            return list(range(lo, hi))
        g = torch.Generator()
        g.manual_seed(self.seed * 1000003 + self.epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        mine = perm[lo:hi]
        need = self.num_batches * self.bs
        if not mine:  # more ranks than samples: borrow from the whole permutation
            mine = perm
        out = list(mine)
        while len(out) < need:
            out.extend(mine[: need - len(out)])
        return out

    def __iter__(self):
        return iter([(i, self.epoch) for i in self.indices()])

    def __len__(self):
        return self.num_batches * self.bs if self.train else len(self.indices())


def private_generator(seed: int) -> torch.Generator:
    """The DataLoader's own generator. Without one, every new DataLoader iterator draws its
    worker base seed from the global torch RNG - once per epoch, or, with persistent
    workers, only in the first - so a resumed run (whose first iterator comes after the
    restored RNG state) drew one number more than the uninterrupted run and its dropout
    diverged. The augmentation does not use worker seeds (see ImageTextDataset)."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


IN_PROCESS_EVAL_PAIRS = 2048  # evaluation sets smaller than this load without workers


class TorchLoader:
    """Iterable over (images, tokens) batches with ``len()`` and ``reset()``."""

    def __init__(self, source, batch_size: int, input_size: int, workers: int = 0,
                 train: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 skip_corrupt: bool = False, log=None):
        self.dataset = ImageTextDataset(source, input_size, train, seed, rank, skip_corrupt)
        self.sampler = ShardSampler(len(source), batch_size, rank, world_size, train, seed)
        self.batch_size = batch_size
        self.num_samples = len(source)  # usable pairs over all ranks
        self.workers = max(0, int(workers))
        if not train and self.num_samples < IN_PROCESS_EVAL_PAIRS:
            # a short in-order pass: decoding it here costs less than starting worker
            # processes, each of which imports torch; nothing random depends on workers
            self.workers = 0
        self.epoch = 0
        self.skipped = 0
        self.skipped_epoch = 0
        self.log = log
        # Workers come from a forkserver, not fork(): forking a process that already runs
        # DALI / OpenMP threads can deadlock the child. They persist across epochs (the
        # epoch travels with each index), so the start-up cost is paid once.
        mp: dict[str, Any] = dict(multiprocessing_context="forkserver", persistent_workers=True,
                  prefetch_factor=4) if self.workers else {}
        self._loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=batch_size, sampler=self.sampler,
            num_workers=self.workers, collate_fn=_collate, drop_last=False,
            generator=private_generator(seed), **mp)

    def __len__(self):
        return self.sampler.num_batches

    def __iter__(self):
        self.dataset.epoch = self.epoch
        self.sampler.set_epoch(self.epoch)
        self.skipped_epoch = 0
        met: set[int] = set()  # bad records met this epoch: each counts once, as in DALI
        for batch in self._loader:
            if isinstance(batch, FailedSample):
                self._stop_workers()
                raise batch.error
            imgs, toks, failed = batch
            skipped = len(set(failed) - met)
            met.update(failed)
            if skipped:
                self.skipped += skipped
                self.skipped_epoch += skipped
                if self.log:
                    self.log(f"skipped {skipped} corrupt record(s) "
                             f"(total {self.skipped})")
            yield imgs, toks

    def _stop_workers(self) -> None:
        stop_workers(self._loader)

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch`` (a resumed run): its permutation and draws."""
        self.epoch = int(epoch)

    def reset(self):
        """Advance to the next epoch (new permutation and augmentation draws)."""
        self.epoch += 1
