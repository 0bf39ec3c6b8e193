"""One decodability predicate for every loader: on damaged JPEGs the torch loader (PIL
through rwkv_clip.data.decoding) and DALI's CPU decoder accept and refuse the same
images, so with skip_corrupt they train on and skip the same records."""

import io
import random
from types import SimpleNamespace as NS

import numpy as np
import pytest
from PIL import Image
from test_data_common import make_samples, token_map

from rwkv_clip.data import DataError, RecordIOReader, RecordIOWriter, build_train_loader
from rwkv_clip.data.decoding import decode_image, jpeg_header_problem
from rwkv_clip.data.writers import write_rec

N = 24
# 4 and 5 are adjacent: the torch loader's stand-in for 4 meets 5 too (counted once)
DAMAGED = [1, 4, 5, 9, 12, 15, 18, 21]


def plain_pil(data: bytes, min_side: int = 32) -> Image.Image:
    """The torch loader's decoding before the shared predicate: PIL alone."""
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (min_side, min_side))
    return im.convert("RGB")


def accepts(decode, data: bytes) -> bool:
    try:
        decode(data, 32)
        return True
    except Exception:
        return False


def error_after_last_row(jpeg: bytes) -> bytes:
    """An unknown marker between the scan and EOI: libjpeg fails only after writing
    every row (PIL alone refuses it, DALI keeps the image)."""
    return jpeg[:-2] + b"\xff\x80\xff\xd9"


def junk_in_header(jpeg: bytes) -> bytes:
    """A stray byte before the quantisation table: PIL skips it, nvImageCodec's header
    parser refuses the image."""
    i = jpeg.index(b"\xff\xdb")
    return jpeg[:i] + b"\x13" + jpeg[i:]


def flipped(jpeg: bytes, rng: random.Random, n: int) -> bytes:
    """``n`` random bit flips anywhere past the start-of-image marker (these small
    images are mostly header: tables, then ~50 bytes of entropy data)."""
    b = bytearray(jpeg)
    for _ in range(n):
        b[rng.randrange(2, len(b) - 2)] ^= 1 << rng.randrange(8)
    return bytes(b)


def damaged_images(samples, seed: int = 0) -> dict:
    """key -> damaged JPEG: the margin cases (1: error after the last row; 4, 5: junk in
    the header), then seeded random flips."""
    rng = random.Random(seed)
    out = {1: error_after_last_row(samples[1]["image_bytes"]),
           4: junk_in_header(samples[4]["image_bytes"]),
           5: junk_in_header(samples[5]["image_bytes"])}
    for j, key in enumerate(DAMAGED[3:]):
        out[key] = flipped(samples[key]["image_bytes"], rng, [1, 4, 16][j % 3])
    return out


def noise_jpeg(w: int, h: int, **kw) -> bytes:
    arr = np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(arr).save(b, "JPEG", quality=90, **kw)
    return b.getvalue()


# ----------------------------------------------------------------------------- predicate

def test_good_images_decode_as_plain_pil():
    """The predicate changes nothing for good images (draft mode included)."""
    imgs = [s["image_bytes"] for s in make_samples(4)]
    imgs += [noise_jpeg(160, 120), noise_jpeg(97, 211, progressive=True),
             noise_jpeg(64, 64, subsampling=0)]
    for data in imgs:
        for side in (16, 32, 256):
            got, want = decode_image(data, side), plain_pil(data, side)
            assert got.size == want.size and got.tobytes() == want.tobytes()


def test_margin_cases():
    good = make_samples(1)[0]["image_bytes"]
    late = error_after_last_row(good)
    with pytest.raises(OSError, match="broken data stream"):
        plain_pil(late)
    # every row was decoded: the pixels are the good image's
    assert decode_image(late, 32).tobytes() == plain_pil(good).tobytes()
    junk = junk_in_header(good)
    assert accepts(plain_pil, junk)
    assert jpeg_header_problem(junk) == "invalid marker 0x13db at byte 20"
    with pytest.raises(OSError, match="broken JPEG header: invalid marker"):
        decode_image(junk, 32)
    assert jpeg_header_problem(good) is None
    assert "past the end" in jpeg_header_problem(good[:21])
    assert jpeg_header_problem(b"\x89PNG\r\n\x1a\n") == "no JPEG start-of-image marker"


# ----------------------------------------------------------------------------- vs DALI

class DaliDecodes:
    """Does DALI's CPU training decoder (image_random_crop, as in the loader) accept an
    image? A pipeline that failed is unusable, so it is rebuilt after each failure."""

    def __init__(self):
        self.pipe, self.data = None, None

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=1, num_threads=1, device_id=None, seed=1467,
                      prefetch_queue_depth=1, exec_pipelined=False, exec_async=False)
        def pipe():
            jpegs = fn.external_source(
                source=lambda: [np.frombuffer(self.data, np.uint8)], batch=True,
                dtype=types.UINT8)
            return fn.decoders.image_random_crop(
                jpegs, device="cpu", output_type=types.RGB, random_aspect_ratio=[0.8, 1.25],
                random_area=[0.7, 1.0], num_attempts=100)
        self.pipe = pipe()
        self.pipe.build()

    def __call__(self, data: bytes) -> bool:
        if self.pipe is None:
            self._build()
        self.data = data
        try:
            self.pipe.run()
            return True
        except RuntimeError:
            self.pipe = None
            return False


def test_predicate_matches_dali_cpu_decoder():
    pytest.importorskip("nvidia.dali")
    samples = make_samples(6)
    rng = random.Random(1)
    cases = []
    for s in samples:
        img = s["image_bytes"]
        cases += [img, error_after_last_row(img), junk_in_header(img)]
        cases += [flipped(img, rng, n) for n in (1, 4, 16) for _ in range(2)]
    dali = DaliDecodes()
    rows = [(accepts(plain_pil, d), accepts(decode_image, d), dali(d)) for d in cases]
    assert [r[1] for r in rows] == [r[2] for r in rows]
    # the set exercises the margin both ways: PIL alone differs from DALI
    assert any(p and not d for p, _, d in rows) and any(d and not p for p, _, d in rows)
    n_ok = sum(d for *_, d in rows)
    assert 5 <= n_ok <= len(rows) - 5, n_ok


# ----------------------------------------------------------------------------- loaders

def write_damaged_rec(path: str, damaged: dict) -> str:
    """make_samples(N) as a .rec (our writer), the images of ``damaged``'s keys replaced."""
    write_rec(make_samples(N), path + "-good")
    src = RecordIOReader(path + "-good")
    with RecordIOWriter(path + ".rec", path + ".idx") as w:
        for i in range(N):
            _, _, labels, img = src.read_item(i)
            w.write_image_record(i, labels, damaged.get(i, img))
    return path


def args(path, kind, **kw):
    a = dict(train_data=path, data_format="rec", batch_size=4, workers=1 if kind == "dali" else 0,
             input_size=16, seed=0, skip_corrupt=False, device="cpu", rank=0, world_size=1,
             loader=kind, check_level="full")
    a.update(kw)
    return NS(**a)


def epoch_ids(L, tmap) -> set:
    ids = set()
    for _, tokens in L:
        for t in tokens:
            key = tuple(int(v) for v in t)
            assert key in tmap, "tokens do not match any written caption"
            ids.add(tmap[key])
    return ids


def test_loaders_train_on_and_skip_the_same_damaged_records(tmp_path):
    pytest.importorskip("nvidia.dali")
    samples = make_samples(N)
    damaged = damaged_images(samples)
    # found by check_rec first (no EOI in the last KiB): counted once; met at run time:
    # counted each epoch
    pre = {k for k, d in damaged.items() if b"\xff\xd9" not in d[-1024:]}
    refused = {k for k, d in damaged.items() if not accepts(decode_image, d)} | pre
    assert {4, 5} <= refused and 1 not in refused and len(refused) >= 3
    assert refused != {k for k, d in damaged.items() if not accepts(plain_pil, d)}
    p = write_damaged_rec(str(tmp_path / "d"), damaged)
    tmap = token_map(N)
    got = {}
    for kind in ("torch", "dali"):
        L = build_train_loader(args(p, kind, skip_corrupt=True), log=None)
        first = epoch_ids(L, tmap)
        L.reset()
        second = epoch_ids(L, tmap)
        got[kind] = (first, second, L.skipped)
    want = set(range(N)) - refused
    assert got["torch"] == got["dali"] == (want, want, 2 * len(refused) - len(pre)), got


def test_loaders_raise_the_same_error_for_a_damaged_record(tmp_path):
    pytest.importorskip("nvidia.dali")
    samples = make_samples(N)
    damaged = {2: error_after_last_row(samples[2]["image_bytes"]),
               5: junk_in_header(samples[5]["image_bytes"])}
    p = write_damaged_rec(str(tmp_path / "e"), damaged)
    msgs = {}
    for kind in ("torch", "dali"):
        with pytest.raises(DataError) as e:
            for _ in build_train_loader(args(p, kind), log=None):
                pass
        assert e.value.path == p + ".rec" and e.value.record == 5, str(e.value)
        msgs[kind] = str(e.value).split(";")[0]
        assert "\n" not in msgs[kind]
    assert msgs["torch"] == msgs["dali"], msgs
    assert msgs["torch"].startswith("undecodable image (OSError: broken JPEG header: invalid")
