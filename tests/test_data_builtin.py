import colorsys
import json
import os
import re
from types import SimpleNamespace as NS

import numpy as np
import pytest
from PIL import Image

from rwkv_clip.data import RecordIOReader, build_train_loader, decode_tokens, ensure_builtin_dataset
from rwkv_clip.data.builtin import (
    BG_KINDS,
    COLOR_BANDS,
    COLORS,
    IMAGE_SIDES,
    RADIUS,
    SHAPES,
    SHIFTED_BG_KINDS,
    SHIFTED_RADIUS,
    class_names,
    render,
    render_shifted,
)
from rwkv_clip.data.recordio import check_rec

SMALL = dict(num_train=60, num_val=12, zeroshot_per_class=2)


def _shows(im, colour, at_least=25):
    """Enough strongly coloured pixels whose hue lies in ``colour``'s band (a few
    degrees of slack for the JPEG and the shifted split's shades)."""
    import colorsys
    px = np.asarray(im.convert("RGB"), dtype=np.float64).reshape(-1, 3) / 255
    hsv = np.array([colorsys.rgb_to_hsv(*p) for p in px])
    lo, hi = COLOR_BANDS[colour][0]
    mid, half = (lo + hi) / 2, (hi - lo) / 2 + 8
    off = np.abs((hsv[:, 0] * 360 - mid + 180) % 360 - 180)
    return ((hsv[:, 1] > 0.4) & (hsv[:, 2] > 0.35) & (off <= half)).sum() >= at_least


def _files(root):
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return ensure_builtin_dataset(root=str(tmp_path_factory.mktemp("bi")), seed=0, **SMALL)


def test_same_seed_same_bytes_other_seed_differs(ds, tmp_path):
    again = ensure_builtin_dataset(root=str(tmp_path / "a"), seed=0, **SMALL)
    assert os.path.basename(again.root) == os.path.basename(ds.root)
    a, b = _files(ds.root), _files(again.root)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    other = ensure_builtin_dataset(root=str(tmp_path / "b"), seed=1, **SMALL)
    assert os.path.basename(other.root) != os.path.basename(ds.root)
    assert (open(other.train_prefix + ".rec", "rb").read()
            != open(ds.train_prefix + ".rec", "rb").read())


def test_reused_not_regenerated(ds):
    t = os.path.getmtime(ds.train_prefix + ".rec")
    again = ensure_builtin_dataset(root=os.path.dirname(os.path.dirname(ds.root)), seed=0,
                                   **SMALL)
    assert again.root == ds.root and os.path.getmtime(ds.train_prefix + ".rec") == t
    assert not [p for p in os.listdir(os.path.dirname(ds.root)) if ".tmp-" in p]


def test_train_and_val_records(ds):
    for prefix, n in ((ds.train_prefix, ds.num_train), (ds.val_prefix, ds.num_val)):
        chk = check_rec(prefix)
        assert chk.num_records == n and not chk.bad and chk.label_counts == {231}
    r = RecordIOReader(ds.train_prefix)
    pat = re.compile(r"^an? ({}) ({})$".format("|".join(COLORS), "|".join(SHAPES)))
    sides = set()
    for i in range(len(r)):
        _, _, lab, img = r.read_item(i)
        raw, syn, gen = decode_tokens(lab)
        m = pat.match(raw)
        assert m, raw
        colour, shape = m.groups()
        assert syn == f"a drawing of {raw}" and gen not in (raw, syn)  # colour, shape only
        im = Image.open(__import__("io").BytesIO(img))
        assert im.width == im.height and im.format == "JPEG"
        assert IMAGE_SIDES[0] <= im.width <= IMAGE_SIDES[1]
        assert _shows(im, colour), raw  # the named colour is really drawn
        sides.add(im.width)
    assert len(sides) > 20
    va = open(ds.val_prefix + ".rec", "rb").read()
    assert va not in open(ds.train_prefix + ".rec", "rb").read()


@pytest.mark.parametrize("split", ["zeroshot", "zeroshot_shifted"])
def test_zeroshot_splits(ds, split):
    zs = ds.zeroshot_dir if split == "zeroshot" else ds.shifted_dir
    assert os.path.dirname(zs) == ds.root and os.path.basename(zs) == split
    names = json.load(open(os.path.join(zs, "classnames.json")))
    templates = json.load(open(os.path.join(zs, "templates.json")))
    assert names == class_names() == ds.classnames and len(names) == 30
    folders = sorted(d for d in os.listdir(zs) if os.path.isdir(os.path.join(zs, d)))
    assert [n.replace(" ", "_") for n in names] == folders   # ImageFolder order
    assert templates and all("{}" in t for t in templates)
    total = 0
    for n, f in zip(names, folders, strict=False):
        files = sorted(os.listdir(os.path.join(zs, f)))
        assert len(files) == 2
        assert all(x.endswith(".jpg" if split == "zeroshot" else ".png") for x in files)
        total += len(files)
        im = Image.open(os.path.join(zs, f, files[0]))
        inside = IMAGE_SIDES[0] <= im.width <= IMAGE_SIDES[1]
        assert inside == (split == "zeroshot")  # shifted: sides outside the training range
        assert _shows(im, n.split()[0], at_least=6), (split, n)
    assert total == ds.num_zeroshot == 60


def _in_bands(rgb, colour: str) -> bool:
    """Whether an 8-bit fill lies in the colour's training hue / saturation / value bands
    (with the slack of rounding to 8 bits)."""
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    (h0, h1), (s0, s1), (v0, v1) = COLOR_BANDS[colour]
    hue = (h * 360 - h0 + 180) % 360 - 180 + h0  # unwrapped next to the band (red: -8..8)
    return h0 - 0.6 <= hue <= h1 + 0.6 and s0 - 0.006 <= s <= s1 + 0.006 and \
        v0 - 0.004 <= v <= v1 + 0.004


def test_shifted_renderer_draws_outside_the_training_ranges():
    rng = np.random.default_rng(0)
    for _ in range(60):
        _, a = render(rng)
        _, b = render_shifted(rng)
        assert IMAGE_SIDES[0] <= a["side"] <= IMAGE_SIDES[1] and a["bg"] in BG_KINDS
        assert RADIUS[0] <= a["radius"] <= RADIUS[1]
        assert not IMAGE_SIDES[0] <= b["side"] <= IMAGE_SIDES[1]
        assert RADIUS[0] <= b["radius"] <= SHIFTED_RADIUS[1] and SHIFTED_RADIUS[1] > RADIUS[1]
        assert b["bg"] in SHIFTED_BG_KINDS and b["bg"] not in BG_KINDS
        assert _in_bands(a["fill"], a["color"]) and not _in_bands(b["fill"], b["color"])
    # the same draw, another routine: the class is fixed, the pictures differ
    one, _ = render(np.random.default_rng(5), "red", "star")
    two, _ = render_shifted(np.random.default_rng(5), "red", "star")
    assert one.size != two.size or one.tobytes() != two.tobytes()
    assert set(COLORS) == set(COLOR_BANDS) and len(SHAPES) == 5


def test_builtin_train_prefix_through_loader_factory(ds):
    a = NS(train_data=ds.train_prefix, data_format="rec", batch_size=16, workers=1,
           input_size=32, seed=0, skip_corrupt=False, device="cpu", rank=0, world_size=1,
           loader="torch")
    L = build_train_loader(a, log=None)
    images, tokens = next(iter(L))
    assert images.shape == (16, 3, 32, 32) and tokens.shape == (16, 231)
    assert len(L) == 4  # ceil(60 / 16)


@pytest.mark.slow
def test_default_size_generation_and_builtin_format(tmp_path):
    L = build_train_loader(NS(train_data=str(tmp_path), data_format="builtin", batch_size=32,
                              workers=1, input_size=32, seed=0, device="cpu", loader="auto"),
                           log=None)
    ds = ensure_builtin_dataset(root=str(tmp_path))
    assert ds.num_train == 27200 and len(L) == 850  # 27200 / 32
    images, tokens = next(iter(L))
    assert images.shape == (32, 3, 32, 32) and tokens.dtype.is_floating_point is False
