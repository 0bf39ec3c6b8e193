"""The original RWKV-CLIP DALI pipeline (dali.py), on GPU and in a CPU-only mode.

``dali_dataloader(args)`` keeps the original's contract: ``args.train_data`` is the
``.rec``/``.idx`` prefix, ``args.batch_size``, ``args.workers`` (DALI threads),
``args.input_size``; rank / local rank / world size come from ``args.rank`` /
``args.world_size`` when set, else from the torchrun environment (RANK, LOCAL_RANK,
WORLD_SIZE), defaulting to 0/0/1. It yields ``(images, tokens)`` torch tensors: images
float32 (B, 3, S, S) CHW normalised with the CLIP mean/std, tokens int64 (B, 231);
``reset()`` per epoch; ``len()``.

GPU (as the original): ``readers.mxnet`` sharded by rank with ``random_shuffle`` and
``initial_fill=16384``; ``decoders.image_random_crop`` on ``"mixed"`` (aspect 0.8-1.25,
area 0.7-1.0, 100 attempts, device/host memory padding 211025920/140544512); GPU
``resize`` to S x S (linear); ``random.coin_flip`` mirror; ``crop_mirror_normalize``
with mean/std x 255, CHW float; ``prefetch_queue_depth=3``; ``seed=rank + 1467``;
``device_id=LOCAL_RANK``.

CPU-only (no CUDA device, ``args.dali_cpu=True`` or ``args.device == 'cpu'``): the same
graph with ``device_id=None`` and every operator on ``"cpu"`` (the memory paddings are
GPU-decoder options and are not passed).

WebDataset (``args.data_format == 'wds'``): ``readers.webdataset`` with ``ext
["jpg;jpeg;png;webp", "tok"]`` and ``dtypes [UINT8, INT32]``, the rest identical.

Evaluation variant (``train=False``): plain decode, resize the shorter side to
``int(256/224*S)``, centre crop S, no mirror, no shuffle, partial last batch.

Differences from the original, on purpose:

* ``pad_last_batch=True`` with the FILL policy: every epoch on every rank has the same
  ``ceil(shard/B)`` full batches (the original's ``pad_last_batch=False`` + FILL lets
  the epoch boundary drift and the per-epoch batch count vary, which can desynchronise
  DDP ranks).
* Labels are converted to int64 and 154-label records (two captions) are padded to
  231 by repeating the second caption (in DALI, ``fn.pad`` with -1, then in torch).
* Bad input never reaches DALI: files are checked in Python first (``check_rec`` /
  ``check_wds``); record-level problems raise :class:`DataError` or, with
  ``skip_corrupt``, are dropped via a filtered index (WebDataset: only whole bad shards
  can be dropped). An image DALI still fails to decode (bytes look like a JPEG but are
  garbage) is reported as a DataError naming the file and, after a Python scan of the
  data, the record; DALI cannot skip it mid-epoch, so use the torch loader to skip such
  records.
* On GPU, images come back as CUDA tensors and tokens as CPU int64 tensors (as the
  original: its labels were moved with ``.cuda()`` in the training loop).
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import torch

from ..distributed import DistInfo, launch_environment
from ..errors import DistributedError
from .recordio import DataError, RecordIOReader, check_rec, rec_paths, unpack, write_index
from .tokens import CONTEXT_LENGTH, NUM_LABELS

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


def _filtered_index(check, cache_dir: str | None) -> str:
    """Write the good entries of a checked .rec to a fresh .idx; return its path."""
    d = cache_dir or os.path.join(tempfile.gettempdir(), "rwkv_clip_idx")
    os.makedirs(d, exist_ok=True)
    h = hashlib.sha1(f"{os.path.abspath(check.rec_path)}:{len(check.good)}:"
                     f"{sorted(k for k, _ in check.bad)[:50]}".encode()).hexdigest()[:16]
    path = os.path.join(d, f"filtered-{h}.idx")
    write_index(check.good, path)
    return path


class DALIWrapper:
    """(images, tokens) iterator over a DALIGenericIterator; int64 tokens; DataError on failure."""

    def __init__(self, make_iter, diagnose, pad_tokens: bool, log=None):
        self._make_iter = make_iter
        self.iter = make_iter()
        self._diagnose = diagnose
        self.pad_tokens = pad_tokens
        self.skipped = 0           # records dropped before the run (skip_corrupt)
        self.log = log

    def __iter__(self):
        return self

    def __next__(self):
        try:
            data = next(self.iter)[0]
        except StopIteration:
            raise
        except RuntimeError as e:
            err = self._diagnose(e)
            if err is None:  # no bad record found in Python: not a data problem we know
                raise
            raise err from e
        images = data["images"]
        tokens = data["tokens"].to(torch.int64)
        if self.pad_tokens:  # 154-label records were padded with -1 by fn.pad
            miss = tokens[:, 2 * CONTEXT_LENGTH] < 0
            if miss.any():
                tokens[miss, 2 * CONTEXT_LENGTH:] = tokens[miss, CONTEXT_LENGTH:2 * CONTEXT_LENGTH]
        return images, tokens

    def __len__(self):
        return len(self.iter)

    def reset(self):
        self.iter.reset()


DIAGNOSE_SECONDS = 120.0


def _diagnose_rec(rec_prefix: str, entries, input_size: int):
    """After a DALI failure: find the bad record -> DataError naming it (None if none found).

    First a full structural check (cheap), then PIL decoding of the records, bounded by
    ``DIAGNOSE_SECONDS`` so a huge file never turns an error into a long stall.
    """
    import time

    from .torch_loader import decode_image

    def diagnose(exc):
        rec_path, _ = rec_paths(rec_prefix)
        dali_msg = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)
        try:
            chk = check_rec(rec_prefix, level="full")
            keys = {k for k, _ in entries}
            bad = [(k, r) for k, r in chk.bad if k in keys]
            if bad:
                return DataError(f"{bad[0][1]}; DALI said: {dali_msg}", rec_path, bad[0][0])
            r = RecordIOReader(rec_prefix, check_index=False)
            t0 = time.time()
            for n, (key, off) in enumerate(entries):
                if time.time() - t0 > DIAGNOSE_SECONDS:
                    return DataError(f"DALI failed ({dali_msg}); no bad record among the first "
                                     f"{n} checked in Python", rec_path)
                payload = r.read_at(off, key)
                _, _, image = unpack(payload, rec_path, key)
                try:
                    decode_image(image, input_size).load()
                except Exception as e:
                    return DataError(f"undecodable image ({type(e).__name__}); DALI said: "
                                     f"{dali_msg}", rec_path, key)
        except DataError as e:
            return e
        return None
    return diagnose


def _diagnose_wds(index, input_size: int):
    from .torch_loader import WdsSource, decode_image

    def diagnose(exc):
        src = WdsSource(index)
        for i in range(len(src)):
            try:
                data, _ = src.get(i)
                decode_image(data, input_size).load()
            except Exception as e:
                shard, key = src.name(i)
                return DataError(f"bad sample ({type(e).__name__}: {e}); DALI said: "
                                 f"{str(exc).splitlines()[0][:200]}", shard, key)
        return None
    return diagnose


def build_dali_loader(data, batch_size: int, input_size: int, workers: int = 4,
                      data_format: str = "rec", train: bool = True, cpu: bool | None = None,
                      rank: int = 0, local_rank: int = 0, world_size: int = 1,
                      seed: int | None = None, skip_corrupt: bool = False,
                      check_level: str | None = None, cache_dir: str | None = None,
                      log=print) -> DALIWrapper:
    """Build the DALI loader for a rec prefix or wds shard spec (see module docstring)."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    if cpu is None:
        cpu = not torch.cuda.is_available()
    if not data:
        raise DataError("no training data given (train_data is empty)")
    S = int(input_size)
    n_threads = max(1, int(workers))
    pipe_seed = rank + 1467 if seed is None else int(seed) + rank + 1467
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
            idx_path = _filtered_index(chk, cache_dir)
        if not chk.good:
            raise DataError("no usable records", rec_path)
        pad_tokens = 154 in chk.label_counts or chk.checked < chk.num_records
        entries = chk.good
        n_skipped = len(chk.bad)
        diagnose = _diagnose_rec(data, entries, S)
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
        diagnose = _diagnose_wds(index, S)
    else:
        raise ValueError(f"unknown data format {data_format!r} for DALI (rec or wds)")

    dec_device = "cpu" if cpu else "mixed"
    op_device = "cpu" if cpu else "gpu"

    @pipeline_def(batch_size=batch_size, num_threads=n_threads,
                  device_id=None if cpu else local_rank, prefetch_queue_depth=3,
                  seed=pipe_seed)
    def pipeline():
        if data_format == "rec":
            jpegs, labels = fn.readers.mxnet(
                path=[rec_path], index_path=[idx_path], initial_fill=16384,
                num_shards=world_size, shard_id=rank, random_shuffle=train,
                pad_last_batch=True, name=READER_NAME)
        else:
            jpegs, labels = fn.readers.webdataset(
                paths=paths, ext=["jpg;jpeg;png;webp", "tok"],
                dtypes=[types.UINT8, types.INT32], missing_component_behavior="error",
                initial_fill=16384, num_shards=world_size, shard_id=rank,
                random_shuffle=train, pad_last_batch=True, name=READER_NAME)
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
            mirror = fn.random.coin_flip(probability=0.5)
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

    def make_iter():
        pipe = pipeline()
        pipe.build()
        policy = LastBatchPolicy.FILL if train else LastBatchPolicy.PARTIAL
        return DALIGenericIterator([pipe], ["images", "tokens"], reader_name=READER_NAME,
                                   last_batch_policy=policy, auto_reset=False)

    try:
        wrapper = DALIWrapper(make_iter, diagnose, pad_tokens)
    except RuntimeError as e:  # the first batches are prefetched while building
        err = None if "CUDA" in str(e) else diagnose(e)
        if err is None:
            raise
        raise err from e
    wrapper.skipped = n_skipped
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
