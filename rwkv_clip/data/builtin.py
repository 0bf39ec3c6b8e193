"""A built-in, procedurally generated image-text dataset (no download needed).

64 x 64 images of coloured shapes with captions naming colour and shape, a retrieval
split and a 30-class zero-shot folder (:func:`ensure_builtin_dataset`), so training and
evaluation run anywhere.
"""

from __future__ import annotations

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

BUILTIN_VERSION = "shapes-v4"  # v2: larger shapes, more distinct colours; v3: no position
# or background in the captions; v4: shapes 60-84% of the side, less jitter and rotation
IMAGE_SIZE = 64
_SS = 2  # supersampling factor for anti-aliased edges

SHAPES = ["circle", "square", "triangle", "cross", "star"]
COLORS = {  # pairwise at least ~95 apart in RGB, so a 12-level jitter never blurs them
    "red": (220, 30, 30),
    "green": (30, 165, 50),
    "blue": (30, 70, 230),
    "yellow": (240, 220, 30),
    "purple": (150, 40, 200),
    "orange": (250, 130, 0),
}
COLOR_JITTER = 12
BACKGROUNDS = {"white": 245, "light gray": 190, "dark gray": 75, "black": 15}
BG_STYLES = ["plain", "gradient", "noisy"]
# radius / S: even a small shape is ~10 px across at a 24 px input
SIZES = {"small": (0.30, 0.34), "medium": (0.34, 0.38), "large": (0.38, 0.42)}
POSITIONS = [["top left", "top", "top right"],
             ["left", "center", "right"],
             ["bottom left", "bottom", "bottom right"]]

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
    "{c} {s}, {z} sized",
    "a picture with one {z} {c} {s}",
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


# ----------------------------------------------------------------------------- rendering

def _polygon(kind: str, cx: float, cy: float, r: float, rot: float) -> list[tuple]:
    if kind == "square":
        pts = [(math.cos(rot + math.pi / 4 + k * math.pi / 2) * r * 1.0,
                math.sin(rot + math.pi / 4 + k * math.pi / 2) * r * 1.0) for k in range(4)]
    elif kind == "triangle":
        pts = [(math.cos(rot - math.pi / 2 + k * 2 * math.pi / 3) * r * 1.1,
                math.sin(rot - math.pi / 2 + k * 2 * math.pi / 3) * r * 1.1) for k in range(3)]
    elif kind == "star":
        pts = []
        for k in range(10):
            rr = r * (1.1 if k % 2 == 0 else 0.45)
            a = rot - math.pi / 2 + k * math.pi / 5
            pts.append((math.cos(a) * rr, math.sin(a) * rr))
    elif kind == "cross":
        w = 0.33 * r
        base = [(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w), (w, r), (-w, r),
                (-w, w), (-r, w), (-r, -w), (-w, -w)]
        ca, sa = math.cos(rot), math.sin(rot)
        pts = [(x * ca - y * sa, x * sa + y * ca) for x, y in base]
    else:
        raise ValueError(kind)
    return [(cx + x, cy + y) for x, y in pts]


def _background(rng: np.random.Generator, name: str, style: str, size: int) -> np.ndarray:
    level = BACKGROUNDS[name] + rng.integers(-8, 9)
    tint = rng.integers(-6, 7, size=3)
    base = np.clip(level + tint, 0, 255).astype(np.float32)
    img = np.broadcast_to(base, (size, size, 3)).copy()
    if style == "gradient":
        ramp = np.linspace(-1.0, 1.0, size, dtype=np.float32) * rng.uniform(12, 28)
        if rng.random() < 0.5:
            img += ramp[None, :, None]
        else:
            img += ramp[:, None, None]
    elif style == "noisy":
        img += rng.normal(0.0, 12.0, size=(size, size, 1)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def render(rng: np.random.Generator, size: int = IMAGE_SIZE):
    """Draw one random sample -> (PIL image, attribute dict).

    One shape (circle, square, triangle, cross, star) in one of six well-separated colours,
    with a random size, position (a jittered 3 x 3 grid), slight rotation and background;
    shapes are large so that they stay legible after the training crop and the resize to a
    small model's input.
    """
    shape = SHAPES[rng.integers(len(SHAPES))]
    color = list(COLORS)[rng.integers(len(COLORS))]
    size_name = list(SIZES)[rng.integers(len(SIZES))]
    bg = list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
    style = BG_STYLES[rng.integers(len(BG_STYLES))]
    row, col = rng.integers(3), rng.integers(3)
    S = size * _SS
    r = rng.uniform(*SIZES[size_name]) * S
    # centre of the named 3x3 cell, jittered, clamped so the shape stays inside
    margin = r * 1.1
    cell = S / 3.0
    cx: float = (col + 0.5) * cell + rng.uniform(-0.1, 0.1) * cell
    cy: float = (row + 0.5) * cell + rng.uniform(-0.1, 0.1) * cell
    cx = float(np.clip(cx, margin, S - margin))
    cy = float(np.clip(cy, margin, S - margin))
    rot = rng.uniform(-0.15, 0.15)
    fill = tuple(int(np.clip(v + rng.integers(-COLOR_JITTER, COLOR_JITTER + 1), 0, 255))
                 for v in COLORS[color])
    bg_img = Image.fromarray(_background(rng, bg, style, size)).resize(
        (S, S), Image.Resampling.NEAREST)
    draw = ImageDraw.Draw(bg_img)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon(_polygon(shape, cx, cy, r, rot), fill=fill)
    img = bg_img.resize((size, size), Image.Resampling.BOX)
    attrs = {"shape": shape, "color": color, "size": size_name, "bg": bg, "style": style,
             "position": POSITIONS[int(row)][int(col)]}
    # the clamp may have moved the shape out of its cell: name the real position
    rr = min(2, int(cy / cell))
    cc = min(2, int(cx / cell))
    attrs["position"] = POSITIONS[rr][cc]
    return img, attrs


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def captions(attrs: dict, rng: np.random.Generator) -> tuple[str, str, str]:
    """(raw, synthetic, generated) captions of one image. Every caption names the colour
    and the shape; none names the position or the background. Those are in the picture
    but not in the text on purpose: a caption that named colour, position and background
    would tell most pairs of a 64-batch apart without the shape (6 x 9 x 12 combinations),
    and the contrastive loss would then barely need shape at all."""
    c, s, z = attrs["color"], attrs["shape"], attrs["size"]
    raw = f"{_a(c)} {c} {s}"
    synthetic = f"{_a(z)} {z} {c} {s}"
    tmpl = PARAPHRASE_TEMPLATES[rng.integers(len(PARAPHRASE_TEMPLATES))]
    cw = COLOR_SYNONYMS[c][rng.integers(len(COLOR_SYNONYMS[c]))]
    sw = SHAPE_SYNONYMS[s][rng.integers(len(SHAPE_SYNONYMS[s]))]
    generated = tmpl.format(c=cw, s=sw, z=z, ac=_a(cw), as_=_a(sw))
    return raw, synthetic, generated


def _jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _write_split(prefix: str, rng: np.random.Generator, n: int, size: int) -> None:
    items = []
    for _ in range(n):
        img, attrs = render(rng, size)
        items.append((_jpeg(img), captions(attrs, rng)))
    toks = encode_captions_batch([caps for _, caps in items])
    with RecordIOWriter(prefix + ".rec", prefix + ".idx") as w:
        for i, ((jpg, _), t) in enumerate(zip(items, toks, strict=True)):
            w.write_image_record(i, labels_for_rec(t), jpg)
    with open(prefix + ".captions.jsonl", "w") as f:
        for i, (_, caps) in enumerate(items):
            f.write(json.dumps({"key": i, "raw": caps[0], "synthetic": caps[1],
                                "generated": caps[2]}) + "\n")


def _write_zeroshot(folder: str, rng: np.random.Generator, per_class: int, size: int) -> None:
    names = class_names()
    counts = {n: 0 for n in names}
    for n in names:
        os.makedirs(os.path.join(folder, n.replace(" ", "_")), exist_ok=True)
    # rejection-free: draw attributes for a fixed class by re-rendering until it matches
    # would be slow; instead fix the class by seeding a sub-generator per image
    for n in names:
        color, shape = n.split(" ", 1)
        for k in range(per_class):
            sub = np.random.default_rng(rng.integers(2**63))
            while True:
                img, attrs = render(sub, size)
                if attrs["color"] == color and attrs["shape"] == shape:
                    break
            img.save(os.path.join(folder, n.replace(" ", "_"), f"{k:04d}.jpg"),
                     format="JPEG", quality=95)
            counts[n] += 1
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
    num_train: int
    num_val: int
    num_zeroshot: int
    image_size: int
    classnames: list = field(default_factory=list)
    templates: list = field(default_factory=list)

    def __getitem__(self, k):  # dict-style access too
        return getattr(self, k)


def default_cache_root() -> str:
    return os.environ.get("RWKV_CLIP_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "rwkv_clip")


def ensure_builtin_dataset(root: str | None = None, seed: int = 0, num_train: int = 6000,
                           num_val: int = 500, zeroshot_per_class: int = 10,
                           image_size: int = IMAGE_SIZE) -> BuiltinDataset:
    """Generate (once) and return the built-in dataset.

    Training pairs (three captions each, see :func:`captions`), a held-out ``val`` .rec for
    retrieval, and a zero-shot image folder of the colour x shape classes (30) with
    ``classnames.json`` and ``templates.json``, drawn from its own random stream.
    Everything is generated deterministically from ``seed`` into
    ``<root>/builtin/<version-hash>/`` (``root``: ``$RWKV_CLIP_CACHE`` or
    ``~/.cache/rwkv_clip``), written to a temporary folder and renamed into place, so
    concurrent ranks are safe and a finished folder is reused.
    """
    spec = {"version": BUILTIN_VERSION, "seed": int(seed), "num_train": int(num_train),
            "num_val": int(num_val), "zeroshot_per_class": int(zeroshot_per_class),
            "image_size": int(image_size)}
    h = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    base = os.path.join(root or default_cache_root(), "builtin")
    final = os.path.join(base, h)
    names = class_names()
    ds = BuiltinDataset(
        root=final, train_prefix=os.path.join(final, "train"),
        val_prefix=os.path.join(final, "val"), zeroshot_dir=os.path.join(final, "zeroshot"),
        num_train=int(num_train), num_val=int(num_val),
        num_zeroshot=len(names) * int(zeroshot_per_class), image_size=int(image_size),
        classnames=names, templates=list(ZS_TEMPLATES))
    if os.path.isfile(os.path.join(final, "done.json")):
        return ds
    os.makedirs(base, exist_ok=True)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        ss = np.random.SeedSequence([int(seed), 20240611])
        s_train, s_val, s_zs = (np.random.default_rng(s) for s in ss.spawn(3))
        _write_split(os.path.join(tmp, "train"), s_train, int(num_train), int(image_size))
        if num_val > 0:
            _write_split(os.path.join(tmp, "val"), s_val, int(num_val), int(image_size))
        _write_zeroshot(os.path.join(tmp, "zeroshot"), s_zs, int(zeroshot_per_class),
                        int(image_size))
        with open(os.path.join(tmp, "done.json"), "w") as f:
            json.dump(spec, f)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "done.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ds
