"""Turn image-caption pairs into training data: MXNet RecordIO or WebDataset shards.

Inputs are JSONL/CSV pairs, img2dataset output or parquet shards; every image is decoded
once while writing, so undecodable ones are skipped and counted here rather than failing
training later. The file layouts are in docs/data.md.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from PIL import Image

from ..errors import DataError
from ..text_files import EMPTY_CAPTION, check_encoding, is_empty_caption, text_lines
from .recordio import RecordIOWriter
from .tokens import CONTEXT_LENGTH, NUM_LABELS, encode_captions_batch, labels_for_rec
from .wds import sample_key

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp")
JPEG_QUALITY = 95


class SkipSample(Exception):
    """Raised for one input sample that cannot be used; the message is the reason (what
    the summary counts), ``detail`` what is particular to the sample (the path tried)."""

    def __init__(self, reason: str, detail: str | None = None):
        super().__init__(reason)
        self.detail = detail


# ----------------------------------------------------------------------------- inputs

def _caption_fields(obj: dict) -> tuple:
    raw = obj.get("raw")
    if raw is None:
        raw = obj.get("caption", obj.get("text"))
    return raw, obj.get("synthetic") or None, obj.get("generated") or None


def _csv_rows(lines: Iterator[str], path: str) -> Iterator[tuple[int, dict]]:
    """(line, row) of a CSV/TSV read by the csv module (quoted fields may hold the
    delimiter and line breaks). A row with more fields than the header is an error naming
    its line: the caption of ``a.jpg,a red square, on white`` would otherwise be cut at
    the unquoted comma."""
    delim = "\t" if path.lower().endswith(".tsv") else ","
    rows = csv.DictReader(lines, delimiter=delim)
    if rows.fieldnames is None or "image" not in rows.fieldnames:
        raise DataError("CSV input needs a header with an 'image' column", path)
    header = len(rows.fieldnames)
    for row in rows:
        if None in row:  # DictReader puts the fields past the header under None
            n = header + len(row[None])
            sep = "tab" if delim == "\t" else "comma"
            raise DataError(f"row at line {rows.line_num} has {n} fields but the header has "
                            f"{header} ({', '.join(rows.fieldnames)}); put a caption that "
                            f"holds a {sep} in double quotes", f"{path}:{rows.line_num}")
        yield rows.line_num, row


def iter_pairs_file(path: str, encoding: str = "utf-8") -> Iterator[dict]:
    """Yield samples from a JSONL or CSV file of pairs (text in ``encoding``)."""
    if not os.path.isfile(path):
        raise DataError("input file not found", path)
    check_encoding(encoding, path)
    base = os.path.dirname(os.path.abspath(path))
    is_csv = path.lower().endswith((".csv", ".tsv"))
    with open(path, "rb") as f:
        lines = text_lines(f, path, encoding)
        if is_csv:
            source = _csv_rows(lines, path)
        else:
            def _jsonl():
                for lineno, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        yield lineno, json.loads(line)
                    except json.JSONDecodeError as e:
                        yield lineno, SkipSample(f"bad JSON: {e.msg}")
            source = _jsonl()
        for lineno, obj in source:
            name = f"{os.path.basename(path)}:{lineno}"
            if isinstance(obj, SkipSample):
                yield {"name": name, "error": str(obj)}
                continue
            img = obj.get("image")
            raw, syn, gen = _caption_fields(obj)
            if not img:
                yield {"name": name, "error": "no image path"}
                continue
            relative = not os.path.isabs(img)
            img_path = os.path.join(base, img) if relative else img
            yield {"name": name, "image_path": img_path, "raw": raw,
                   "synthetic": syn, "generated": gen,
                   "image_note": f"{img!r} is relative to the folder of {os.path.basename(path)}"
                   if relative else None}


def _group_sample(name: str, g: dict) -> dict:
    """One img2dataset sample from its files by extension (image, txt, json)."""
    img_ext = next((e for e in IMAGE_EXTS if e in g), None)
    meta = {}
    if "json" in g:
        try:
            meta = json.loads(g["json"].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            meta = {}
        if not isinstance(meta, dict):
            meta = {}
    raw = None
    if "txt" in g:
        try:
            raw = g["txt"].decode("utf-8").strip()
        except UnicodeDecodeError as e:  # img2dataset writes UTF-8: the file is damaged
            raise DataError(f"caption is not valid utf-8 text ({e.reason} at byte {e.start}); "
                            "img2dataset writes UTF-8, so the file is damaged: fix or remove "
                            "the sample", f"{name}.txt") from None
    if not raw:
        raw = meta.get("caption") or meta.get("raw")
    if img_ext is None:
        return {"name": name, "error": "no image file"}
    if meta.get("status") not in (None, "success"):
        return {"name": name, "error": f"img2dataset status {meta.get('status')}"}
    return {"name": name, "image_bytes": g[img_ext], "raw": raw,
            "synthetic": meta.get("synthetic") or None,
            "generated": meta.get("generated") or None}


def _split_name(fname: str) -> tuple[str, str] | None:
    stem, dot, ext = fname.rpartition(".")
    ext = ext.lower()
    if not dot or not stem or ext not in IMAGE_EXTS + ("txt", "json"):
        return None
    return stem, ext


def files_layout_dirs(folder: str) -> list[str]:
    """The sub-folders of an img2dataset ``files`` output (``00000/000000000.jpg`` +
    ``.txt`` + ``.json``) that hold images, sorted; [] when it is not that layout."""
    out = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_dir() and any((split := _split_name(n)) and split[1] in IMAGE_EXTS
                                  for n in os.listdir(entry.path)):
            out.append(entry.path)
    return out


def iter_img2dataset_files(folder: str) -> Iterator[dict]:
    """Yield samples from img2dataset's ``files`` output layout (see files_layout_dirs)."""
    for d in files_layout_dirs(folder):
        groups: dict[str, dict] = {}
        for fname in sorted(os.listdir(d)):
            split = _split_name(fname)
            if split is None:
                continue
            try:
                with open(os.path.join(d, fname), "rb") as f:
                    groups.setdefault(split[0], {})[split[1]] = f.read()
            except OSError as e:
                yield {"name": f"{os.path.basename(d)}/{fname}",
                       "error": f"unreadable file ({e.strerror})"}
        for key, g in groups.items():
            yield _group_sample(f"{os.path.basename(d)}/{key}", g)


def iter_img2dataset(folder: str) -> Iterator[dict]:
    """Yield samples from an img2dataset output folder: its ``*.tar`` shards, or its
    ``files`` layout when it has no shards."""
    if not os.path.isdir(folder):
        raise DataError("input folder not found", folder)
    tars = sorted(p for p in os.listdir(folder) if p.endswith(".tar"))
    if not tars:
        if files_layout_dirs(folder):
            yield from iter_img2dataset_files(folder)
            return
        raise DataError("no .tar shards and no img2dataset 'files' sub-folders "
                        "(00000/000000000.jpg + .txt) in folder", folder)
    for t in tars:
        path = os.path.join(folder, t)
        try:
            tf = tarfile.open(path, "r")
        except (tarfile.TarError, OSError) as e:
            yield {"name": t, "error": f"unreadable shard: {e}"}
            continue
        with tf:
            groups: dict[str, dict] = {}
            try:
                for m in tf:
                    split = sample_key(m)
                    if split is None:
                        continue
                    key, ext = split
                    if ext not in IMAGE_EXTS + ("txt", "json"):
                        continue
                    member = tf.extractfile(m)
                    if member is not None:
                        groups.setdefault(key, {})[ext] = member.read()
            except (tarfile.TarError, OSError) as e:
                yield {"name": t, "error": f"truncated or corrupt shard: {e}"}
            for key, g in groups.items():
                yield _group_sample(f"{t}:{key}", g)


def is_parquet_input(path: str) -> bool:
    """A ``.parquet`` file / glob / brace list, or a folder holding parquet (no .tar)."""
    if os.path.isdir(path):  # img2dataset writes .parquet metadata beside tar / files output
        names = os.listdir(path)
        return (any(n.endswith(".parquet") for n in names)
                and not any(n.endswith(".tar") for n in names)
                and not files_layout_dirs(path))
    return ".parquet" in path


def iter_input(path: str, image_column: str | None = None,
               caption_columns=None, encoding: str = "utf-8",
               context_length: int = CONTEXT_LENGTH) -> Iterator[dict]:
    """Dispatch on the input kind (JSONL/CSV file, img2dataset folder, parquet)."""
    if is_parquet_input(path):
        from .parquet import iter_parquet_samples
        return iter_parquet_samples(path, image_column, caption_columns, context_length)
    if os.path.isdir(path):
        return iter_img2dataset(path)
    return iter_pairs_file(path, encoding)


# ----------------------------------------------------------------------------- images

def prepare_image(data: bytes, resize: int | None = None) -> bytes:
    """Validate (full decode) and return JPEG bytes; raise :class:`SkipSample` if bad."""
    try:
        im: Image.Image = Image.open(io.BytesIO(data))
        fmt = im.format
        im.load()
    except Exception as e:  # PIL raises many types for bad data
        raise SkipSample(f"undecodable image ({type(e).__name__})") from None
    if im.width < 1 or im.height < 1:
        raise SkipSample("empty image")
    if fmt == "JPEG" and im.mode in ("RGB", "L") and not resize:
        return data
    if im.mode != "RGB":
        if im.mode.startswith(("I", "F")):  # 16-bit / 32-bit integer or float pixels
            im = to_8bit(im)
        if im.mode in ("RGBA", "LA", "P", "PA"):
            im = im.convert("RGBA")
            bg = Image.new("RGB", im.size, (255, 255, 255))
            bg.paste(im, mask=im.split()[-1])
            im = bg
        else:
            im = im.convert("RGB")
    if resize:
        w, h = im.size
        s = resize / min(w, h)
        if s < 1.0:  # only shrink
            im = im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def to_8bit(im: Image.Image) -> Image.Image:
    """A high-bit-depth single-channel image (mode I;16*, I or F) -> mode L.

    ``convert('L'/'RGB')`` clips such values at 255, which turns a 16-bit image almost
    white. Integer images are scaled from their type's range (I;16: 0-65535; I, which
    Pillow also uses for 16-bit PNGs: 0-65535 when the values fit, else their own
    min-max); float images from [0, 1] when the values lie there, from [0, 255] when
    they lie there, else from their own min-max. Non-finite values become 0.
    """
    a = np.asarray(im).astype(np.float64)
    a[~np.isfinite(a)] = 0.0
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if im.mode.startswith("I;16") or (im.mode == "I" and lo >= 0 and hi <= 65535):
        lo, hi = 0.0, 65535.0
    elif im.mode == "F" and lo >= 0 and hi <= 1:
        lo, hi = 0.0, 1.0
    elif im.mode == "F" and lo >= 0 and hi <= 255:
        lo, hi = 0.0, 255.0
    scale = 255.0 / (hi - lo) if hi > lo else 0.0
    out = np.clip(np.rint((a - lo) * scale), 0, 255).astype(np.uint8)
    return Image.fromarray(out, mode="L")


def _load_bytes(sample: dict) -> bytes:
    if "image_bytes" in sample:
        return sample["image_bytes"]
    p = sample["image_path"]
    tried = f"tried {p}" + (f"; {sample['image_note']}" if sample.get("image_note") else "")
    try:
        with open(p, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise SkipSample("image file not found", tried) from None
    except OSError as e:
        raise SkipSample(f"image file unreadable ({e.strerror})", tried) from None


def _prepared(samples: Iterable[dict], resize, summary: Counter, skipped_examples: list,
              chunk: int = 256, context_length: int = CONTEXT_LENGTH
              ) -> Iterator[tuple[str, bytes, np.ndarray, tuple | None]]:
    """Validate samples and tokenise them in chunks -> (name, jpeg, tokens (3 L,),
    captions), L = ``context_length`` tokens per caption.

    A sample with stored ``tokens`` (3 L,) keeps them and has captions None.
    """
    buf: list[tuple[Any, bytes, tuple | None, Any]] = []

    def flush():
        if not buf:
            return
        texts = [b[2] for b in buf if b[3] is None and b[2] is not None]
        toks = iter(encode_captions_batch(texts, context_length)) if texts else iter(())
        for name, jpg, caps, stored in buf:
            yield name, jpg, (next(toks) if stored is None else stored), caps
        buf.clear()

    for s in samples:
        try:
            if "error" in s:
                raise SkipSample(s["error"], s.get("detail"))
            stored = s.get("tokens")
            raw = s.get("raw")
            if stored is None and is_empty_caption(raw):
                raise SkipSample(EMPTY_CAPTION)
            jpg = prepare_image(_load_bytes(s), resize)
        except SkipSample as e:
            reason = str(e)
            summary["skipped: " + reason] += 1
            if len(skipped_examples) < 20:
                skipped_examples.append((s.get("name"), reason + (f" ({e.detail})" if e.detail
                                                                  else "")))
            continue
        caps = None if stored is not None else (str(raw).strip(), s.get("synthetic"),
                                                s.get("generated"))
        buf.append((s.get("name"), jpg, caps, stored))
        if len(buf) >= chunk:
            yield from flush()
    yield from flush()


# ----------------------------------------------------------------------------- writers

def _progress(it, total=None, desc="", enabled=True):
    if not enabled:
        return it
    from tqdm import tqdm
    return tqdm(it, total=total, desc=desc, unit="img")


def write_rec(samples: Iterable[dict], prefix: str, resize: int | None = None,
              progress: bool = False, total: int | None = None,
              context_length: int = CONTEXT_LENGTH) -> dict:
    """Write samples to ``PREFIX.rec``/``PREFIX.idx`` (captions of ``context_length``
    tokens); return a summary dict."""
    check_positive(context_length, "context_length")
    check_positive(resize, "resize")
    summary: Counter = Counter()
    examples: list = []
    writer = RecordIOWriter(prefix + ".rec", prefix + ".idx")
    with writer:
        for _, jpg, tok, _ in _prepared(_progress(samples, total, "make_rec", progress),
                                        resize, summary, examples,
                                        context_length=context_length):
            writer.write_image_record(writer.count, labels_for_rec(tok), jpg)
        if writer.count == 0:
            raise nothing_written(summary, examples, prefix + ".rec")
    return {"written": writer.count, "skipped": sum(summary.values()),
            "reasons": dict(summary), "examples": examples,
            "outputs": [prefix + ".rec", prefix + ".idx"]}


def nothing_written(summary: Counter, examples: list, output: str) -> DataError:
    """Every sample was skipped: the error says so first, then the reasons and examples."""
    lines = [f"no usable samples in the input; nothing written to {output}"]
    lines += [f"{n} x {reason.removeprefix('skipped: ')}" for reason, n in summary.most_common()]
    lines += [f"e.g. {name}: {reason}" for name, reason in examples[:5]]
    return DataError("\n".join(lines))


def tokens_to_bytes(tok: np.ndarray) -> bytes:
    return np.asarray(tok, dtype="<i4").reshape(-1).tobytes()


def _add(tf: tarfile.TarFile, name: str, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    tf.addfile(info, io.BytesIO(data))


def write_wds(samples: Iterable[dict], prefix: str, shard_size: int = 1000,
              resize: int | None = None, progress: bool = False,
              total: int | None = None, context_length: int = CONTEXT_LENGTH) -> dict:
    """Write WebDataset shards ``PREFIX-%06d.tar`` (jpg, tok, txt, json per sample;
    captions of ``context_length`` tokens)."""
    check_positive(shard_size, "shard_size")
    check_positive(context_length, "context_length")
    check_positive(resize, "resize")
    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    summary: Counter = Counter()
    examples: list = []
    shards: list[str] = []
    tf: tarfile.TarFile | None = None
    n = 0
    try:
        for _, jpg, tok, caps in _prepared(_progress(samples, total, "make_wds", progress),
                                           resize, summary, examples,
                                           context_length=context_length):
            if n % shard_size == 0:
                if tf is not None:
                    tf.close()
                    os.replace(shards[-1] + ".tmp", shards[-1])
                shards.append(f"{prefix}-{len(shards):06d}.tar")
                tf = tarfile.open(shards[-1] + ".tmp", "w", format=tarfile.USTAR_FORMAT)
            assert tf is not None
            key = f"{n:09d}"
            _add(tf, key + ".jpg", jpg)
            _add(tf, key + ".tok", tokens_to_bytes(tok))
            if caps is not None:  # stored token ids come without their caption text
                raw = caps[0]
                _add(tf, key + ".txt", raw.encode("utf-8"))
                _add(tf, key + ".json", json.dumps(
                    {"raw": raw, "synthetic": caps[1] or raw, "generated": caps[2] or raw},
                    ensure_ascii=False).encode("utf-8"))
            n += 1
        if tf is not None:
            tf.close()
            os.replace(shards[-1] + ".tmp", shards[-1])
            tf = None
    finally:
        if tf is not None:
            tf.close()
            os.remove(shards[-1] + ".tmp")
            shards.pop()
    if n == 0:
        raise nothing_written(summary, examples, prefix + "-*.tar")
    return {"written": n, "skipped": sum(summary.values()), "reasons": dict(summary),
            "examples": examples, "outputs": shards}


def check_positive(value, name: str) -> None:
    """``resize`` / ``shard_size`` must be whole numbers >= 1 (a non-positive resize made
    every image 1x1; a zero shard size divided by zero)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise DataError(f"{name} must be a whole number >= 1, got {value!r}")


def convert(input_path: str, output_prefix: str, fmt: str = "rec", resize: int | None = None,
            shard_size: int = 1000, progress: bool = True, image_column: str | None = None,
            caption_columns=None, encoding: str = "utf-8",
            context_length: int = CONTEXT_LENGTH) -> dict:
    """One call from pairs file / img2dataset folder / parquet to rec or wds output
    (``encoding``: of a JSONL/CSV pairs file; ``context_length``: tokens per stored
    caption, 77 as the original's data, or the ``--ctx-len`` of a long-caption model)."""
    check_positive(resize, "resize")
    check_positive(shard_size, "shard_size")
    check_positive(context_length, "context_length")
    samples = iter_input(input_path, image_column, caption_columns, encoding, context_length)
    total = None
    if is_parquet_input(input_path):
        from .parquet import count_parquet_rows
        total = count_parquet_rows(input_path)
    elif os.path.isfile(input_path):
        with open(input_path, "rb") as f:
            total = sum(1 for line in f if line.strip())
        if input_path.lower().endswith((".csv", ".tsv")):
            total -= 1
    if fmt == "rec":
        return write_rec(samples, output_prefix, resize=resize, progress=progress, total=total,
                         context_length=context_length)
    if fmt == "wds":
        return write_wds(samples, output_prefix, shard_size=shard_size, resize=resize,
                         progress=progress, total=total, context_length=context_length)
    raise ValueError(f"unknown format {fmt!r} (rec or wds)")


__all__ = ["convert", "write_rec", "write_wds", "iter_input", "iter_pairs_file",
           "is_parquet_input", "iter_img2dataset", "iter_img2dataset_files", "prepare_image",
           "to_8bit", "SkipSample", "tokens_to_bytes", "NUM_LABELS"]
