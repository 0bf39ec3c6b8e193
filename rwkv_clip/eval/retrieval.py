"""Zero-shot image-text retrieval: MSCOCO 5k / Flickr30k 1k test splits, or any JSONL.

Reads JSONL pairs, the Karpathy-split files, long-caption sets in their published layouts
(Urban1k's image/ + caption/ folders, ShareGPT4V/DCI-style JSON) (docs/evaluation.md) and
reports CLIP_benchmark's image->text and text->image recall@1/5/10.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DatasetNotFoundError, EvalError
from ..text_files import check_caption, read_text
from .common import encode_images_gathered, encode_texts
from .datasets import ImageListDataset
from .distributed import DistInfo, current, fail_together, gather_rows, shard_range
from .metrics import retrieval_metrics

ORIGINAL_CAPTION_PREFIX = "a photo of "
RETRIEVAL_ALIASES = {"coco": "mscoco", "mscoco_captions": "mscoco", "mscoco": "mscoco",
                     "flickr": "flickr30k", "flickr30k": "flickr30k",
                     "urban1k": "urban1k", "urban-1k": "urban1k",
                     "sharegpt4v": "sharegpt4v", "dci": "dci"}
FILE_SETS = ("jsonl", "retrieval", "custom")  # names of a --retrieval-file set (jsonl first)
# long-caption sets read from a JSON file the user names (--retrieval-file)
JSON_SETS = ("sharegpt4v", "dci")
CAPTION_FOLDER_LAYOUT = ("{root}/image/NAME.jpg (any image type)\n"
                         "{root}/caption/NAME.txt  (one caption per image, the same NAME; "
                         "{root} may also hold Urban1k/)")
ANNOTATION_CANDIDATES = {
    "mscoco": ("coco_karpathy_test.json", "annotations/coco_karpathy_test.json",
               "dataset_coco.json", "annotations/dataset_coco.json"),
    "flickr30k": ("flickr30k_test.json", "annotations/flickr30k_test.json",
                  "dataset_flickr30k.json", "annotations/dataset_flickr30k.json"),
}
# Sub-folders of a common data root that hold a set (one --data-root for all sets).
SET_FOLDERS = {"mscoco": ("coco", "mscoco"), "flickr30k": ("flickr30k", "flickr")}
IMAGE_DIR_CANDIDATES = {
    "mscoco": (".", "images"),
    "flickr30k": (".", "flickr30k-images", "images"),
}
RETRIEVAL_LAYOUTS = {
    "mscoco": "{root}/coco_karpathy_test.json (or dataset_coco.json, also under annotations/)\n"
              "{root}/val2014/COCO_val2014_*.jpg  ({root} may also be a folder holding coco/)",
    "flickr30k": "{root}/flickr30k_test.json  (or dataset_flickr30k.json, also under annotations/)\n"
                 "{root}/flickr30k-images/*.jpg  ({root} may also hold flickr30k/)",
}


@dataclass
class RetrievalSet:
    name: str
    image_paths: list[str]
    captions: list[str]
    text_to_image: list[int]

    @property
    def num_images(self) -> int:
        return len(self.image_paths)


def _records_from_file(path: Path, encoding: str = "utf-8") -> list[tuple[str, list[str]]]:
    """(image, captions) records from a JSONL, Karpathy-test list or Karpathy dataset file
    (text in ``encoding``)."""
    text = read_text(path, encoding)
    records: list[tuple[str, list[str]]] = []
    if path.suffix.lower() == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EvalError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            records.append(_record(obj, f"{path}:{lineno}"))
        return records
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvalError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("images"), list):  # Karpathy's format
        for _i, img in enumerate(data["images"]):
            if img.get("split") != "test":
                continue
            rel = os.path.join(img.get("filepath", ""), img["filename"])
            where = f"{path} image {rel}"
            caps = [check_caption(s.get("raw") if isinstance(s, dict) else s, where)
                    for s in img.get("sentences", [])]
            records.append((rel, caps))
        if not records:
            raise EvalError(f"{path}: no images with split 'test'")
        return records
    if isinstance(data, list):
        return [_record(obj, f"{path} entry {i}") for i, obj in enumerate(data)]
    raise EvalError(f"{path}: expected JSONL lines, a JSON list of {{image, caption}} or "
                    "Karpathy's {images: [...]} file")


def _conversation_captions(turns, where: str) -> list[str]:
    """ShareGPT4V's ``conversations``: the answers (``"from": "gpt"``) are the captions."""
    if not isinstance(turns, list):
        raise EvalError(f"{where}: 'conversations' must be a list of {{from, value}} turns")
    caps = [check_caption(t["value"], where) for t in turns if isinstance(t, dict)
            and t.get("from") in ("gpt", "assistant") and isinstance(t.get("value"), str)]
    if not caps:
        raise EvalError(f"{where}: 'conversations' holds no answer (a turn with \"from\": "
                        "\"gpt\" and a \"value\" string)")
    return caps


def _record(obj, where: str) -> tuple[str, list[str]]:
    """One annotation: ``captions`` (list or string) or ``caption``, ShareGPT4V's
    ``conversations`` (its answers), else make_rec's pair format (``raw``, or its aliases
    ``caption``/``text``; ``synthetic``/``generated`` are training variants, not
    reference captions, and are not used)."""
    if not isinstance(obj, dict) or "image" not in obj:
        raise EvalError(f"{where}: expected an object with 'image' and 'captions' (or 'raw')")
    if "conversations" in obj and not any(k in obj for k in ("captions", "caption")):
        return str(obj["image"]), _conversation_captions(obj["conversations"], where)
    caps = obj.get("captions", obj.get("caption", obj.get("raw", obj.get("text"))))
    if isinstance(caps, str):
        caps = [caps]
    if not isinstance(caps, list) or not caps or not all(isinstance(c, str) for c in caps):
        raise EvalError(f"{where}: 'captions' must be a non-empty list of strings (or 'raw' "
                        "a caption string)")
    return str(obj["image"]), [check_caption(c, where) for c in caps]


def _merge_by_image(records: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """One record per image (first-seen order): make_rec's pairs list an image once per
    caption, and one image counted twice would make its captions' recall ambiguous."""
    merged: dict[str, list[str]] = {}
    for image, caps in records:
        merged.setdefault(image, []).extend(caps)
    return list(merged.items())


def _resolve_image(rel: str, roots: Sequence[Path]) -> str | None:
    p = Path(rel)
    if p.is_absolute():
        return str(p) if p.is_file() else None
    for root in roots:
        for cand in (root / p, root / p.name):
            if cand.is_file():
                return str(cand)
    return None


def load_retrieval_file(path: str | os.PathLike, image_root: str | os.PathLike | None = None,
                        name: str | None = None, caption_prefix: str = "",
                        image_dirs: Sequence[str] = (".",),
                        encoding: str = "utf-8") -> RetrievalSet:
    """Read an annotation file (text in ``encoding``); images are looked up under
    ``image_root`` (default: the file's folder) and its ``image_dirs`` sub-folders."""
    path = Path(path)
    if not path.is_file():
        raise DatasetNotFoundError(f"retrieval file {path} does not exist")
    root = Path(image_root) if image_root is not None else path.parent
    roots = [root / d for d in image_dirs]
    records = _merge_by_image(_records_from_file(path, encoding))
    if not records:
        raise EvalError(f"{path}: no records")
    images: list[str] = []
    captions: list[str] = []
    t2i: list[int] = []
    for i, (rel, caps) in enumerate(records):
        resolved = _resolve_image(rel, roots)
        if resolved is None:
            raise DatasetNotFoundError(f"{path}: image {rel!r} not found (looked under "
                                       f"{', '.join(str(r) for r in roots)})")
        images.append(resolved)
        captions.extend(caption_prefix + c for c in caps)
        t2i.extend([i] * len(caps))
    return RetrievalSet(name or path.stem, images, captions, t2i)


def load_caption_folder(root: str | os.PathLike, name: str = "urban1k",
                        encoding: str = "utf-8") -> RetrievalSet:
    """Urban1k's layout: ``root/image/X.jpg`` with ``root/caption/X.txt`` (the caption,
    in ``encoding``), pairs matched by file stem in sorted order; ``root`` may also hold
    ``Urban1k/``. An image without a caption file, or the reverse, is an error."""
    root = Path(root)
    if not (root / "caption").is_dir() and (root / "Urban1k" / "caption").is_dir():
        root = root / "Urban1k"
    if not (root / "image").is_dir() or not (root / "caption").is_dir():
        raise DatasetNotFoundError(
            f"retrieval set {name!r} not found under --data-root {root}. Expected layout:\n"
            "    " + CAPTION_FOLDER_LAYOUT.format(root=root).replace("\n", "\n    "))
    from .datasets import _is_image

    images = {p.stem: p for p in sorted((root / "image").iterdir()) if _is_image(p.name)}
    texts = {p.stem: p for p in sorted((root / "caption").iterdir()) if p.suffix == ".txt"}
    lonely = sorted(set(images) ^ set(texts))
    if lonely:
        which = "caption" if lonely[0] in images else "image"
        raise EvalError(f"{root}: {len(lonely)} file(s) without their pair, e.g. "
                        f"{lonely[0]!r} has no {which} file (image/NAME.* and caption/NAME.txt "
                        "go together)")
    if not images:
        raise EvalError(f"{root}/image: no images")
    stems = sorted(images)
    captions = [check_caption(read_text(texts[s], encoding), str(texts[s])) for s in stems]
    return RetrievalSet(name, [str(images[s]) for s in stems], captions, list(range(len(stems))))


def build_retrieval_set(name: str, data_root: str | os.PathLike | None = None,
                        retrieval_file: str | os.PathLike | None = None,
                        caption_prefix: str | None = None,
                        encoding: str = "utf-8") -> RetrievalSet:
    """``mscoco``/``coco``, ``flickr30k``/``flickr`` (annotation found under
    ``data_root`` unless ``retrieval_file`` is given), ``urban1k`` (``data_root``),
    ``sharegpt4v``/``dci`` or ``jsonl`` (``retrieval_file``, images relative to
    ``data_root`` or the file's folder). Caption files are read in ``encoding``."""
    key = RETRIEVAL_ALIASES.get(name.lower(), name.lower())
    if key == "urban1k":
        if data_root is None:
            raise EvalError("retrieval set 'urban1k' needs --data-root. Expected layout:\n    "
                            + CAPTION_FOLDER_LAYOUT.format(root="<data-root>").replace(
                                "\n", "\n    "))
        return load_caption_folder(data_root, key, encoding)
    if key in JSON_SETS:
        if retrieval_file is None:
            raise EvalError(f"--dataset {name} needs --retrieval-file FILE.json (a list of "
                            '{"image": path, "conversations": [...]} or {"image", "caption"})')
        return load_retrieval_file(retrieval_file, data_root, name=key,
                                   caption_prefix=caption_prefix or "", encoding=encoding)
    if key in FILE_SETS:
        if retrieval_file is None:
            raise EvalError(f"--dataset {name} needs --retrieval-file FILE.jsonl")
        return load_retrieval_file(retrieval_file, data_root, name="jsonl" if key == "jsonl" else key,
                                   caption_prefix=caption_prefix or "", encoding=encoding)
    if key not in ANNOTATION_CANDIDATES:
        raise EvalError(f"unknown retrieval dataset {name!r}: choose mscoco, flickr30k, "
                        "urban1k, sharegpt4v, dci or jsonl")
    prefix = ORIGINAL_CAPTION_PREFIX if caption_prefix is None else caption_prefix
    if data_root is None and retrieval_file is None:
        raise EvalError(f"retrieval set {key!r} needs --data-root. Expected layout:\n    "
                        + RETRIEVAL_LAYOUTS[key].format(root="<data-root>").replace("\n", "\n    "))
    root = Path(data_root) if data_root is not None else Path(str(retrieval_file)).parent
    ann = Path(retrieval_file) if retrieval_file else None
    if ann is None:  # the set's folder itself, or a data root holding it as a sub-folder
        for base in [root] + [root / sub for sub in SET_FOLDERS[key]]:
            ann = next((base / c for c in ANNOTATION_CANDIDATES[key] if (base / c).is_file()),
                       None)
            if ann is not None:
                root = base
                break
    if ann is None:
        raise DatasetNotFoundError(
            f"retrieval set {key!r} not found under --data-root {root}. Expected layout:\n    "
            + RETRIEVAL_LAYOUTS[key].format(root=root).replace("\n", "\n    "))
    return load_retrieval_file(ann, root, name=key, caption_prefix=prefix,
                               image_dirs=IMAGE_DIR_CANDIDATES[key], encoding=encoding)


@torch.no_grad()
def encode_texts_sharded(model, texts: Sequence[str], device: torch.device, batch_size: int,
                         precision: str = "fp32", info: DistInfo | None = None) -> torch.Tensor:
    """Each rank encodes a contiguous shard of ``texts``; all ranks get every feature."""
    info = info or current()
    shard = shard_range(len(texts), info.rank, info.world_size)
    with fail_together(info):
        if len(shard):
            feats = encode_texts(model, [texts[i] for i in shard], device, batch_size, precision)
        else:
            feats = torch.zeros(0, int(model.image_model.embed_dims))
    (out,) = gather_rows(torch.tensor(list(shard), dtype=torch.long), feats, info=info)
    return out


def evaluate_retrieval(model, rset: RetrievalSet, transform, device: torch.device | str,
                       batch_size: int = 64, workers: int = 0, precision: str = "fp32",
                       text_batch_size: int = 256, ks: Sequence[int] = (1, 5, 10),
                       info: DistInfo | None = None,
                       log: Callable[[str], None] | None = None) -> dict:
    """Recall@k both ways plus ``num_images``/``num_texts``; same on every rank (``log``:
    the estimate and progress lines of a long image encoding)."""
    device = torch.device(device)
    from ..checkpoint_files import unwrap_model
    info = info or current()
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    try:
        images = ImageListDataset([(p, i) for i, p in enumerate(rset.image_paths)], transform)
        _, img_feats = encode_images_gathered(model, images, device, batch_size, workers, precision,
                                              describe=lambda i: rset.image_paths[i], info=info,
                                              log=log)
        txt_feats = encode_texts_sharded(model, rset.captions, device, text_batch_size, precision, info)
    finally:
        model.train(was_training)
    metrics = retrieval_metrics(img_feats, txt_feats, rset.text_to_image, ks)
    metrics.update(num_images=rset.num_images, num_texts=len(rset.captions))
    return metrics
