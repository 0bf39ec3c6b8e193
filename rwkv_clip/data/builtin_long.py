"""The built-in long-caption split: scenes of a 3 x 3 grid of cells, each empty or holding
one coloured shape, on a plain background, with a caption naming every cell in reading
order and then the background: 80-120 tokens, the background named past token 77.

Its evaluation set comes in groups of :data:`GROUP` images that share every cell and
differ only in the background, so their captions differ only past token 77: a reader of
77 tokens sees the group's captions as one text and is at chance (1 / GROUP), a reader
of the whole caption is not (:mod:`rwkv_clip.eval.long_captions`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from ..tokenizer import tokenize
from .builtin import COLORS, SHAPES, _a, _encode, _outline, _place, publish_dataset
from .recordio import RecordIOWriter
from .tokens import encode_captions_batch, labels_for_rec

LONG_VERSION = "scenes-v1"
CONTEXT_LENGTH = 128  # tokens per stored caption: every caption fits whole
SHORT = 77  # the original's context length, which the background lies beyond
SIDE = 48  # image side in pixels (3 x 3 cells of 16)
EMPTY_P = 0.3
# background colours: named apart from the shapes' six colours
BACKGROUNDS = {"white": (235, 235, 235), "black": (25, 25, 25), "grey": (128, 128, 128),
               "brown": (110, 70, 35)}
GROUP = len(BACKGROUNDS)  # one evaluation group: a layout on every background
CELLS = ["top left corner", "top middle", "top right corner", "middle left", "centre",
         "middle right", "bottom left corner", "bottom middle", "bottom right corner"]


@dataclass
class Scene:
    cells: list  # per cell: None or (colour, shape)
    background: str


def draw_layout(rng: np.random.Generator) -> list:
    """Nine cells in reading order, each None (empty) or (colour, shape)."""
    colours = list(COLORS)
    return [None if rng.random() < EMPTY_P else
            (colours[rng.integers(len(colours))], SHAPES[rng.integers(len(SHAPES))])
            for _ in CELLS]


def caption(scene: Scene) -> str:
    """Every cell in reading order, then the background (past token 77)."""
    parts = []
    for where, cell in zip(CELLS, scene.cells, strict=True):
        if cell is None:
            parts.append(f"the {where} is empty")
        else:
            parts.append(f"in the {where} there is {_a(cell[0])} {cell[0]} {cell[1]}")
    return ("a picture divided into a grid of three by three cells: " + ", ".join(parts)
            + f", and the whole background of the picture is {scene.background}.")


def render(scene: Scene, rng: np.random.Generator) -> Image.Image:
    """The scene at :data:`SIDE` px: each shape placed and rotated inside its cell."""
    cell = SIDE // 3
    img = Image.new("RGB", (SIDE, SIDE), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(img)
    for k, content in enumerate(scene.cells):
        if content is None:
            continue
        colour, shape = content
        pts = _place(_outline(shape, rng), rng, rng.uniform(0.28, 0.36), cell)
        x0, y0 = (k % 3) * cell, (k // 3) * cell
        draw.polygon([(float(x) + x0, float(y) + y0) for x, y in pts], fill=COLORS[colour])
    return img


def background_position(scene: Scene) -> int:
    """Index of the background word's first token in ``tokenize(caption(scene))`` (the
    start token is index 0; a 77-token reading keeps indices 0-75 and end-of-text)."""
    head = caption(scene).rsplit(" ", 1)[0]  # the BPE splits at spaces: same tokens
    return int(tokenize([head], context_length=CONTEXT_LENGTH)[0].ne(0).sum()) - 1


@dataclass
class LongCaptionDataset:
    root: str
    train_prefix: str
    eval_file: str  # JSON: [{"image": relative path, "caption": str, "group": int}]
    num_train: int
    num_groups: int


def _scene_item(seed: int, background: str | None = None, layout_seed: int | None = None):
    rng = np.random.default_rng(seed)
    layout = draw_layout(np.random.default_rng(layout_seed) if layout_seed is not None else rng)
    bgs = list(BACKGROUNDS)
    scene = Scene(layout, background or bgs[rng.integers(len(bgs))])
    # a group shares its shapes' placement too: only the background differs
    img = render(scene, np.random.default_rng(layout_seed) if layout_seed is not None else rng)
    return img, caption(scene)


def ensure_long_caption_dataset(root: str | None = None, seed: int = 0, num_train: int = 8192,
                                num_groups: int = 64) -> LongCaptionDataset:
    """Generate (once) and return the long-caption split: ``train.rec`` (captions stored
    at :data:`CONTEXT_LENGTH` tokens) and ``eval/`` (``num_groups`` groups of
    :data:`GROUP` PNGs with ``eval.json``), under ``<root>/builtin_long/<hash>/``
    (``root``: ``$RWKV_CLIP_CACHE`` or ``~/.cache/rwkv_clip``), written through a
    temporary folder renamed into place."""
    from .builtin import default_cache_root

    spec = {"version": LONG_VERSION, "seed": int(seed), "num_train": int(num_train),
            "num_groups": int(num_groups)}
    h = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    base = os.path.join(root or default_cache_root(), "builtin_long")
    final = os.path.join(base, h)
    ds = LongCaptionDataset(final, os.path.join(final, "train"),
                            os.path.join(final, "eval", "eval.json"), int(num_train),
                            int(num_groups))
    if os.path.isfile(os.path.join(final, "done.json")):
        return ds
    os.makedirs(base, exist_ok=True)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "eval"))
    try:
        s_train, s_eval = (np.random.default_rng(s) for s in
                           np.random.SeedSequence([int(seed), 20260412]).spawn(2))
        items = [_scene_item(int(s)) for s in s_train.integers(2**63, size=int(num_train))]
        toks = encode_captions_batch([(c, None, None) for _, c in items], CONTEXT_LENGTH)
        with RecordIOWriter(os.path.join(tmp, "train.rec"), os.path.join(tmp, "train.idx")) as w:
            for i, ((img, _), t) in enumerate(zip(items, toks, strict=True)):
                w.write_image_record(i, labels_for_rec(t), _encode(img, "PNG"))
        entries = []
        for g in range(int(num_groups)):
            layout_seed = int(s_eval.integers(2**63))
            for bg in BACKGROUNDS:
                img, text = _scene_item(0, bg, layout_seed)
                name = f"{g:04d}_{bg}.png"
                img.save(os.path.join(tmp, "eval", name))
                entries.append({"image": name, "caption": text, "group": g})
        with open(os.path.join(tmp, "eval", "eval.json"), "w") as f:
            json.dump(entries, f, indent=0)
        publish_dataset(tmp, final, spec)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ds


__all__ = ["ensure_long_caption_dataset", "LongCaptionDataset", "caption", "render", "Scene",
           "draw_layout", "background_position", "BACKGROUNDS", "GROUP", "CONTEXT_LENGTH"]
