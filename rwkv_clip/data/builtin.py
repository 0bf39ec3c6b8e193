"""A built-in, procedurally generated image-text dataset (no download needed).

One shape (circle, square, triangle, cross, star) in one of six colours per image, drawn
from broad ranges (module constants); captions name only colour and shape; 30 zero-shot
classes. A second held-out folder is drawn by another renderer with shades, image sides,
backgrounds and outlines outside the training ranges (:func:`render_shifted`)."""

from __future__ import annotations

import colorsys
import hashlib
import io
import json
import math
import os
import shutil
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from .recordio import RecordIOWriter
from .tokens import encode_captions_batch, labels_for_rec

BUILTIN_VERSION = "shapes-v7"
_SS = 2  # supersampling factor of the training renderer's anti-aliased edges

SHAPES = ["circle", "square", "triangle", "cross", "star"]
# colour -> (hue band in degrees, saturation band, value band) of the training images;
# neighbouring hue bands stay >= 14 degrees apart (red / orange / yellow are the close ones)
COLOR_BANDS = {
    "red": ((-8.0, 8.0), (0.70, 1.0), (0.70, 1.0)),
    "orange": ((24.0, 36.0), (0.80, 1.0), (0.88, 1.0)),
    "yellow": ((50.0, 60.0), (0.70, 1.0), (0.88, 1.0)),
    "green": ((100.0, 140.0), (0.60, 1.0), (0.45, 0.90)),
    "blue": ((210.0, 235.0), (0.65, 1.0), (0.60, 1.0)),
    "purple": ((270.0, 295.0), (0.55, 0.95), (0.50, 0.90)),
}
SHIFT_MARGINS = (4.0, 0.10, 0.08)  # how far outside each band the shifted split reaches


def _hsv(h: float, s: float, v: float) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb((h % 360.0) / 360.0, s, v)
    return int(round(r * 255)), int(round(g * 255)), int(round(b * 255))


COLORS = {c: _hsv(*(sum(band) / 2 for band in bands)) for c, bands in COLOR_BANDS.items()}
# the training ranges (radius as a fraction of the side, image side in px)
RADIUS = (0.24, 0.40)
IMAGE_SIDES = (40, 96)
BG_KINDS = {"plain": 0.45, "gradient": 0.30, "noisy": 0.25}
BG_MAX_SATURATION = 0.15
OUTLINE_P = 0.25  # a darker outline of the fill's own hue
# the shifted split: image sides and background kinds outside those ranges, shapes from the
# training range up to 10% larger (smaller ones cover under 3x3 patches of the 32 px input)
SHIFTED_RADIUS = (RADIUS[0], 0.44)
SHIFTED_SIDES = ((28, 36), (104, 128))
SHIFTED_BG_KINDS = ["checker", "stripes", "radial", "blobs"]

SHAPE_SYNONYMS = {
    "circle": ["round disc", "circular shape", "dot", "circle"],
    "square": ["box", "square shape", "block", "square"],
    "triangle": ["three-sided shape", "triangular shape", "wedge", "triangle"],
    "cross": ["plus sign", "cross shape", "plus symbol", "cross"],
    "star": ["five-pointed star", "star shape", "starburst", "star"],
}
COLOR_SYNONYMS = {
    "red": ["crimson", "scarlet", "red"],
    "green": ["emerald", "leafy green", "green"],
    "blue": ["azure", "navy blue", "blue"],
    "yellow": ["golden", "lemon yellow", "yellow"],
    "purple": ["violet", "lavender", "purple"],
    "orange": ["tangerine", "amber", "orange"],
}
PARAPHRASE_TEMPLATES = [
    "there is {ac} {c} {s}",
    "an illustration showing {as_} {s} coloured {c}",
    "{c} {s}",
    "a picture with one {c} {s}",
    "a simple graphic of {ac} {c} {s}",
]
ZS_TEMPLATES = [
    "{}.",
    "a photo of the {}.",
    "an image of the {}.",
    "a drawing of the {}.",
    "a picture showing the {}.",
    "the small {}.",
    "the large {}.",
    "the {} on a plain background.",
]


def class_names() -> list[str]:
    """Colour x shape class names, sorted like their folder names."""
    names = [f"{c} {s}" for c in COLORS for s in SHAPES]
    return sorted(names, key=lambda n: n.replace(" ", "_"))


# ----------------------------------------------------------------------------- geometry

def _outline(kind: str, rng: np.random.Generator) -> np.ndarray:
    """(N, 2) vertices of a shape of size 1 centred at 0, unrotated (y down), with its
    proportions (aspect, arm width, inner radius) drawn from the training ranges."""
    if kind == "circle":
        a = rng.uniform(0.85, 1.0)
        t = np.linspace(0.0, 2 * math.pi, 48, endpoint=False)
        return np.stack([np.cos(t), a * np.sin(t)], 1)
    if kind == "square":
        a, h = rng.uniform(0.88, 1.0), 0.85
        return np.array([(-h, -h * a), (h, -h * a), (h, h * a), (-h, h * a)])
    if kind == "triangle":
        k = rng.uniform(0.9, 1.1)
        t = -math.pi / 2 + np.arange(3) * 2 * math.pi / 3
        pts = np.stack([np.cos(t), np.sin(t)], 1) * 1.2
        pts[:, 1] = (pts[:, 1] - pts[:, 1].mean()) * k
        return pts
    if kind == "cross":
        w, L = rng.uniform(0.20, 0.40), 1.05
        return np.array([(-w, -L), (w, -L), (w, -w), (L, -w), (L, w), (w, w), (w, L),
                         (-w, L), (-w, w), (-L, w), (-L, -w), (-w, -w)])
    if kind == "star":
        inner = rng.uniform(0.38, 0.50)
        t = -math.pi / 2 + np.arange(10) * math.pi / 5
        rr = np.where(np.arange(10) % 2 == 0, 1.2, 1.2 * inner)
        return np.stack([np.cos(t) * rr, np.sin(t) * rr], 1)
    raise ValueError(kind)


def _place(pts: np.ndarray, rng: np.random.Generator, radius: float, side: float
           ) -> np.ndarray:
    """Rotate (any angle), scale by ``radius`` x ``side`` and move to a random centre that
    keeps the whole shape inside the image where it fits."""
    rot = rng.uniform(0.0, 2 * math.pi)
    c, s = math.cos(rot), math.sin(rot)
    pts = pts @ np.array([[c, s], [-s, c]]) * radius * side
    ext = np.abs(pts).max(0) + 0.02 * side
    centre = [rng.uniform(e, side - e) if 2 * e < side else side / 2 for e in ext]
    return pts + np.array(centre)


# ----------------------------------------------------------------------------- colours

def _colour(rng: np.random.Generator, name: str, shifted: bool) -> tuple[int, int, int]:
    """A shade of ``name``: inside its training bands, or (shifted) with at least one of
    hue / saturation / value just outside them."""
    bands = COLOR_BANDS[name]
    out = rng.random(3) < 0.5 if shifted else np.zeros(3, bool)
    if shifted and not out.any():
        out[rng.integers(3)] = True
    hsv = []
    for i, ((lo, hi), m) in enumerate(zip(bands, SHIFT_MARGINS, strict=True)):
        if not out[i]:
            hsv.append(rng.uniform(lo, hi))
            continue
        step = rng.uniform(0.25, 1.0) * m
        above = rng.random() < 0.5 and (i == 0 or hi < 1.0)
        hsv.append(hi + step if above else lo - step)
    return _hsv(*hsv)


def _grey(rng: np.random.Generator, smax: float, vlo: float = 0.0, vhi: float = 1.0
          ) -> np.ndarray:
    return np.array(_hsv(rng.uniform(0, 360), rng.uniform(0, smax), rng.uniform(vlo, vhi)),
                    np.float32)


# ----------------------------------------------------------------------------- backgrounds

def _grid(side: int) -> tuple[np.ndarray, np.ndarray]:
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) + 0.5
    return x, y


def _background(rng: np.random.Generator, side: int) -> tuple[np.ndarray, str]:
    """A training background (side, side, 3) float32: plain, a linear gradient between
    two greyish tones in any direction, or plain with pixel noise."""
    kinds = list(BG_KINDS)
    kind = kinds[rng.choice(len(kinds), p=list(BG_KINDS.values()))]
    a = _grey(rng, BG_MAX_SATURATION)
    img = np.broadcast_to(a, (side, side, 3)).astype(np.float32)
    if kind == "gradient":
        b = _grey(rng, BG_MAX_SATURATION)
        x, y = _grid(side)
        ang = rng.uniform(0, 2 * math.pi)
        t = (x * math.cos(ang) + y * math.sin(ang)) / side
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        img = a + (b - a) * t[..., None]
    elif kind == "noisy":
        img = img + rng.normal(0.0, rng.uniform(4, 16), size=(side, side, 1)).astype(np.float32)
    return img, kind


def _shifted_background(rng: np.random.Generator, side: int) -> tuple[np.ndarray, str]:
    """A background kind the training set never shows."""
    kind = SHIFTED_BG_KINDS[rng.integers(len(SHIFTED_BG_KINDS))]
    x, y = _grid(side)
    a = _grey(rng, BG_MAX_SATURATION)
    b = np.clip(a + rng.choice([-1, 1]) * rng.uniform(25, 60), 0, 255)
    if kind == "checker":
        p = rng.uniform(3, 8)
        t = ((np.floor(x / p) + np.floor(y / p)) % 2)
    elif kind == "stripes":
        ang, p = rng.uniform(0, math.pi), rng.uniform(4, 10)
        t = (np.floor((x * math.cos(ang) + y * math.sin(ang)) / p) % 2)
    elif kind == "radial":
        cx, cy = rng.uniform(0, side, 2)
        t = np.hypot(x - cx, y - cy) / (side * 1.2)
    else:  # blobs
        low = rng.uniform(0, 1, (4, 4)).astype(np.float32)
        t = np.asarray(Image.fromarray(low, mode="F").resize(
            (side, side), Image.Resampling.BICUBIC), np.float32)
    img = a + (b - a) * np.clip(t, 0, 1)[..., None]
    return img.astype(np.float32), kind


# ----------------------------------------------------------------------------- rendering

def _pick_class(rng: np.random.Generator, color: str | None, shape: str | None):
    c = list(COLORS)[rng.integers(len(COLORS))]
    s = SHAPES[rng.integers(len(SHAPES))]
    return color or c, shape or s


def render(rng: np.random.Generator, color: str | None = None, shape: str | None = None):
    """Draw one training-distribution sample with PIL's ImageDraw (supersampled polygons)
    -> (PIL image, attribute dict); ``color`` / ``shape`` fix the class."""
    color, shape = _pick_class(rng, color, shape)
    side = int(rng.integers(IMAGE_SIDES[0], IMAGE_SIDES[1] + 1))
    radius = rng.uniform(*RADIUS)
    fill = _colour(rng, color, shifted=False)
    bg, kind = _background(rng, side)
    S = side * _SS
    pts = _place(_outline(shape, rng), rng, radius, S)
    canvas = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8)).resize(
        (S, S), Image.Resampling.NEAREST)
    draw = ImageDraw.Draw(canvas)
    xy = [(float(x), float(y)) for x, y in pts]
    if rng.random() < OUTLINE_P:
        dark = tuple(int(v * rng.uniform(0.45, 0.7)) for v in fill)
        width = max(1, int(round(rng.uniform(0.04, 0.09) * radius * S)))
        draw.polygon(xy, fill=fill, outline=dark, width=width)
    else:
        draw.polygon(xy, fill=fill)
    img = canvas.resize((side, side), Image.Resampling.BOX)
    return img, {"shape": shape, "color": color, "side": side, "radius": float(radius),
                 "bg": kind, "fill": fill}


def _polygon_sdf(x: np.ndarray, y: np.ndarray, pts: np.ndarray) -> np.ndarray:
    """Signed distance (negative inside) from every pixel centre to a closed polygon."""
    d2 = np.full(x.shape, np.inf, np.float32)
    inside = np.zeros(x.shape, bool)
    n = len(pts)
    for i in range(n):
        ax, ay = pts[i]
        bx, by = pts[i - 1]
        ex, ey = bx - ax, by - ay
        wx, wy = x - ax, y - ay
        t = np.clip((wx * ex + wy * ey) / (ex * ex + ey * ey), 0.0, 1.0)
        d2 = np.minimum(d2, (wx - ex * t) ** 2 + (wy - ey * t) ** 2)
        c1, c2, c3 = y >= ay, y < by, ex * wy > ey * wx
        inside ^= (c1 & c2 & c3) | (~c1 & ~c2 & ~c3)
    return np.where(inside, -1.0, 1.0) * np.sqrt(d2)


def render_shifted(rng: np.random.Generator, color: str | None = None,
                   shape: str | None = None):
    """Draw one sample of the shifted split: a numpy signed-distance rasteriser (analytic
    anti-aliasing, no supersampling), shades, image sides and background kinds outside the
    training ranges, sizes up to 10% past the largest, squares often with rounded corners,
    sometimes a black or white outline (training outlines are a darker shade of the fill)."""
    color, shape = _pick_class(rng, color, shape)
    lo, hi = SHIFTED_SIDES[rng.integers(len(SHIFTED_SIDES))]
    side = int(rng.integers(lo, hi + 1))
    radius = rng.uniform(*SHIFTED_RADIUS)
    fill_rgb = _colour(rng, color, shifted=True)
    fill = np.array(fill_rgb, np.float32)
    img, kind = _shifted_background(rng, side)
    pts = _outline(shape, rng)
    round_by = 0.0
    if shape == "square" and rng.random() < 0.6:  # rounded corners
        round_by = rng.uniform(0.25, 0.45) * 0.85
        pts = np.array([(-0.85, -0.85), (0.85, -0.85), (0.85, 0.85), (-0.85, 0.85)])
        pts = pts * (1 - round_by / 0.85)
    pts = _place(pts, rng, radius, side)
    x, y = _grid(side)
    d = _polygon_sdf(x, y, pts) - round_by * radius * side
    cover = np.clip(0.5 - d, 0.0, 1.0)[..., None]
    img = img * (1 - cover) + fill * cover
    if rng.random() < 0.35 and radius * side > 10:  # an outline leaves a small one no fill
        ink = np.float32(0.0 if rng.random() < 0.6 else 255.0)
        width = rng.uniform(1.0, 1.6)
        band = np.clip(0.5 - np.abs(d + width / 2) + width / 2, 0.0, 1.0)[..., None]
        img = img * (1 - band) + ink * band
    out = Image.fromarray(np.clip(np.round(img), 0, 255).astype(np.uint8))
    return out, {"shape": shape, "color": color, "side": side, "radius": float(radius),
                 "bg": kind, "fill": fill_rgb}


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def captions(attrs: dict, rng: np.random.Generator) -> tuple[str, str, str]:
    """(raw, synthetic, generated) captions of one image. Every caption names the colour
    and the shape and nothing else that is drawn: a caption that also named position or
    background would tell most pairs of a batch apart without the shape, and the
    contrastive loss would then barely need shape at all (zero-shot top-1 near 35%)."""
    c, s = attrs["color"], attrs["shape"]
    raw = f"{_a(c)} {c} {s}"
    synthetic = f"a drawing of {_a(c)} {c} {s}"
    tmpl = PARAPHRASE_TEMPLATES[rng.integers(len(PARAPHRASE_TEMPLATES))]
    cw = COLOR_SYNONYMS[c][rng.integers(len(COLOR_SYNONYMS[c]))]
    sw = SHAPE_SYNONYMS[s][rng.integers(len(SHAPE_SYNONYMS[s]))]
    generated = tmpl.format(c=cw, s=sw, ac=_a(cw), as_=_a(sw))
    return raw, synthetic, generated


# ----------------------------------------------------------------------------- writing

def _encode(img: Image.Image, fmt: str, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.save(buf, format="JPEG", quality=quality)
    else:
        img.save(buf, format=fmt)
    return buf.getvalue()


def _train_item(seed: int) -> tuple[bytes, tuple[str, str, str]]:
    rng = np.random.default_rng(seed)
    img, attrs = render(rng)
    return _encode(img, "JPEG", int(rng.integers(70, 96))), captions(attrs, rng)


def _write_split(prefix: str, rng: np.random.Generator, n: int) -> None:
    items = [_train_item(int(s)) for s in rng.integers(2**63, size=n)]
    toks = encode_captions_batch([caps for _, caps in items])
    with RecordIOWriter(prefix + ".rec", prefix + ".idx") as w:
        for i, ((jpg, _), t) in enumerate(zip(items, toks, strict=True)):
            w.write_image_record(i, labels_for_rec(t), jpg)
    with open(prefix + ".captions.jsonl", "w") as f:
        for i, (_, caps) in enumerate(items):
            f.write(json.dumps({"key": i, "raw": caps[0], "synthetic": caps[1],
                                "generated": caps[2]}) + "\n")


def _write_zeroshot(folder: str, rng: np.random.Generator, per_class: int,
                    shifted: bool = False) -> None:
    """One sub-folder per class (``red_star``), ``classnames.json``, ``templates.json``;
    JPEGs from :func:`render`, or PNGs from :func:`render_shifted`."""
    names = class_names()
    draw, fmt, ext = (render_shifted, "PNG", "png") if shifted else (render, "JPEG", "jpg")
    for n in names:
        color, shape = n.split(" ", 1)
        sub = os.path.join(folder, n.replace(" ", "_"))
        os.makedirs(sub, exist_ok=True)
        for k in range(per_class):
            img, _ = draw(np.random.default_rng(rng.integers(2**63)), color, shape)
            with open(os.path.join(sub, f"{k:04d}.{ext}"), "wb") as f:
                f.write(_encode(img, fmt))
    with open(os.path.join(folder, "classnames.json"), "w") as f:
        json.dump(names, f, indent=1)
    with open(os.path.join(folder, "templates.json"), "w") as f:
        json.dump(ZS_TEMPLATES, f, indent=1)


# ----------------------------------------------------------------------------- public API

@dataclass
class BuiltinDataset:
    root: str
    train_prefix: str
    val_prefix: str
    zeroshot_dir: str
    shifted_dir: str
    num_train: int
    num_val: int
    num_zeroshot: int
    classnames: list = field(default_factory=list)
    templates: list = field(default_factory=list)

    def __getitem__(self, k):  # dict-style access too
        return getattr(self, k)


def default_cache_root() -> str:
    return os.environ.get("RWKV_CLIP_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "rwkv_clip")


def publish_dataset(tmp: str, final: str, spec: dict) -> None:
    """Mark the finished folder ``tmp`` with ``done.json`` and rename it to ``final`` in one
    step; a concurrent writer that finished first wins."""
    with open(os.path.join(tmp, "done.json"), "w") as f:
        json.dump(spec, f)
    try:
        os.rename(tmp, final)
    except OSError:
        if not os.path.isfile(os.path.join(final, "done.json")):
            raise


def ensure_builtin_dataset(root: str | None = None, seed: int = 0, num_train: int = 27200,
                           num_val: int = 500, zeroshot_per_class: int = 10
                           ) -> BuiltinDataset:
    """Generate (once) and return the built-in dataset: ``train`` and ``val`` .rec files
    (the val pairs serve retrieval), the held-out zero-shot folder ``zeroshot`` (the
    training renderer and ranges) and ``zeroshot_shifted`` (:func:`render_shifted`), each
    split from its own random stream of ``seed``, ``zeroshot_per_class`` images per class.
    Written into ``<root>/builtin/<hash of the settings and BUILTIN_VERSION>/`` (``root``:
    ``$RWKV_CLIP_CACHE`` or ``~/.cache/rwkv_clip``) through a temporary folder renamed
    into place, so concurrent ranks are safe and a finished folder is reused."""
    spec = {"version": BUILTIN_VERSION, "seed": int(seed), "num_train": int(num_train),
            "num_val": int(num_val), "zeroshot_per_class": int(zeroshot_per_class)}
    h = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    base = os.path.join(root or default_cache_root(), "builtin")
    final = os.path.join(base, h)
    names = class_names()
    ds = BuiltinDataset(
        root=final, train_prefix=os.path.join(final, "train"),
        val_prefix=os.path.join(final, "val"), zeroshot_dir=os.path.join(final, "zeroshot"),
        shifted_dir=os.path.join(final, "zeroshot_shifted"),
        num_train=int(num_train), num_val=int(num_val),
        num_zeroshot=len(names) * int(zeroshot_per_class),
        classnames=names, templates=list(ZS_TEMPLATES))
    if os.path.isfile(os.path.join(final, "done.json")):
        return ds
    os.makedirs(base, exist_ok=True)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        ss = np.random.SeedSequence([int(seed), 20240611])
        s_train, s_val, s_zs, s_shift = (np.random.default_rng(s) for s in ss.spawn(4))
        _write_split(os.path.join(tmp, "train"), s_train, int(num_train))
        if num_val > 0:
            _write_split(os.path.join(tmp, "val"), s_val, int(num_val))
        _write_zeroshot(os.path.join(tmp, "zeroshot"), s_zs, int(zeroshot_per_class))
        _write_zeroshot(os.path.join(tmp, "zeroshot_shifted"), s_shift,
                        int(zeroshot_per_class), shifted=True)
        publish_dataset(tmp, final, spec)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ds
