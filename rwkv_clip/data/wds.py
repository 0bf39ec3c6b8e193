"""WebDataset shards with a pre-tokenised ``tok`` component: listing, indexing, checks.

Shards are written by :func:`rwkv_clip.data.writers.write_wds`; :func:`index_shards` reads
only the tar headers, so both loaders get random access and checks without unpacking.
"""

from __future__ import annotations

import glob
import os
import tarfile
from dataclasses import dataclass, field

from ..errors import DataError
from .tokens import CONTEXT_LENGTH, expected_layouts, stored_layout

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
TOK_EXT = "tok"


def _split_commas(s: str) -> list[str]:
    """Split a comma-separated list, leaving commas inside brace lists (``{a,b}``)."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(s):
        depth += (c == "{") - (c == "}")
        if c == "," and depth == 0:
            out.append(s[start:i])
            start = i + 1
    out.append(s[start:])
    return out


def list_shards(spec, ext: str = ".tar") -> list[str]:
    """Shard list from a folder (its ``*ext`` files), a glob, a brace pattern
    (``a-{000000..000009}.tar``), a ``::``/comma separated list, or a Python list.
    Raises DataError if none exist."""
    if isinstance(spec, (list, tuple)):
        items = list(spec)
    else:
        s = str(spec)
        if os.path.isdir(s):
            items = sorted(os.path.join(s, p) for p in os.listdir(s) if p.endswith(ext))
            if not items:
                raise DataError(f"no {ext} shards in folder", s)
            return items
        parts = [p for chunk in s.split("::") for p in _split_commas(chunk) if p]
        items = []
        for p in parts:
            if "{" in p:
                from braceexpand import braceexpand
                items.extend(braceexpand(p))
            elif any(c in p for c in "*?["):
                found = sorted(glob.glob(p))
                if not found:
                    raise DataError("no shards match the pattern", p)
                items.extend(found)
            else:
                items.append(p)
    for p in items:
        if not os.path.isfile(p):
            raise DataError("shard not found", p)
    if not items:
        raise DataError("no shards given", str(spec))
    return items



def sample_key(member: tarfile.TarInfo) -> tuple[str, str] | None:
    """WebDataset grouping: ``dir/stem.ext`` -> (``dir/stem``, lower-case ``ext``); None
    for members that are not files or have no extension."""
    if not member.isfile():
        return None
    folder, base = os.path.split(member.name)
    if "." not in base:
        return None
    stem, ext = base.split(".", 1)
    return (f"{folder}/{stem}" if folder else stem), ext.lower()

@dataclass
class WdsSample:
    shard: str
    key: str
    image: tuple       # (offset, size, ext)
    tok: tuple         # (offset, size)
    ordinal: int = -1  # position among all keys of the shards in order (bad ones too)


@dataclass
class WdsIndex:
    shards: list
    samples: list = field(default_factory=list)
    bad: list = field(default_factory=list)         # [(shard, key or None, reason)]
    num_keys: int = 0                               # sample keys seen, bad ones included

    def __len__(self):
        return len(self.samples)


def index_shards(paths: list[str], ctx_len: int = CONTEXT_LENGTH) -> WdsIndex:
    """Scan tar headers of every shard; collect complete samples and problems.

    A sample is the tar members sharing a key: an image (``jpg``, also
    ``jpeg``/``png``/``webp``) and ``tok`` (3 or 2 captions of ``ctx_len`` or 77
    little-endian int32 token ids);
    other members (txt, json) are ignored. Only the headers are read (an uncompressed tar
    is seekable: one small read per member), and the byte ranges returned give the torch
    loader random access and let the DALI path reject bad shards before DALI sees them.
    """
    out = WdsIndex(list(paths))
    for path in paths:
        n_before = len(out.samples)
        groups: dict[str, dict] = {}
        order = []
        try:
            if os.path.getsize(path) == 0:
                raise tarfile.ReadError("empty file")
            with tarfile.open(path, "r:") as tf:
                end = 0
                for m in tf:
                    end = m.offset_data + -(-m.size // 512) * 512
                    split = sample_key(m)
                    if split is None:
                        continue
                    key, ext = split
                    if key not in groups:
                        groups[key] = {}
                        order.append(key)
                    groups[key][ext] = (m.offset_data, m.size)
            size = os.path.getsize(path)
            # tarfile stops quietly when a cut lands on a header block: require the
            # end-of-archive marker (two zero blocks) after the last member
            with open(path, "rb") as f:
                f.seek(end)
                eoa = f.read(1024)
            if len(eoa) < 1024 or eoa.strip(b"\0"):
                raise tarfile.ReadError("no end-of-archive marker after the last member")
        except (tarfile.TarError, OSError, EOFError) as e:
            out.bad.append((path, None, f"unreadable or truncated shard ({e})"))
            continue
        for key in order:
            g = groups[key]
            ordinal = out.num_keys
            out.num_keys += 1
            img = next((e for e in IMAGE_EXTS if e in g), None)
            if img is None:
                out.bad.append((path, key, "sample has no image component"))
                continue
            if TOK_EXT not in g:
                out.bad.append((path, key, "sample has no 'tok' component (write shards "
                                           "with scripts/make_rec.py --format wds)"))
                continue
            toff, tsize = g[TOK_EXT]
            if tsize % 4 or stored_layout(tsize // 4, ctx_len) is None:
                out.bad.append((path, key, f"'tok' holds {tsize} bytes; expected int32 "
                                           f"token ids, {expected_layouts(ctx_len)}"))
                continue
            ioff, isize = g[img]
            if ioff + isize > size or toff + tsize > size:
                out.bad.append((path, key, "member data extends past the end of the shard"))
                continue
            out.samples.append(WdsSample(path, key, (ioff, isize, img), (toff, tsize),
                                         ordinal))
        if len(out.samples) == n_before and not any(b[0] == path for b in out.bad):
            out.bad.append((path, None, "empty shard (no samples)"))
    return out


def check_wds(spec, skip_corrupt: bool = False, ctx_len: int = CONTEXT_LENGTH) -> WdsIndex:
    """List + index shards; raise DataError on the first problem unless skip_corrupt."""
    idx = index_shards(list_shards(spec), ctx_len)
    if idx.bad and not skip_corrupt:
        shard, key, reason = idx.bad[0]
        more = f" (+{len(idx.bad) - 1} more problems)" if len(idx.bad) > 1 else ""
        raise DataError(reason + more, shard, key)
    if not idx.samples:
        raise DataError("no usable samples in the shards", ", ".join(idx.shards[:3]))
    return idx
