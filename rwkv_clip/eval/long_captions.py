"""Retrieval within groups of candidates that differ only past a given token: the
built-in long-caption split's evaluation (:mod:`rwkv_clip.data.builtin_long`).

Each image is ranked against its group's captions and each caption against its group's
images; R@1 counts a tie at the top as 1 / (number tied), the expected R@1 of a random
tie-break, so a reader that cannot tell a group's captions apart scores chance exactly."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from PIL import Image

from ..errors import DataError
from ..text_files import check_caption, read_text
from ..tokenizer import fit_context_length, tokenize

TIE_TOLERANCE = 1e-6  # scores this close count as one (identical texts, GEMM rounding)


def tied_recall_at_1(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """(Q, K) scores, (Q,) index of each query's one positive -> (Q,) expected R@1 of a
    random tie-break: 0 below the top, 1 / (number tied) at it."""
    top = scores.max(dim=1, keepdim=True).values
    at_top = scores >= top - TIE_TOLERANCE
    hit = at_top.gather(1, positive[:, None])[:, 0]
    return hit.float() / at_top.sum(dim=1).float()


def group_recall(image_features: torch.Tensor, text_features: torch.Tensor,
                 groups: Sequence[int]) -> dict[str, float]:
    """Pair i = (image i, caption i); candidates are the pairs of the same group. ->
    ``image_to_text_R@1``, ``text_to_image_R@1`` and ``chance`` (mean 1 / group size)."""
    g = torch.as_tensor(list(groups))
    img = F.normalize(image_features.float(), dim=-1)
    txt = F.normalize(text_features.float(), dim=-1)
    i2t, t2i, chance = [], [], []
    for group in torch.unique(g):
        idx = torch.nonzero(g == group)[:, 0]
        s = img[idx] @ txt[idx].t()
        pos = torch.arange(len(idx))
        i2t.append(tied_recall_at_1(s, pos))
        t2i.append(tied_recall_at_1(s.t(), pos))
        chance.append(torch.full((len(idx),), 1.0 / len(idx)))
    return {"image_to_text_R@1": float(torch.cat(i2t).mean()),
            "text_to_image_R@1": float(torch.cat(t2i).mean()),
            "chance": float(torch.cat(chance).mean())}


def read_group_file(path: str | os.PathLike, encoding: str = "utf-8") -> list[dict]:
    """``[{"image": path relative to the file, "caption": str, "group": int}, ...]``
    (text in ``encoding``; a bad byte or an empty caption is a one-line error naming the
    file and line or entry, as for every caption reader)."""
    try:
        entries = json.loads(read_text(path, encoding))
    except json.JSONDecodeError as exc:
        raise DataError(f"not valid JSON ({exc})", str(path)) from None
    base = os.path.dirname(os.path.abspath(path))
    return [dict(e, image=os.path.join(base, e["image"]),
                 caption=check_caption(e.get("caption"), f"{path} entry {i}"))
            for i, e in enumerate(entries)]


@torch.no_grad()
def evaluate_groups(model, entries: Sequence[dict], read_tokens: Sequence[int | None] = (None,),
                    batch_size: int = 128) -> dict[str, dict[str, float]]:
    """Group R@1 of ``model`` (on its device, eval mode) with its captions read whole
    (``None``) or cut to each of ``read_tokens`` tokens the way ``tokenize`` cuts them
    (end-of-text kept), then padded back to the model's context, as a caption that short
    would reach it. -> {"full" or "<n> tokens": metrics}."""
    from ..transform import EvalTransform
    from .zeroshot import model_input_size

    device = next(model.parameters()).device
    ctx = int(model.text_model.args.ctx_len)
    transform = EvalTransform(model_input_size(model))
    feats = []
    for start in range(0, len(entries), batch_size):
        batch = [transform(Image.open(e["image"]).convert("RGB"))
                 for e in entries[start:start + batch_size]]
        feats.append(model.encode_image(torch.stack(batch).to(device)).cpu())
    images = torch.cat(feats)
    tokens = tokenize([e["caption"] for e in entries], context_length=ctx)
    groups = [int(e["group"]) for e in entries]
    out = {}
    for n in read_tokens:
        toks = tokens if n is None else fit_context_length(fit_context_length(tokens, n), ctx)
        texts = torch.cat([model.encode_text(toks[s:s + batch_size].to(device)).cpu()
                           for s in range(0, len(toks), batch_size)])
        out["full" if n is None else f"{n} tokens"] = group_recall(images, texts, groups)
    return out


__all__ = ["tied_recall_at_1", "group_recall", "read_group_file", "evaluate_groups"]
