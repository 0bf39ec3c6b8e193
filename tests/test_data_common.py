"""Helpers shared by the tests/test_data_*.py files (no tests here)."""

import io
import json
import os

import numpy as np
from PIL import Image


def dali_or_skip(kind):
    """Skip a test parametrised over loaders when it asks for DALI and DALI is missing."""
    if kind == "dali":
        import pytest
        pytest.importorskip("nvidia.dali")


MEAN = np.array([0.48145466, 0.4578275, 0.40821073]) * 255
STD = np.array([0.26862954, 0.26130258, 0.27577711]) * 255


def colour_of(i):
    """A distinct, clearly separated colour per sample index."""
    return (30 + (i * 37) % 200, 30 + (i * 71) % 200, 30 + (i * 113) % 200)


def solid_image(i, w=48, h=40, fmt="JPEG"):
    im = Image.new("RGB", (w, h), colour_of(i))
    b = io.BytesIO()
    im.save(b, format=fmt, quality=98) if fmt == "JPEG" else im.save(b, format=fmt)
    return b.getvalue()


def caption(i):
    return f"caption number {i}"


def make_samples(n, fmt="JPEG", two_variants=False):
    out = []
    for i in range(n):
        out.append({"name": str(i), "image_bytes": solid_image(i, 40 + i % 7, 36 + i % 5, fmt),
                    "raw": caption(i),
                    "synthetic": f"synthetic {i}" if (i % 2 or two_variants) else None,
                    "generated": f"generated {i}" if i % 3 == 0 else None})
    return out


def token_map(n):
    """tokens tuple (231,) -> sample index, for the samples of make_samples(n)."""
    from rwkv_clip.data.tokens import encode_captions_batch
    s = make_samples_captions(n)
    toks = encode_captions_batch(s)
    return {tuple(int(v) for v in t): i for i, t in enumerate(toks)}


def make_samples_captions(n):
    return [(caption(i), f"synthetic {i}" if i % 2 else None,
             f"generated {i}" if i % 3 == 0 else None) for i in range(n)]


def expected_normalised(i):
    return (np.array(colour_of(i)) - MEAN) / STD


def check_batch_pairs(images, tokens, tmap, tol=0.08):
    """Every image is the solid colour of the sample its tokens identify; return ids."""
    ids = []
    for im, tok in zip(images, tokens, strict=False):
        key = tuple(int(v) for v in tok)
        assert key in tmap, "tokens do not match any written caption"
        i = tmap[key]
        got = im.double().mean(dim=(1, 2)).numpy()
        np.testing.assert_allclose(got, expected_normalised(i), atol=tol)
        assert float(im.double().std(dim=(1, 2)).max()) < 0.1
        ids.append(i)
    return ids


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def files_in(d):
    return sorted(os.listdir(d))
