"""The original RWKV-CLIP DALI pipeline (dali.py), on GPU and in a CPU-only mode.

``dali_dataloader(args)`` keeps the original's contract and graph (``readers.mxnet`` or
``readers.webdataset``, random-crop decode, resize, mirror, normalise); its deliberate
differences (per-epoch seeding, padded batches, Python-side checks) are in docs/data.md.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

import torch

from ..distributed import DistInfo, launch_environment
from ..errors import DataError, DistributedError
from .recordio import check_rec, rec_paths, write_index
from .tokens import CONTEXT_LENGTH, NUM_LABELS, VOCAB_SIZE

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
DEVICE_MEMORY_PADDING = 211025920
HOST_MEMORY_PADDING = 140544512
READER_NAME = "train"


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
        return True
    except Exception:
        return False


def dist_info(args=None) -> DistInfo:
    """This process's data shard: ``args.rank`` / ``local_rank`` / ``world_size`` where
    given, else the launch environment (torchrun or SLURM), else rank 0 of 1."""
    _, env_rank, env_local, env_world = launch_environment()
    rank = getattr(args, "rank", None)
    world = getattr(args, "world_size", None)
    local = getattr(args, "local_rank", None)
    rank = env_rank if rank is None else int(rank)
    world = env_world if world is None else int(world)
    local = env_local if local is None else int(local)
    if not 0 <= rank < world:
        raise DistributedError(f"rank {rank} outside world size {world}")
    return DistInfo(rank=rank, local_rank=local, world_size=world)


def _want_cpu(args) -> bool:
    if getattr(args, "dali_cpu", False):
        return True
    if str(getattr(args, "device", "") or "").startswith("cpu"):
        return True
    return not torch.cuda.is_available()


def _filtered_index(rec_path: str, entries, cache_dir: str | None) -> str:
    """Write ``entries`` (the good records of ``rec_path``) to a fresh .idx; return its path."""
    d = cache_dir or os.path.join(tempfile.gettempdir(), "rwkv_clip_idx")
    os.makedirs(d, exist_ok=True)
    keys = sorted(k for k, _ in entries)
    h = hashlib.sha1(f"{os.path.abspath(rec_path)}:{len(keys)}:{keys}".encode()).hexdigest()[:16]
    path = os.path.join(d, f"filtered-{h}.idx")
    write_index(entries, path)
    return path


def epoch_seed(base: int, epoch: int) -> int:
    """The pipeline seed of one epoch: epoch 0 keeps the original's ``rank + 1467``."""
    return (int(base) + 1_000_003 * int(epoch)) % 2**31


class _BadLabels(RuntimeError):
    """A batch whose token ids are not integral ids in [0, vocab) (found after DALI)."""


class DALIWrapper:
    """(images, tokens) iterator over per-epoch DALI pipelines; int64 tokens.

    Every epoch runs on a pipeline built for that epoch alone (``make_iter(epoch,
    dropped_keys)``: its seed and shard depend only on the run's seed, the rank and the
    epoch), so ``set_epoch(E)`` on a fresh loader reproduces epoch E of an uninterrupted
    run exactly - order, crops and flips - and consuming B batches reproduces any position
    inside it. One continuous pipeline cannot do that: its reader and augmentation
    streams after E epochs are only reachable by running E epochs.

    A record that fails once the run is going (DALI cannot decode it, or its labels are
    not token ids) is located in Python (``find_bad(exc)`` -> [(reason, file, record)]);
    without ``skip_corrupt`` that is the one DataError raised. With it (``.rec`` only:
    ``can_drop``) the record is dropped for the rest of the run and counted, the epoch's
    pipeline is rebuilt without it and advanced to the current position, as the torch
    loader replaces a bad record and goes on.
    """

    def __init__(self, make_iter, find_bad, pad_tokens: bool, skip_corrupt: bool = False,
                 can_drop: bool = False, log=None):
        self._make_iter = make_iter
        self._find_bad = find_bad
        self.pad_tokens = pad_tokens
        self.skip_corrupt = skip_corrupt
        self.can_drop = can_drop
        self.log = log
        self.skipped = 0            # records dropped (before the run and while running)
        self.skipped_epoch = 0      # of them, in the current epoch (run time only)
        self.num_samples: int | None = None  # usable pairs over all ranks (set by the builder)
        self.dropped: set = set()   # keys dropped while running
        self.iter: Any = None
        self.epoch = 0
        self._open(0)
        self._len = len(self._current_iter())

    def _current_iter(self) -> Any:
        return self.iter

    # ---- position
    def _open(self, epoch: int, origin: int = 0) -> None:
        """Build epoch ``epoch``'s pipeline; its first batch is batch ``origin`` of the epoch."""
        if origin == 0:
            self.delivered = 0      # batches of this epoch handed out
        self.epoch, self._origin, self._taken = epoch, origin, 0
        while True:
            self.iter = None        # the old pipeline (GPU memory) goes first
            try:
                self.iter = self._make_iter(epoch, frozenset(self.dropped))
                return
            except DataError:
                raise
            except RuntimeError as e:  # the first batches are prefetched while building
                if "CUDA" in str(e):
                    raise
                self._recover(e)

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch`` (a resumed run; see the class docstring)."""
        self._open(int(epoch))

    def reset(self) -> None:
        """Go to the next epoch (call after each epoch, as with the torch loader). Records
        dropped while running are skipped again in every later epoch and counted each
        time, as the torch loader meets and counts a bad record every epoch."""
        self._open(self.epoch + 1)
        self.skipped_epoch = len(self.dropped)
        self.skipped += self.skipped_epoch

    def __len__(self):
        return self._len

    def __iter__(self):
        return self

    # ---- batches
    def _next_checked(self):
        data = next(self.iter)[0]
        images, labels = data["images"], data["tokens"].cpu()
        # the torch loader's label check (normalize_labels), on the whole batch at once
        bad = (labels < 0) | (labels >= VOCAB_SIZE) | (labels != labels.round())
        tokens = labels.to(torch.int64)
        if self.pad_tokens:  # 154-label records were padded with -1 by fn.pad
            miss = tokens[:, 2 * CONTEXT_LENGTH] < 0
            if miss.any():
                tokens[miss, 2 * CONTEXT_LENGTH:] = tokens[miss, CONTEXT_LENGTH:2 * CONTEXT_LENGTH]
                bad[miss, 2 * CONTEXT_LENGTH:] = False
        if bool(bad.any()):
            raise _BadLabels(f"a batch holds token ids outside [0, {VOCAB_SIZE})")
        self._taken += 1
        return images, tokens

    def __next__(self):
        if self.delivered >= self._len:
            raise StopIteration
        while True:
            try:
                while self._origin + self._taken < self.delivered:  # replay after a rebuild
                    self._next_checked()
                batch = self._next_checked()
                break
            except StopIteration:
                # an epoch that lost records can be a batch short: wrap around (as FILL)
                self._open(self.epoch, origin=self.delivered)
            except RuntimeError as e:
                if "CUDA" in str(e):
                    raise
                self._recover(e)
                self._open(self.epoch, origin=self._origin)
        self.delivered += 1
        return batch

    def _recover(self, exc: RuntimeError) -> None:
        """Locate the bad record behind ``exc``; raise its DataError, or drop it."""
        dali_msg = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)
        bad = self._find_bad(exc, frozenset(self.dropped))
        if not bad:
            raise DataError(f"DALI failed and no bad record was found in Python; DALI said: "
                            f"{dali_msg}") from exc
        new = [b for b in bad if b[2] not in self.dropped]
        if not self.skip_corrupt or not new:
            raise DataError(*(new or bad)[0]) from None
        if not self.can_drop:
            reason, path, record = new[0]
            raise DataError(f"{reason} (DALI cannot skip a sample inside a shard; use the "
                            f"torch loader)", path, record) from None
        self.dropped.update(b[2] for b in new)
        self.skipped += len(new)
        self.skipped_epoch += len(new)
        if self.log:
            self.log(f"[data] skipping {len(new)} corrupt record(s) (total {self.skipped}); "
                     f"first: {new[0][1]} record {new[0][2]}: {new[0][0]}")


DIAGNOSE_SECONDS = 120.0


def _find_bad_rec(rec_prefix: str, entries, first_only: bool):
    """``find_bad`` of a .rec: after a DALI failure, the records to blame, as
    [(reason, file, key)] - the torch loader's own checks and wording: the full
    structural check (cheap, now with label values), then reading each record as the
    torch loader does (labels, :func:`.decoding.decode_image`), bounded by
    ``DIAGNOSE_SECONDS`` so a huge file never turns an error into a long stall."""
    import time

    from .decoding import decode_image, undecodable
    from .torch_loader import RecSource

    def find_bad(exc, dropped=frozenset()):
        chk = check_rec(rec_prefix, level="full")
        keys = {k for k, _ in entries} - set(dropped)
        found: list[tuple[Any, str | None, Any]] = [(r, chk.rec_path, k) for k, r in chk.bad
                                                    if k in keys]
        if found and first_only:
            return found[:1]
        blamed = {f[2] for f in found}
        src = RecSource(rec_prefix, [e for e in entries if e[0] in keys - blamed])
        t0 = time.time()
        for i in range(len(src)):
            if time.time() - t0 > DIAGNOSE_SECONDS:
                break
            try:
                image, _ = src.get(i)
            except DataError as e:
                found.append((e.message, e.path, e.record))
            else:
                try:
                    decode_image(image, 16).load()
                except Exception as e:  # OSError/PIL's errors: the torch loader's wording
                    found.append((undecodable(e), *src.name(i)))
            if found and first_only:
                break
        return found
    return find_bad


def _find_bad_wds(index, first_only: bool):
    """``find_bad`` of WebDataset shards (see :func:`_find_bad_rec`)."""
    from .decoding import decode_image, undecodable
    from .torch_loader import WdsSource

    def find_bad(exc, dropped=frozenset()):
        src = WdsSource(index)
        found = []
        for i in range(len(src)):
            try:
                data, _ = src.get(i)
            except DataError as e:
                found.append((e.message, e.path, e.record))
            else:
                try:
                    decode_image(data, 16).load()
                except Exception as e:
                    found.append((undecodable(e), *src.name(i)))
            if found and first_only:
                break
        return found
    return find_bad


def build_dali_loader(data, batch_size: int, input_size: int, workers: int = 4,
                      data_format: str = "rec", train: bool = True, cpu: bool | None = None,
                      rank: int = 0, local_rank: int = 0, world_size: int = 1,
                      seed: int | None = None, skip_corrupt: bool = False,
                      check_level: str | None = None, cache_dir: str | None = None,
                      log=print) -> DALIWrapper:
    """Build the DALI loader for a rec prefix or wds shard spec (see module docstring)."""
    from nvidia.dali import fn as dali_fn
    from nvidia.dali import pipeline_def
    from nvidia.dali import types as dali_types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    # DALI's graph functions are generated at run time; its stubs do not model them
    fn: Any = dali_fn
    types: Any = dali_types

    if cpu is None:
        cpu = not torch.cuda.is_available()
    if not data:
        raise DataError("no training data given (train_data is empty)")
    S = int(input_size)
    n_threads = max(1, int(workers))
    base_seed = rank + 1467 if seed is None else int(seed) + rank + 1467
    pad_tokens = False

    if data_format == "rec":
        rec_path, idx_path = rec_paths(data)
        level = check_level or "auto"
        chk = check_rec(data, level=level)
        if chk.bad:
            if not skip_corrupt:
                key, reason = chk.bad[0]
                more = f" (+{len(chk.bad) - 1} more bad records)" if len(chk.bad) > 1 else ""
                raise DataError(reason + more, rec_path, key)
            if log:
                log(f"[data] skipping {len(chk.bad)} corrupt record(s) of {chk.num_records} "
                    f"in {rec_path}; first: key {chk.bad[0][0]}: {chk.bad[0][1]}")
            idx_path = _filtered_index(rec_path, chk.good, cache_dir)
        if not chk.good:
            raise DataError("no usable records", rec_path)
        pad_tokens = 154 in chk.label_counts or chk.checked < chk.num_records
        entries = chk.good
        n_skipped = len(chk.bad)
        num_samples = len(entries)
        find_bad = _find_bad_rec(data, entries, first_only=not skip_corrupt)

        def index_for(dropped):
            if not dropped:
                return idx_path
            good = [e for e in entries if e[0] not in dropped]
            if not good:
                raise DataError("no usable records", rec_path)
            return _filtered_index(rec_path, good, cache_dir)
    elif data_format == "wds":
        from .wds import check_wds
        index = check_wds(data, skip_corrupt=skip_corrupt)
        if index.bad and log:
            log(f"[data] skipping {len(index.bad)} problem(s) in the shards; first: "
                f"{index.bad[0]}")
        bad_shards = {b[0] for b in index.bad}
        if index.bad and any(b[1] is not None for b in index.bad):
            # DALI cannot drop single samples inside a tar; refuse rather than crash later
            raise DataError("shards contain bad samples that DALI cannot skip; use the torch "
                            "loader (loader='torch') with skip_corrupt, or rewrite the shards",
                            index.bad[0][0], index.bad[0][1])
        paths = [p for p in index.shards if p not in bad_shards]
        pad_tokens = any(s.tok[1] == 154 * 4 for s in index.samples)
        n_skipped = len(index.bad)
        num_samples = sum(s.shard not in bad_shards for s in index.samples)
        find_bad = _find_bad_wds(index, first_only=not skip_corrupt)
    else:
        raise ValueError(f"unknown data format {data_format!r} for DALI (rec or wds)")

    dec_device = "cpu" if cpu else "mixed"
    op_device = "cpu" if cpu else "gpu"

    device_id: Any = None if cpu else local_rank

    @pipeline_def(batch_size=batch_size, num_threads=n_threads, device_id=device_id,
                  prefetch_queue_depth=3)
    def pipeline(shard_id: int, index_path: str | None):
        # One epoch per pipeline: the shard moves on by one each epoch, as DALI's readers
        # do by themselves without stick_to_shard (same coverage over the epochs).
        if data_format == "rec":
            jpegs, labels = fn.readers.mxnet(
                path=[rec_path], index_path=[index_path], initial_fill=16384,
                num_shards=world_size, shard_id=shard_id, random_shuffle=train,
                stick_to_shard=True, pad_last_batch=True, name=READER_NAME)
        else:
            jpegs, labels = fn.readers.webdataset(
                paths=paths, ext=["jpg;jpeg;png;webp", "tok"],
                dtypes=[types.UINT8, types.INT32], missing_component_behavior="error",
                initial_fill=16384, num_shards=world_size, shard_id=shard_id,
                random_shuffle=train, stick_to_shard=True, pad_last_batch=True,
                name=READER_NAME)
        if pad_tokens:
            labels = fn.pad(labels, axes=(0,), shape=(NUM_LABELS,), fill_value=-1)
        gpu_kw = {} if cpu else dict(device_memory_padding=DEVICE_MEMORY_PADDING,
                                     host_memory_padding=HOST_MEMORY_PADDING)
        if train:
            images = fn.decoders.image_random_crop(
                jpegs, device=dec_device, output_type=types.RGB,
                random_aspect_ratio=[0.8, 1.25], random_area=[0.7, 1.0], num_attempts=100,
                **gpu_kw)
            images = fn.resize(images, device=op_device, resize_x=S, resize_y=S,
                               interp_type=types.INTERP_LINEAR)
            mirror: Any = fn.random.coin_flip(probability=0.5)
        else:
            images = fn.decoders.image(jpegs, device=dec_device, output_type=types.RGB,
                                       **gpu_kw)
            images = fn.resize(images, device=op_device, size=int(256 / 224 * S),
                               mode="not_smaller", interp_type=types.INTERP_LINEAR)
            mirror = False
        images = fn.crop_mirror_normalize(
            images, device=op_device, dtype=types.FLOAT, output_layout="CHW", crop=(S, S),
            mean=[m * 255 for m in CLIP_MEAN], std=[s * 255 for s in CLIP_STD],
            mirror=mirror)
        return images, labels

    def make_iter(epoch: int, dropped: frozenset):
        shard = (rank + epoch) % world_size if train else rank
        pipe = pipeline(shard_id=shard,
                        index_path=index_for(dropped) if data_format == "rec" else None,
                        seed=epoch_seed(base_seed, epoch if train else 0))
        pipe.build()
        policy = LastBatchPolicy.FILL if train else LastBatchPolicy.PARTIAL
        return DALIGenericIterator([pipe], ["images", "tokens"], reader_name=READER_NAME,
                                   last_batch_policy=policy, auto_reset=False)

    wrapper = DALIWrapper(make_iter, find_bad, pad_tokens, skip_corrupt=skip_corrupt,
                          can_drop=data_format == "rec", log=log)
    wrapper.skipped += n_skipped
    wrapper.num_samples = num_samples  # usable pairs over all ranks
    return wrapper


def dali_dataloader(args, train: bool = True):
    """The original's entry point: build from an argparse-like namespace."""
    shard = dist_info(args)
    rank, local, world = shard.rank, shard.local_rank, shard.world_size
    return build_dali_loader(
        args.train_data, batch_size=args.batch_size, input_size=args.input_size,
        workers=getattr(args, "workers", 4), data_format=getattr(args, "data_format", "rec"),
        train=train, cpu=_want_cpu(args), rank=rank, local_rank=local, world_size=world,
        seed=getattr(args, "dali_seed", None), skip_corrupt=getattr(args, "skip_corrupt", False),
        check_level=getattr(args, "check_level", None))


def main(argv: list[str] | None = None) -> int:
    """``python dali.py``: read a few batches of training data through the DALI pipeline
    (the loader train.py uses where DALI is installed) and print their shapes and rate."""
    import argparse
    import time

    p = argparse.ArgumentParser(
        prog="python dali.py",
        description="Read a few batches through the original's DALI pipeline (GPU, or CPU "
                    "operators without a GPU) and print their shapes and images/s: a check "
                    "that DALI reads your .rec or WebDataset shards.")
    p.add_argument("--train-data", required=True,
                   help="PREFIX of PREFIX.rec + PREFIX.idx (scripts/make_rec.py's output), or "
                        "WebDataset shards with --data-format wds")
    p.add_argument("--data-format", choices=("rec", "wds"), default="rec",
                   help="rec (MXNet RecordIO) or wds (WebDataset .tar shards); default rec")
    p.add_argument("--batch-size", type=int, default=32, help="images per batch; default 32")
    p.add_argument("--input-size", type=int, default=224, help="image side S; default 224")
    p.add_argument("--workers", type=int, default=2, help="DALI threads; default 2")
    p.add_argument("--batches", type=int, default=4, help="batches to read; default 4")
    p.add_argument("--cpu", action="store_true", help="CPU operators even with a GPU")
    p.add_argument("--eval", action="store_true",
                   help="the evaluation variant (centre crop, file order)")
    a = p.parse_args(argv)
    loader = build_dali_loader(a.train_data, a.batch_size, a.input_size, a.workers,
                               data_format=a.data_format, train=not a.eval,
                               cpu=True if a.cpu else None)
    print(f"DALI pipeline on {'CPU' if a.cpu or not torch.cuda.is_available() else 'GPU'}: "
          f"{len(loader)} batches per epoch of {a.batch_size}")
    t0, n = time.perf_counter(), 0
    for i, (images, tokens) in enumerate(loader):
        n += images.shape[0]
        print(f"batch {i + 1}: images {tuple(images.shape)} {images.dtype}, tokens "
              f"{tuple(tokens.shape)} {tokens.dtype}")
        if i + 1 >= a.batches:
            break
    print(f"{n} images in {time.perf_counter() - t0:.1f} s ({n / (time.perf_counter() - t0):.1f} "
          "images/s, first batch included)")
    return 0
