"""Pure-Python MXNet RecordIO: writer, reader and structural validation.

The format is dmlc-core's ``recordio.cc`` (what MXNet and DALI's ``readers.mxnet`` read);
an image record is an ``IRHeader`` with float32 labels, then the encoded image. Every
problem is reported as :class:`DataError` naming the file and the record.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO, TextIO

import numpy as np

from ..errors import DataError
from .tokens import CONTEXT_LENGTH, expected_layouts, label_problem, stored_layout

# Each physical record: uint32 magic, uint32 (cflag << 29 | length), the bytes zero-padded
# to 4. A payload holding the magic at an aligned offset is split there (the magic is
# dropped, parts get cflag 1/2/3, a reader re-inserts it); otherwise one part, cflag 0.
# The .idx file holds one "key\toffset" line per record (offset of its first magic).
MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_LEN_MASK = (1 << 29) - 1
IR_FORMAT = "<IfQQ"
IR_SIZE = struct.calcsize(IR_FORMAT)  # 24


@dataclass
class IRHeader:
    flag: int
    label: float
    id: int
    id2: int


def _encode_lrec(cflag: int, length: int) -> bytes:
    return struct.pack("<I", (cflag << 29) | length)


def encode_record(payload: bytes) -> bytes:
    """Return the on-disk bytes of one logical record (all parts + padding)."""
    n = len(payload)
    if n >= (1 << 29):
        raise ValueError(f"record of {n} bytes is too large for RecordIO (< 2**29)")
    out: list[bytes | memoryview] = []
    mv = memoryview(payload)
    lower_align = (n >> 2) << 2
    dptr = 0
    # find aligned occurrences of the magic, like dmlc's WriteRecord
    pos = payload.find(_MAGIC_BYTES, 0, lower_align)
    while pos != -1:
        if pos % 4 == 0:
            out.append(_MAGIC_BYTES)
            out.append(_encode_lrec(1 if dptr == 0 else 2, pos - dptr))
            out.append(mv[dptr:pos])
            dptr = pos + 4
            pos = payload.find(_MAGIC_BYTES, dptr, lower_align)
        else:
            pos = payload.find(_MAGIC_BYTES, pos + 1, lower_align)
    out.append(_MAGIC_BYTES)
    out.append(_encode_lrec(3 if dptr != 0 else 0, n - dptr))
    out.append(mv[dptr:n])
    pad = (-n) % 4
    if pad:
        out.append(b"\x00" * pad)
    return b"".join(bytes(x) for x in out)


def pack(header: IRHeader, labels: np.ndarray | None, image: bytes) -> bytes:
    """``mx.recordio.pack``: header (+ float32 labels) + image bytes."""
    if labels is not None:
        labels = np.ascontiguousarray(labels, dtype="<f4").reshape(-1)
        head = struct.pack(IR_FORMAT, labels.size, 0.0, header.id, header.id2)
        return head + labels.tobytes() + image
    return struct.pack(IR_FORMAT, 0, header.label, header.id, header.id2) + image


def unpack(payload: bytes, where: str = "?", record=None):
    """Inverse of :func:`pack`: returns (IRHeader, labels float32 array or None, image bytes)."""
    if len(payload) < IR_SIZE:
        raise DataError(f"record payload of {len(payload)} bytes is shorter than the "
                        f"{IR_SIZE}-byte IRHeader", where, record)
    flag, label, id_, id2 = struct.unpack_from(IR_FORMAT, payload, 0)
    header = IRHeader(flag, label, id_, id2)
    if flag > 0:
        end = IR_SIZE + 4 * flag
        if end > len(payload):
            raise DataError(f"IRHeader announces {flag} labels but the payload has only "
                            f"{len(payload) - IR_SIZE} bytes after the header", where, record)
        labels = np.frombuffer(payload, dtype="<f4", count=flag, offset=IR_SIZE).copy()
        return header, labels, payload[end:]
    return header, None, payload[IR_SIZE:]


class RecordIOWriter:
    """Indexed RecordIO writer producing ``PREFIX.rec`` and ``PREFIX.idx``.

    Files are written under temporary names and renamed on :meth:`close`, so an
    interrupted run never leaves a valid-looking but incomplete pair.
    """

    def __init__(self, rec_path: str, idx_path: str):
        self.rec_path, self.idx_path = rec_path, idx_path
        d = os.path.dirname(os.path.abspath(rec_path))
        os.makedirs(d, exist_ok=True)
        self._rec_tmp = rec_path + ".tmp"
        self._idx_tmp = idx_path + ".tmp"
        self._rec: BinaryIO | None = open(self._rec_tmp, "wb")
        self._idx: TextIO | None = open(self._idx_tmp, "w")
        self._keys: set = set()
        self.count = 0

    def write(self, key: int, payload: bytes) -> None:
        if key in self._keys:
            raise ValueError(f"duplicate record key {key}")
        if self._rec is None or self._idx is None:
            raise ValueError(f"RecordIOWriter {self.rec_path} is closed")
        self._keys.add(key)
        offset = self._rec.tell()
        self._rec.write(encode_record(payload))
        self._idx.write(f"{key}\t{offset}\n")
        self.count += 1

    def write_image_record(self, key: int, labels, image: bytes, id2: int = 0) -> None:
        self.write(key, pack(IRHeader(0, 0.0, key, id2), labels, image))

    def close(self) -> None:
        if self._rec is None or self._idx is None:
            return
        self._rec.close()
        self._idx.close()
        self._rec = self._idx = None
        os.replace(self._rec_tmp, self.rec_path)
        os.replace(self._idx_tmp, self.idx_path)

    def abort(self) -> None:
        if self._rec is None or self._idx is None:
            return
        self._rec.close()
        self._idx.close()
        self._rec = self._idx = None
        for p in (self._rec_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def rec_paths(prefix: str) -> tuple[str, str]:
    """``PREFIX`` (or ``PREFIX.rec``) -> (PREFIX.rec, PREFIX.idx)."""
    if prefix.endswith(".rec") or prefix.endswith(".idx"):
        prefix = prefix[:-4]
    return prefix + ".rec", prefix + ".idx"


def read_index(idx_path: str, rec_size: int | None = None) -> list[tuple[int, int]]:
    """Parse an ``.idx`` file into ``[(key, offset), ...]`` in file order.

    Checks: file exists and is non-empty, every line is ``int<TAB or space>int``, keys
    are unique, offsets are 4-byte aligned and (if ``rec_size`` is given) inside the
    ``.rec``.
    """
    if not os.path.isfile(idx_path):
        raise DataError("index file not found", idx_path)
    entries = []
    seen = set()
    with open(idx_path) as f:
        for lineno, line in enumerate(f, 1):
            s = line.strip()
            if not s:
                continue
            parts = s.split()
            if len(parts) != 2:
                raise DataError(f"malformed index line {lineno}: {s[:80]!r}", idx_path)
            try:
                key, off = int(parts[0]), int(parts[1])
            except ValueError:
                raise DataError(f"malformed index line {lineno}: {s[:80]!r}", idx_path) from None
            if key in seen:
                raise DataError(f"duplicate key at index line {lineno}", idx_path, key)
            seen.add(key)
            if off < 0 or off % 4:
                raise DataError(f"offset {off} at index line {lineno} is not a valid "
                                "record position (negative or not 4-byte aligned)", idx_path, key)
            if rec_size is not None and off + 8 > rec_size:
                raise DataError(f"offset {off} at index line {lineno} points past the end of "
                                f"the .rec file ({rec_size} bytes)", idx_path, key)
            entries.append((key, off))
    if not entries:
        raise DataError("index file is empty (no records)", idx_path)
    return entries


class RecordIOReader:
    """Random-access reader of ``PREFIX.rec`` via ``PREFIX.idx``.

    Opens the ``.rec`` lazily per process (safe to pickle into DataLoader workers).
    """

    def __init__(self, prefix: str, check_index: bool = True):
        rec_path, idx_path = rec_paths(prefix)
        self.rec_path = rec_path
        self.idx_path: str | None = idx_path
        if not os.path.isfile(self.rec_path):
            raise DataError("record file not found (a .rec path is PREFIX.rec + PREFIX.idx, "
                        "as scripts/make_rec.py writes them)", self.rec_path)
        self.rec_size = os.path.getsize(self.rec_path)
        if self.rec_size == 0:
            raise DataError("record file is empty", self.rec_path)
        self.index = read_index(idx_path, self.rec_size if check_index else None)
        self.keys = [k for k, _ in self.index]
        self._offsets = dict(self.index)
        self._fh: BinaryIO | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self):
        st = self.__dict__.copy()
        st["_fh"] = None
        st["_pid"] = None
        return st

    def _file(self):
        if self._fh is None or self._pid != os.getpid():
            self._fh = open(self.rec_path, "rb")
            self._pid = os.getpid()
        return self._fh

    def close(self):
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def read_at(self, offset: int, key=None) -> bytes:
        """Read the logical record starting at ``offset`` (joins continuation parts)."""
        f = self._file()
        f.seek(offset)
        chunks = []
        expect_first = True
        while True:
            pos = f.tell()
            head = f.read(8)
            if len(head) < 8:
                raise DataError(f"truncated record: header at byte {pos} cut off by end of file",
                                self.rec_path, key)
            magic, lrec = struct.unpack("<II", head)
            if magic != MAGIC:
                what = "is not the start of a record" if expect_first else "has a bad continuation"
                raise DataError(f"byte {pos} {what} (magic 0x{magic:08x}, "
                                f"expected 0x{MAGIC:08x})", self.rec_path, key)
            cflag, length = lrec >> 29, lrec & _LEN_MASK
            if expect_first and cflag not in (0, 1):
                raise DataError(f"byte {pos} is a continuation part (cflag {cflag}), not the "
                                "start of a record", self.rec_path, key)
            if not expect_first and cflag not in (2, 3):
                raise DataError(f"bad continuation flag {cflag} at byte {pos}", self.rec_path, key)
            data = f.read(length)
            if len(data) < length:
                raise DataError(f"truncated record: {length} bytes announced at byte {pos}, "
                                f"only {len(data)} present", self.rec_path, key)
            if not expect_first:
                chunks.append(_MAGIC_BYTES)
            chunks.append(data)
            pad = (-length) % 4
            if pad:
                f.seek(pad, 1)
            if cflag in (0, 3):
                break
            expect_first = False
        return b"".join(chunks)

    def read_key(self, key) -> bytes:
        try:
            off = self._offsets[key]
        except KeyError:
            raise DataError("no such key in the index", self.idx_path, key) from None
        return self.read_at(off, key)

    def read_idx(self, i: int) -> bytes:
        key, off = self.index[i]
        return self.read_at(off, key)

    def read_item(self, i: int):
        """(key, IRHeader, labels or None, image bytes) of the i-th index entry."""
        key, off = self.index[i]
        payload = self.read_at(off, key)
        header, labels, image = unpack(payload, self.rec_path, key)
        return key, header, labels, image

    def __iter__(self) -> Iterator:
        for i in range(len(self)):
            yield self.read_item(i)


def scan_records(rec_path: str) -> Iterator[tuple[int, bytes]]:
    """Sequentially read every logical record of a ``.rec`` (no index): (offset, payload)."""
    r = RecordIOReader.__new__(RecordIOReader)
    r.rec_path, r.idx_path = rec_path, None
    r._fh, r._pid = None, None
    size = os.path.getsize(rec_path)
    off = 0
    n = 0
    while off < size:
        payload = r.read_at(off, f"#{n} at byte {off}")
        yield off, payload
        off = r._file().tell()
        n += 1
    r.close()


# ----------------------------------------------------------------------------- validation

@dataclass
class RecCheck:
    """Result of :func:`check_rec`."""
    rec_path: str
    idx_path: str
    num_records: int            # entries in the .idx
    checked: int                # entries whose record was inspected
    good: list                  # [(key, offset)] that passed (all entries when not 'full')
    bad: list                   # [(key, reason)]
    label_counts: set           # distinct label counts seen among checked records


def _check_one(f, rec_size: int, key, off: int, check_image: bool,
               ctx_len: int = CONTEXT_LENGTH) -> tuple[str | None, int]:
    """Inspect the record at ``off`` cheaply. Returns (reason or None, label count)."""
    f.seek(off)
    head = f.read(8 + IR_SIZE + 4 * 3 * max(ctx_len, CONTEXT_LENGTH) + 4)
    if len(head) < 8:
        return f"offset {off} points past the end of the file", 0
    magic, lrec = struct.unpack_from("<II", head, 0)
    if magic != MAGIC:
        return f"offset {off} is not the start of a record (bad magic)", 0
    cflag, length = lrec >> 29, lrec & _LEN_MASK
    if cflag not in (0, 1):
        return f"offset {off} is a continuation part, not the start of a record", 0
    if off + 8 + length > rec_size:
        return (f"truncated record: {length} bytes announced at byte {off}, file ends at "
                f"{rec_size}"), 0
    if cflag == 1:  # split record: rare, read it in full
        try:
            r = RecordIOReader.__new__(RecordIOReader)
            r.rec_path, r._fh, r._pid = f.name, f, os.getpid()
            payload = r.read_at(off, key)
        except DataError as e:
            return str(e).split(" | ")[0], 0
    else:
        payload = head[8:8 + length]
    if len(payload) < IR_SIZE:
        return "record shorter than its IRHeader", 0
    flag = struct.unpack_from("<I", payload, 0)[0]
    if stored_layout(flag, ctx_len) is None:
        return f"record has {flag} labels; expected {expected_layouts(ctx_len)}", flag
    img_off = IR_SIZE + 4 * flag
    if cflag == 0 and length < img_off + 4:
        return "record holds no image bytes", flag
    problem = label_problem(np.frombuffer(payload, dtype="<f4", count=flag, offset=IR_SIZE))
    if problem:
        return problem, flag
    if check_image:
        if cflag == 0:
            f.seek(off + 8 + img_off)
            sig = f.read(12)
            tail_len = min(1024, length - img_off)
            f.seek(off + 8 + length - tail_len)
            tail = f.read(tail_len)
        else:
            sig, tail = payload[img_off:img_off + 12], payload[-1024:]
        if sig[:2] == b"\xff\xd8":
            if b"\xff\xd9" not in tail:
                return "JPEG image is truncated (no end-of-image marker)", flag
        elif not sig.startswith(_IMAGE_SIGNATURES) and not (sig[:4] == b"RIFF"
                                                             and sig[8:12] == b"WEBP"):
            return "image bytes are not a JPEG/PNG/BMP/GIF/TIFF/WebP image", flag
    return None, flag


_IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"BM", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*")


AUTO_FULL_CHECK_MAX = 1_000_000


def check_rec(prefix: str, level: str = "full", check_image: bool = True,
              max_quick: int = 1024, ctx_len: int = CONTEXT_LENGTH) -> RecCheck:
    """Validate a ``.rec``/``.idx`` pair without decoding images.

    ``level='full'`` inspects every record (two small reads per record: magic, length
    inside the file, label count 3 or 2 captions of ``ctx_len`` or 77 tokens, label values
    are token ids, image signature,
    JPEG end marker present); ``'quick'`` inspects
    the first, last and up to ``max_quick`` evenly spaced records; ``'auto'`` is full up
    to ``AUTO_FULL_CHECK_MAX`` records, else quick. File-level problems
    (missing/empty files, malformed index, offsets past the end) always raise
    :class:`DataError`; per-record problems are returned in ``bad`` so the caller can
    raise or skip.
    """
    rec_path, idx_path = rec_paths(prefix)
    if not os.path.isfile(rec_path):
        raise DataError("record file not found (a .rec path is PREFIX.rec + PREFIX.idx, "
                        "as scripts/make_rec.py writes them)", rec_path)
    rec_size = os.path.getsize(rec_path)
    if rec_size == 0:
        raise DataError("record file is empty", rec_path)
    index = read_index(idx_path)  # offsets past the end are reported per record below
    n = len(index)
    if level == "auto":
        level = "full" if n <= AUTO_FULL_CHECK_MAX else "quick"
    if level == "full":
        sel: Sequence[int] = range(n)
    elif level == "quick":
        step = max(1, n // max_quick)
        sel = sorted(set(range(0, n, step)) | {n - 1})
    else:
        raise ValueError(f"unknown check level {level!r}")
    bad, counts, bad_keys = [], set(), set()
    with open(rec_path, "rb") as f:
        for i in sel:
            key, off = index[i]
            reason, cnt = _check_one(f, rec_size, key, off, check_image, ctx_len)
            if reason is None:
                counts.add(cnt)
            else:
                bad.append((key, reason))
                bad_keys.add(key)
    good = [e for e in index if e[0] not in bad_keys]
    return RecCheck(rec_path, idx_path, n, len(sel), good, bad, counts)


def write_index(entries, idx_path: str) -> None:
    """Write ``[(key, offset)]`` as an ``.idx`` file (used to drop bad records)."""
    tmp = idx_path + ".tmp"
    with open(tmp, "w") as f:
        for k, o in entries:
            f.write(f"{k}\t{o}\n")
    os.replace(tmp, idx_path)
