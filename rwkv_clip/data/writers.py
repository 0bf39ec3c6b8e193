"""Turn image-caption pairs into training data: MXNet RecordIO or WebDataset shards.

Inputs
  * a JSONL file (one object per line) or a CSV file with a header, fields ``image``
    (path, relative paths resolved against the file's folder), ``raw`` (caption;
    ``caption``/``text`` are accepted as aliases), optional ``synthetic`` and
    ``generated`` (a missing variant repeats ``raw``);
  * a folder of img2dataset WebDataset shards (``NNNNN.tar`` holding ``key.jpg`` (or
    png/webp/jpeg) + ``key.txt`` and/or ``key.json``; the caption is the ``.txt`` or the
    json's ``caption``; json keys ``synthetic``/``generated`` are used when present);
  * parquet shards (a ``.parquet`` file, glob or brace list, or a folder of them):
    img2dataset's parquet output or the Hub's YFCC15M layout, columns as the parquet
    loader picks them (``image_column`` / ``caption_columns`` override; see
    :mod:`rwkv_clip.data.parquet`); rows with an img2dataset ``status`` other than
    ``success`` are skipped and counted; a token-id column is copied as stored.

Outputs
  * ``PREFIX.rec`` + ``PREFIX.idx`` (keys 0..N-1): IRHeader with flag 231 and the 3 x 77
    token ids as float32 labels, then JPEG bytes;
  * or WebDataset shards ``PREFIX-000000.tar``...: ``key.jpg``, ``key.tok`` (231
    little-endian int32 token ids, read by DALI with dtype INT32), ``key.txt`` (raw
    caption) and ``key.json`` (all three captions).

Images are stored as JPEG: JPEG input is copied byte for byte unless ``resize`` is set
or the JPEG is not RGB/greyscale (e.g. CMYK); other formats are re-encoded (quality
95). Every image is fully decoded once, so undecodable images are skipped here (and
counted by reason in the returned summary) rather than failing training later.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tarfile
from collections import Counter
from typing import Iterable, Iterator

import numpy as np
from PIL import Image

from .recordio import DataError, RecordIOWriter
from .tokens import NUM_LABELS, encode_captions_batch, labels_for_rec
from .wds import sample_key

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp")
JPEG_QUALITY = 95


class SkipSample(Exception):
    """Raised for one input sample that cannot be used; the message is the reason."""


# ----------------------------------------------------------------------------- inputs

def _caption_fields(obj: dict) -> tuple:
    raw = obj.get("raw")
    if raw is None:
        raw = obj.get("caption", obj.get("text"))
    return raw, obj.get("synthetic") or None, obj.get("generated") or None


def iter_pairs_file(path: str) -> Iterator[dict]:
    """Yield samples from a JSONL or CSV file of pairs."""
    if not os.path.isfile(path):
        raise DataError("input file not found", path)
    base = os.path.dirname(os.path.abspath(path))
    is_csv = path.lower().endswith((".csv", ".tsv"))
    with open(path, newline="" if is_csv else None, encoding="utf-8") as f:
        if is_csv:
            delim = "\t" if path.lower().endswith(".tsv") else ","
            rows = csv.DictReader(f, delimiter=delim)
            if rows.fieldnames is None or "image" not in rows.fieldnames:
                raise DataError("CSV input needs a header with an 'image' column", path)
            source = ((i + 2, r) for i, r in enumerate(rows))
        else:
            def _jsonl():
                for lineno, line in enumerate(f, 1):
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
            img_path = img if os.path.isabs(img) else os.path.join(base, img)
            yield {"name": name, "image_path": img_path, "raw": raw,
                   "synthetic": syn, "generated": gen}


def iter_img2dataset(folder: str) -> Iterator[dict]:
    """Yield samples from the ``*.tar`` shards of an img2dataset output folder."""
    if not os.path.isdir(folder):
        raise DataError("input folder not found", folder)
    tars = sorted(p for p in os.listdir(folder) if p.endswith(".tar"))
    if not tars:
        raise DataError("no .tar shards in folder", folder)
    for t in tars:
        path = os.path.join(folder, t)
        try:
            tf = tarfile.open(path, "r")
        except (tarfile.TarError, OSError) as e:
            yield {"name": t, "error": f"unreadable shard: {e}"}
            continue
        with tf:
            groups: dict[str, dict] = {}
            order = []
            try:
                for m in tf:
                    split = sample_key(m)
                    if split is None:
                        continue
                    key, ext = split
                    if ext not in IMAGE_EXTS + ("txt", "json"):
                        continue
                    if key not in groups:
                        groups[key] = {}
                        order.append(key)
                    groups[key][ext] = tf.extractfile(m).read()
            except (tarfile.TarError, OSError) as e:
                yield {"name": t, "error": f"truncated or corrupt shard: {e}"}
            for key in order:
                g = groups[key]
                name = f"{t}:{key}"
                img_ext = next((e for e in IMAGE_EXTS if e in g), None)
                meta = {}
                if "json" in g:
                    try:
                        meta = json.loads(g["json"].decode("utf-8"))
                    except (UnicodeDecodeError, json.JSONDecodeError):
                        meta = {}
                raw = g["txt"].decode("utf-8", "replace").strip() if "txt" in g else None
                if not raw:
                    raw = meta.get("caption") or meta.get("raw")
                if img_ext is None:
                    yield {"name": name, "error": "no image file"}
                    continue
                if meta.get("status") not in (None, "success"):
                    yield {"name": name, "error": f"img2dataset status {meta.get('status')}"}
                    continue
                yield {"name": name, "image_bytes": g[img_ext], "raw": raw,
                       "synthetic": meta.get("synthetic") or None,
                       "generated": meta.get("generated") or None}


def is_parquet_input(path: str) -> bool:
    """A ``.parquet`` file / glob / brace list, or a folder holding parquet (no .tar)."""
    if os.path.isdir(path):
        names = os.listdir(path)
        return (any(n.endswith(".parquet") for n in names)
                and not any(n.endswith(".tar") for n in names))
    return ".parquet" in path


def iter_input(path: str, image_column: str | None = None,
               caption_columns=None) -> Iterator[dict]:
    """Dispatch on the input kind (JSONL/CSV file, img2dataset folder, parquet)."""
    if is_parquet_input(path):
        from .parquet import iter_parquet_samples
        return iter_parquet_samples(path, image_column, caption_columns)
    if os.path.isdir(path):
        return iter_img2dataset(path)
    return iter_pairs_file(path)


# ----------------------------------------------------------------------------- images

def prepare_image(data: bytes, resize: int | None = None) -> bytes:
    """Validate (full decode) and return JPEG bytes; raise :class:`SkipSample` if bad."""
    try:
        im = Image.open(io.BytesIO(data))
        fmt = im.format
        im.load()
    except Exception as e:  # PIL raises many types for bad data
        raise SkipSample(f"undecodable image ({type(e).__name__})") from None
    if im.width < 1 or im.height < 1:
        raise SkipSample("empty image")
    if fmt == "JPEG" and im.mode in ("RGB", "L") and not resize:
        return data
    if im.mode != "RGB":
        if im.mode in ("RGBA", "LA", "P"):
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
            im = im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.BICUBIC)
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def _load_bytes(sample: dict) -> bytes:
    if "image_bytes" in sample:
        return sample["image_bytes"]
    p = sample["image_path"]
    try:
        with open(p, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise SkipSample("image file not found") from None
    except OSError as e:
        raise SkipSample(f"image file unreadable ({e.strerror})") from None


def _prepared(samples: Iterable[dict], resize, summary: Counter, skipped_examples: list,
              chunk: int = 256) -> Iterator[tuple[str, bytes, np.ndarray, tuple | None]]:
    """Validate samples and tokenise them in chunks -> (name, jpeg, tokens(231,), captions).

    A sample with stored ``tokens`` (231,) keeps them and has captions None.
    """
    buf = []

    def flush():
        if not buf:
            return
        texts = [b[2] for b in buf if b[3] is None]
        toks = iter(encode_captions_batch(texts)) if texts else iter(())
        for name, jpg, caps, stored in buf:
            yield name, jpg, (next(toks) if stored is None else stored), caps
        buf.clear()

    for s in samples:
        try:
            if "error" in s:
                raise SkipSample(s["error"])
            stored = s.get("tokens")
            raw = s.get("raw")
            if stored is None and (not isinstance(raw, str) or not raw.strip()):
                raise SkipSample("missing caption")
            jpg = prepare_image(_load_bytes(s), resize)
        except SkipSample as e:
            reason = str(e)
            summary["skipped: " + reason] += 1
            if len(skipped_examples) < 20:
                skipped_examples.append((s.get("name"), reason))
            continue
        caps = None if stored is not None else (raw.strip(), s.get("synthetic"),
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
              progress: bool = False, total: int | None = None) -> dict:
    """Write samples to ``PREFIX.rec``/``PREFIX.idx``; return a summary dict."""
    summary: Counter = Counter()
    examples: list = []
    writer = RecordIOWriter(prefix + ".rec", prefix + ".idx")
    with writer:
        for _, jpg, tok, _ in _prepared(_progress(samples, total, "make_rec", progress),
                                        resize, summary, examples):
            writer.write_image_record(writer.count, labels_for_rec(tok), jpg)
        if writer.count == 0:
            raise DataError("no usable samples in the input; nothing written "
                            f"({dict(summary)})", prefix + ".rec")
    return {"written": writer.count, "skipped": sum(summary.values()),
            "reasons": dict(summary), "examples": examples,
            "outputs": [prefix + ".rec", prefix + ".idx"]}


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
              total: int | None = None) -> dict:
    """Write WebDataset shards ``PREFIX-%06d.tar`` (jpg, tok, txt, json per sample)."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    summary: Counter = Counter()
    examples: list = []
    shards: list[str] = []
    tf = None
    n = 0
    try:
        for _, jpg, tok, caps in _prepared(_progress(samples, total, "make_wds", progress),
                                           resize, summary, examples):
            if n % shard_size == 0:
                if tf is not None:
                    tf.close()
                    os.replace(shards[-1] + ".tmp", shards[-1])
                shards.append(f"{prefix}-{len(shards):06d}.tar")
                tf = tarfile.open(shards[-1] + ".tmp", "w", format=tarfile.USTAR_FORMAT)
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
        raise DataError(f"no usable samples in the input; nothing written ({dict(summary)})",
                        prefix)
    return {"written": n, "skipped": sum(summary.values()), "reasons": dict(summary),
            "examples": examples, "outputs": shards}


def convert(input_path: str, output_prefix: str, fmt: str = "rec", resize: int | None = None,
            shard_size: int = 1000, progress: bool = True, image_column: str | None = None,
            caption_columns=None) -> dict:
    """One call from pairs file / img2dataset folder / parquet to rec or wds output."""
    samples = iter_input(input_path, image_column, caption_columns)
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
        return write_rec(samples, output_prefix, resize=resize, progress=progress, total=total)
    if fmt == "wds":
        return write_wds(samples, output_prefix, shard_size=shard_size, resize=resize,
                         progress=progress, total=total)
    raise ValueError(f"unknown format {fmt!r} (rec or wds)")


__all__ = ["convert", "write_rec", "write_wds", "iter_input", "iter_pairs_file", "is_parquet_input",
           "iter_img2dataset", "prepare_image", "SkipSample", "tokens_to_bytes", "NUM_LABELS"]
