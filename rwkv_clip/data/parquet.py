"""Parquet image-text shards: img2dataset's parquet output and the Hub's YFCC15M layout.

Columns are resolved once from the first readable file; only footers (and img2dataset's
``status`` column) are read up front. Order, sharding and resume follow the torch
loader's contract at row-group granularity (docs/data.md).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import DataError
from .tokens import CONTEXT_LENGTH, encode_captions_batch, tokens_from_row
from .torch_loader import (
    MAX_SKIP_TRIES,
    FailedSample,
    image_tensor,
    private_generator,
    stop_workers,
)
from .wds import list_shards

IMAGE_COLUMNS = ("jpg", "images", "image", "img")
CAPTION_COLUMNS = ("caption", "texts", "text")
CAPTION_ROLES = ("raw", "synthetic", "generated")
STATUS_COLUMN = "status"
DEFAULT_SHUFFLE_ROWS = 2048


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise DataError("reading parquet needs pyarrow (pip install pyarrow)") from None
    return pa, pq


def parse_caption_columns(spec) -> list[str] | None:
    """``"raw,synthetic,generated"`` (or a list) -> 1 to 3 column names; None if unset."""
    if spec is None or spec == "":
        return None
    names = [c.strip() for c in (spec.split(",") if isinstance(spec, str) else spec)]
    if not 1 <= len(names) <= 3 or not all(names):
        raise DataError(f"--caption-columns {spec!r}: expected 1 to 3 comma-separated "
                        "column names (raw,synthetic,generated)")
    return names


@dataclass
class ParquetColumns:
    """The columns a loader reads, as resolved from the first file."""
    image: str
    captions: list              # 0-3 column names (raw, synthetic, generated)
    token_column: bool          # captions[0] is a list column of stored token ids
    image_struct: bool          # image is a {bytes, path} struct
    status: bool                # an img2dataset status column is present
    types: dict = field(default_factory=dict)  # column -> arrow type string

    @property
    def read(self) -> list:
        return [self.image, *self.captions]


def _is_binary(pa, t) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)


def _is_text(pa, t) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_token_list(pa, t) -> bool:
    return ((pa.types.is_list(t) or pa.types.is_large_list(t)
             or pa.types.is_fixed_size_list(t))
            and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)))


def resolve_columns(schema, path: str, image_column: str | None = None,
                    caption_columns=None, need_captions: bool = True) -> ParquetColumns:
    """Pick and type-check the image / caption columns of ``schema`` (see module doc)."""
    pa, _ = _pa()
    names = list(schema.names)
    have = ", ".join(names)
    if image_column and image_column not in names:
        raise DataError(f"no image column {image_column!r} (--image-column); the file "
                        f"has columns: {have}", path)
    image = image_column or next((c for c in IMAGE_COLUMNS if c in names), None)
    if image is None:
        raise DataError(f"no image column (looked for {', '.join(IMAGE_COLUMNS)}; name it "
                        f"with --image-column); the file has columns: {have}", path)
    itype = schema.field(image).type
    struct = pa.types.is_struct(itype)
    if struct:
        if itype.get_field_index("bytes") < 0 or not _is_binary(pa, itype.field("bytes").type):
            raise DataError(f"image column {image!r} is a struct {itype} without a binary "
                            "'bytes' field (expected a Hub Image struct {bytes, path})", path)
    elif not _is_binary(pa, itype):
        raise DataError(f"image column {image!r} has type {itype}; expected binary image "
                        "bytes or a Hub Image struct {bytes, path}", path)
    captions = parse_caption_columns(caption_columns)
    if captions is not None:
        missing = [c for c in captions if c not in names]
        if missing:
            raise DataError(f"no caption column {missing[0]!r} (--caption-columns); the file "
                            f"has columns: {have}", path)
    else:
        first = next((c for c in CAPTION_COLUMNS if c in names), None)
        if first is None and need_captions:
            raise DataError(f"no caption column (looked for {', '.join(CAPTION_COLUMNS)}; name "
                            f"them with --caption-columns, or give --caption-tokens); the "
                            f"file has columns: {have}", path)
        captions = [first] if first else []
    token_column = False
    for role, c in zip(CAPTION_ROLES, captions, strict=False):
        t = schema.field(c).type
        if _is_token_list(pa, t):
            if len(captions) != 1:
                raise DataError(f"caption column {c!r} holds token ids ({t}); a token column "
                                "must be the only caption column", path)
            token_column = True
        elif not _is_text(pa, t):
            raise DataError(f"{role} caption column {c!r} has type {t}; expected strings or "
                            "a list of token ids", path)
    status = STATUS_COLUMN in names
    types = {c: str(schema.field(c).type) for c in [image, *captions]}
    if status:
        types[STATUS_COLUMN] = str(schema.field(STATUS_COLUMN).type)
    return ParquetColumns(image, captions, token_column, struct, status, types)


@dataclass
class Unit:
    """One row group: where it is and which of its rows are usable."""
    file: int
    group: int
    first_row: int      # row offset of the group in its file
    global_row: int     # row offset over all files in order (caption-token row ids)
    rows: np.ndarray    # usable row numbers inside the group (int32)


@dataclass
class ParquetIndex:
    files: list
    columns: ParquetColumns | None = None
    units: list = field(default_factory=list)
    num_rows: int = 0           # rows of the readable files, filtered ones included
    filtered: int = 0           # rows with status != "success"
    filtered_rows: list = field(default_factory=list)  # [(file index, group, row in group)]
    bad: list = field(default_factory=list)     # [(file, None, reason)] files dropped
    bad_rows: int = 0           # rows in dropped files
    rows_unknown: str | None = None  # a dropped file whose rows could not be counted

    @property
    def usable(self) -> int:
        return int(sum(len(u.rows) for u in self.units))


def _status_rows(pf, group: int) -> np.ndarray:
    pa, _ = _pa()
    import pyarrow.compute as pc
    col = pf.read_row_group(group, columns=[STATUS_COLUMN]).column(0)
    ok = pc.fill_null(pc.equal(col.cast(pa.string()), "success"), False)
    return np.flatnonzero(ok.to_numpy(zero_copy_only=False)).astype(np.int32)


def index_parquet(spec, image_column: str | None = None, caption_columns=None,
                  skip_corrupt: bool = False, need_captions: bool = True) -> ParquetIndex:
    """List the shards, check their footers against the first file's schema, read the
    status column, and return the usable rows per row group."""
    pa, pq = _pa()
    files = list_shards(spec, ext=".parquet")
    out = ParquetIndex(files)
    ref_path: str | None = None
    global_row = 0
    for fi, path in enumerate(files):
        try:
            if os.path.getsize(path) == 0:
                raise DataError("empty file (0 bytes)", path)
            try:
                pf = pq.ParquetFile(path)
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"not a readable parquet file ({one_line(e)})", path) from None
            md = pf.metadata
            if md.num_rows == 0:
                raise DataError("empty file (no rows)", path)
            schema = pf.schema_arrow
            if out.columns is None:
                out.columns = resolve_columns(schema, path, image_column, caption_columns,
                                              need_captions)
                ref_path = path
            else:
                _check_same_schema(schema, out.columns, path, ref_path or path)
        except DataError as e:
            if not skip_corrupt or _layout_error(e, out):
                raise
            out.bad.append((path, None, str(e).split(" | ")[0]))
            try:
                n = pq.ParquetFile(path).metadata.num_rows
            except Exception:  # unreadable: its rows cannot be counted
                out.rows_unknown = path
            else:
                out.bad_rows += n
                global_row += n  # later files keep their row ids (caption-token rows)
            continue
        row = 0
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            if n == 0:
                continue
            rows = (_status_rows(pf, g) if out.columns.status
                    else np.arange(n, dtype=np.int32))
            out.filtered += n - len(rows)
            if len(rows) < n:
                out.filtered_rows += [(fi, g, int(r)) for r in
                                      np.setdiff1d(np.arange(n, dtype=np.int32), rows)]
            if len(rows):
                out.units.append(Unit(fi, g, row, global_row + row, rows))
            row += n
        out.num_rows += md.num_rows
        global_row += md.num_rows
    if out.columns is None:
        shard, _, reason = out.bad[0]
        raise DataError(f"no readable parquet file ({reason})", shard)
    if not out.units:
        raise DataError(f"no usable rows in the parquet files ({out.filtered} rows with "
                        f"status != 'success')", ", ".join(files[:3]))
    return out


def _layout_error(e: DataError, index: ParquetIndex) -> bool:
    """A missing column in the first file is a wrong flag, not corruption: never skipped."""
    return index.columns is None and "column" in str(e)


def _check_same_schema(schema, cols: ParquetColumns, path: str, ref: str) -> None:
    names = list(schema.names)
    for c, t in cols.types.items():
        if c not in names:
            raise DataError(f"schema differs from {ref}: no column {c!r} here (columns: "
                            f"{', '.join(names)})", path)
        here = str(schema.field(c).type)
        if here != t:
            raise DataError(f"schema differs from {ref}: column {c!r} is {here} here, {t} "
                            "there", path)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


# ----------------------------------------------------------------------------- order

class EpochPlan:
    """The epoch's sequence of usable rows (see module doc): position -> (unit, row)."""

    def __init__(self, counts: np.ndarray, seed: int, epoch: int, train: bool,
                 shuffle_rows: int):
        self.train, self.seed, self.epoch = train, seed, epoch
        n_units = len(counts)
        if train:
            rng = np.random.default_rng([seed, epoch, 0])
            self.order = rng.permutation(n_units)
        else:
            self.order = np.arange(n_units)
        cnt = counts[self.order]
        self.starts = np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64)
        self.total = int(self.starts[-1])
        if train:  # windows: units whose first row falls in the same shuffle_rows block
            wid = self.starts[:-1] // max(1, shuffle_rows)
            first = np.flatnonzero(np.concatenate([[True], wid[1:] != wid[:-1]]))
        else:
            first = np.arange(n_units)
        self.win_unit = np.concatenate([first, [n_units]])      # unit (order) bounds
        self.win_start = self.starts[self.win_unit]             # position bounds
        self._perms: OrderedDict = OrderedDict()

    def _perm(self, w: int) -> np.ndarray | None:
        if not self.train:
            return None
        p = self._perms.get(w)
        if p is None:
            size = int(self.win_start[w + 1] - self.win_start[w])
            p = np.random.default_rng([self.seed, self.epoch, 1, w]).permutation(size)
            self._perms[w] = p
            while len(self._perms) > 4:
                self._perms.popitem(last=False)
        return p

    def locate(self, p: int) -> tuple[int, int]:
        """Position p in [0, total) -> (unit index, index into that unit's usable rows)."""
        w = int(np.searchsorted(self.win_start, p, side="right")) - 1
        perm = self._perm(w)
        q = int(self.win_start[w]) + (int(perm[p - self.win_start[w]]) if perm is not None
                                      else p - int(self.win_start[w]))
        k = int(np.searchsorted(self.starts, q, side="right")) - 1
        return int(self.order[k]), q - int(self.starts[k])


class RankShare:
    """Rank r's slice of the epoch sequence and its batches (the torch sampler's rule)."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, train: bool):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.n, self.bs, self.train = n, batch_size, train
        self.lo, self.hi = n * rank // world_size, n * (rank + 1) // world_size
        if train:
            per_rank = -(-n // world_size)
            self.num_batches = -(-per_rank // batch_size)
        else:
            self.num_batches = -(-(self.hi - self.lo) // batch_size)

    @property
    def length(self) -> int:
        """Positions this rank walks through in an epoch (with wrap-around for training)."""
        return self.num_batches * self.bs if self.train else self.hi - self.lo

    def position(self, i: int) -> int:
        """i-th sample of this rank -> position in the epoch sequence."""
        share = self.hi - self.lo
        if share == 0:  # more ranks than rows: borrow from the whole sequence
            return i % self.n
        return self.lo + i % share


# ----------------------------------------------------------------------------- reading

class ParquetRows:
    """Per-process reader of row groups with a small cache (pickles without handles)."""

    def __init__(self, index: ParquetIndex, cache_rows: int, ctx_len: int = CONTEXT_LENGTH):
        self.files = index.files
        self.ctx_len = int(ctx_len)  # stored token rows are read at this context length
        self.units = index.units
        assert index.columns is not None  # set by the index once a file is read
        self.cols: ParquetColumns = index.columns
        self.cache_rows = cache_rows
        self._files: OrderedDict = OrderedDict()
        self._tables: OrderedDict = OrderedDict()
        self._pid: int | None = None

    def __getstate__(self):
        st = self.__dict__.copy()
        st["_files"], st["_tables"], st["_pid"] = OrderedDict(), OrderedDict(), None
        return st

    def _pf(self, fi: int):
        _, pq = _pa()
        pf = self._files.get(fi)
        if pf is None:
            path = self.files[fi]
            try:
                pf = pq.ParquetFile(path)
            except Exception as e:
                raise DataError(f"cannot open parquet file ({one_line(e)})", path) from None
            self._files[fi] = pf
            while len(self._files) > 8:
                self._files.popitem(last=False)
        self._files.move_to_end(fi)
        return pf

    def table(self, u: int):
        if self._pid != os.getpid():
            self._files, self._tables, self._pid = OrderedDict(), OrderedDict(), os.getpid()
        t = self._tables.get(u)
        if t is None:
            unit = self.units[u]
            try:
                t = self._pf(unit.file).read_row_group(unit.group, columns=self.cols.read)
            except DataError:
                raise
            except Exception as e:
                raise DataError(f"cannot read row group {unit.group} ({one_line(e)})",
                                self.files[unit.file]) from None
            self._tables[u] = t
            while (len(self._tables) > 1
                   and sum(x.num_rows for x in self._tables.values()) > self.cache_rows):
                self._tables.popitem(last=False)
        self._tables.move_to_end(u)
        return t

    def where(self, u: int, j: int) -> tuple[str, str]:
        unit = self.units[u]
        return self.files[unit.file], f"row {unit.first_row + int(unit.rows[j])}"

    def row_id(self, u: int, j: int) -> int:
        unit = self.units[u]
        return unit.global_row + int(unit.rows[j])

    def read(self, u: int, j: int):
        """-> (image bytes, captions tuple or tokens (3 ctx_len,) or None); DataError if
        bad."""
        t = self.table(u)
        r = int(self.units[u].rows[j])
        where = self.where(u, j)
        value = t.column(0)[r].as_py()
        if self.cols.image_struct and value is not None:
            data = value.get("bytes")
            if data is None and value.get("path"):
                data = self._read_path(value["path"], where)
            value = data
        if not value:
            raise DataError(f"null or empty image in column {self.cols.image!r}", *where)
        if not self.cols.captions:
            return value, None
        if self.cols.token_column:
            toks = t.column(1)[r].as_py()
            if toks is None:
                raise DataError(f"null token list in column {self.cols.captions[0]!r}", *where)
            return value, tokens_from_row(np.asarray(toks), *where, ctx_len=self.ctx_len)
        caps = [t.column(1 + k)[r].as_py() for k in range(len(self.cols.captions))]
        if not isinstance(caps[0], str) or not caps[0].strip():
            raise DataError(f"missing raw caption in column {self.cols.captions[0]!r}", *where)
        caps += [None] * (3 - len(caps))
        return value, (caps[0].strip(), caps[1], caps[2])

    def _read_path(self, p: str, where) -> bytes:
        full = p if os.path.isabs(p) else os.path.join(os.path.dirname(where[0]), p)
        try:
            with open(full, "rb") as f:
                return f.read()
        except OSError:
            raise DataError(f"image struct has no bytes and its path {p!r} cannot be read",
                            *where) from None


# ----------------------------------------------------------------------------- loader

class ParquetBatches(torch.utils.data.Dataset):
    """Item (b, epoch) -> batch b of this rank: (images, tokens int64, skipped)."""

    def __init__(self, index: ParquetIndex, batch_size: int, size: int, train: bool,
                 seed: int, rank: int, world_size: int, skip_corrupt: bool,
                 caption_tokens=None, shuffle_rows: int = DEFAULT_SHUFFLE_ROWS,
                 ctx_len: int = CONTEXT_LENGTH):
        self.size, self.train, self.seed, self.rank = int(size), train, seed, rank
        self.ctx_len = int(ctx_len)
        self.skip_corrupt, self.caption_tokens = skip_corrupt, caption_tokens
        self.shuffle_rows = int(shuffle_rows)
        self.counts = np.array([len(u.rows) for u in index.units], dtype=np.int64)
        self.share = RankShare(int(self.counts.sum()), batch_size, rank, world_size, train)
        # a worker touches every row group of the current shuffle window (and, at a
        # window edge, of the next one): keep two windows' worth of row groups
        group_rows = max(int(u.rows[-1]) + 1 for u in index.units)
        self.rows = ParquetRows(index, cache_rows=2 * (self.shuffle_rows + group_rows),
                                ctx_len=self.ctx_len)
        self._plan: EpochPlan | None = None

    def __len__(self):
        return self.share.num_batches

    def plan(self, epoch: int) -> EpochPlan:
        if self._plan is None or self._plan.epoch != epoch:
            self._plan = EpochPlan(self.counts, self.seed, epoch, self.train, self.shuffle_rows)
        return self._plan

    def _sample(self, plan: EpochPlan, i: int, epoch: int):
        u, j = plan.locate(self.share.position(i))
        data, caps = self.rows.read(u, j)
        img = image_tensor(data, self.size, self.train, (self.seed, self.rank, epoch, i),
                           self.rows.where(u, j))
        return img, caps, self.rows.row_id(u, j)

    def __getitem__(self, item):
        try:
            return self._batch(*item)
        except DataError as e:
            # returned, not raised: raised in a worker it would reach the user as a worker
            # traceback; the main process raises it (ParquetLoader.__iter__)
            return FailedSample(e)

    def _batch(self, b: int, epoch: int):
        plan = self.plan(epoch)
        lo = b * self.share.bs
        hi = min(lo + self.share.bs, self.share.length)
        imgs, caps, ids, skipped = [], [], [], 0
        for i in range(lo, hi):
            tries = 0
            while True:  # a bad row is replaced by the next one of this rank's sequence
                try:
                    img, cap, rid = self._sample(plan, i + tries, epoch)
                    break
                except DataError:
                    if not self.skip_corrupt or tries >= min(MAX_SKIP_TRIES, plan.total - 1):
                        raise
                    tries += 1
                    skipped += 1
            imgs.append(img)
            caps.append(cap)
            ids.append(rid)
        return torch.stack(imgs), torch.from_numpy(self._tokens(caps, ids)), skipped

    def _tokens(self, caps: list, ids: list) -> np.ndarray:
        if caps[0] is None:
            own: list[Any] = [None] * len(caps)
        elif isinstance(caps[0], np.ndarray):
            own = caps
        else:
            own = list(encode_captions_batch(caps, self.ctx_len))
        if self.caption_tokens is not None:
            ct = self.caption_tokens
            return np.stack([ct.tokens(r, o) for r, o in zip(ids, own, strict=True)])
        return np.stack(own)


class _BatchSampler(torch.utils.data.Sampler):
    def __init__(self, loader: ParquetLoader):
        self.loader = loader

    def __iter__(self):
        e = self.loader.epoch
        return iter([(b, e) for b in range(len(self.loader))])

    def __len__(self):
        return len(self.loader)


class ParquetLoader:
    """Iterable over (images, tokens) batches with ``len()``, ``reset()`` and ``epoch``,
    as :class:`~.torch_loader.TorchLoader`; ``filtered`` counts status-filtered rows."""

    def __init__(self, index: ParquetIndex, batch_size: int, input_size: int, workers: int = 0,
                 train: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 skip_corrupt: bool = False, caption_tokens=None, log=None,
                 shuffle_rows: int = DEFAULT_SHUFFLE_ROWS, ctx_len: int = CONTEXT_LENGTH):
        if caption_tokens is not None:
            if index.rows_unknown:
                raise DataError("cannot line up caption-token rows with the parquet rows: "
                                "a dropped file's row count is unknown", index.rows_unknown)
            caption_tokens.check(index.num_rows + index.bad_rows,
                                 f"the parquet files ({len(index.files)})")
        self.dataset = ParquetBatches(index, batch_size, input_size, train, seed, rank,
                                      world_size, skip_corrupt, caption_tokens, shuffle_rows,
                                      ctx_len)
        self.index = index
        self.batch_size = batch_size
        self.num_samples = index.usable  # usable rows over all ranks
        self.workers = max(0, int(workers))
        self.epoch = 0
        self.skipped = index.bad_rows
        self.skipped_epoch = 0
        self.filtered = index.filtered
        self.log = log
        # forkserver workers for the torch loader's reason (no fork of a threaded process)
        mp: dict[str, Any] = dict(multiprocessing_context="forkserver", persistent_workers=True,
                                  prefetch_factor=2) if self.workers else {}
        self._loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=None, sampler=_BatchSampler(self),
            num_workers=self.workers, generator=private_generator(seed), **mp)

    def __len__(self):
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        self.skipped_epoch = 0
        for batch in self._loader:
            if isinstance(batch, FailedSample):
                stop_workers(self._loader)
                raise batch.error
            imgs, toks, skipped = batch
            if skipped:
                self.skipped += int(skipped)
                self.skipped_epoch += int(skipped)
                if self.log:
                    self.log(f"skipped {int(skipped)} bad parquet row(s) (total {self.skipped})")
            yield imgs, toks

    def reset(self):
        """Advance to the next epoch (new order and augmentation draws)."""
        self.epoch += 1


def build_parquet_loader(data, *, batch_size: int, input_size: int, workers: int, train: bool,
                         seed: int, rank: int, world_size: int, skip_corrupt: bool,
                         image_column: str | None = None, caption_columns=None,
                         caption_tokens=None, shuffle_rows: int | None = None,
                         log=print, ctx_len: int = CONTEXT_LENGTH) -> ParquetLoader:
    """Index the shards and return a :class:`ParquetLoader` (see the module doc); captions
    are tokenised, and stored token rows fitted, at ``ctx_len`` tokens."""
    index = index_parquet(data, image_column, caption_columns, skip_corrupt,
                          need_captions=caption_tokens is None)
    if log and index.bad:
        log(f"[data] skipping {len(index.bad)} parquet file(s); first: {index.bad[0]}")
    if log and index.filtered:
        log(f"[data] {index.filtered} row(s) with status != 'success' skipped "
            f"({index.usable} usable of {index.num_rows})")
    return ParquetLoader(index, batch_size, input_size, workers=workers, train=train, seed=seed,
                         rank=rank, world_size=world_size, skip_corrupt=skip_corrupt,
                         caption_tokens=caption_tokens, log=log,
                         shuffle_rows=shuffle_rows or DEFAULT_SHUFFLE_ROWS, ctx_len=ctx_len)


def iter_parquet_samples(spec, image_column: str | None = None, caption_columns=None,
                         ctx_len: int = CONTEXT_LENGTH):
    """Rows of parquet shards as writer samples (for ``make_rec.py``), in file order:
    ``{"name", "image_bytes", "raw", "synthetic", "generated"}`` or ``{"name", "image_bytes",
    "tokens"}`` for a token column; bad rows and filtered ones as ``{"name", "error"}``.

    The shards are indexed here, before the first sample is asked for, so a wrong column
    name fails before any output is written."""
    index = index_parquet(spec, image_column, caption_columns, skip_corrupt=True)
    return _parquet_samples(index, ctx_len)


def _parquet_samples(index: ParquetIndex, ctx_len: int = CONTEXT_LENGTH):
    for path, _, reason in index.bad:
        yield {"name": os.path.basename(path), "error": reason}
    _, pq = _pa()
    first_rows: dict[tuple[int, int], int] = {}  # (file, group) -> its first row in the file
    for k, (fi, g, r) in enumerate(index.filtered_rows):
        path = index.files[fi]
        if (fi, g) not in first_rows:
            md = pq.ParquetFile(path).metadata
            first_rows[(fi, g)] = sum(md.row_group(i).num_rows for i in range(g))
        detail = None
        if k < 20:  # the first ones as examples: their key and status
            pf = pq.ParquetFile(path)
            cols = [c for c in ("key", STATUS_COLUMN) if c in pf.schema_arrow.names]
            row = pf.read_row_group(g, columns=cols).slice(r, 1).to_pylist()[0]
            detail = ", ".join(f"{c} {row[c]!r}" for c in cols)
        yield {"name": f"{os.path.basename(path)}:row {first_rows[(fi, g)] + r}",
               "error": "img2dataset status is not 'success'", "detail": detail}
    rows = ParquetRows(index, cache_rows=1, ctx_len=ctx_len)
    for u, unit in enumerate(index.units):
        for j in range(len(unit.rows)):
            path, row = rows.where(u, j)
            name = f"{os.path.basename(path)}:{row}"
            try:
                data, caps = rows.read(u, j)
            except DataError as e:
                yield {"name": name, "error": str(e).split(" | ")[0]}
                continue
            if isinstance(caps, np.ndarray):
                yield {"name": name, "image_bytes": data, "tokens": caps}
            else:
                yield {"name": name, "image_bytes": data, "raw": caps[0], "synthetic": caps[1],
                       "generated": caps[2]}


def count_parquet_rows(spec) -> int:
    """Rows in the shards' footers (progress totals)."""
    _, pq = _pa()
    n = 0
    for p in list_shards(spec, ext=".parquet"):
        try:
            n += pq.ParquetFile(p).metadata.num_rows
        except Exception:
            pass
    return n
