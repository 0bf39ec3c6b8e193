"""Caption tokens as stored in the data: 3 x 77 CLIP token ids per sample.

Layout (the original's, read by its train.py as ``token[:77]``, ``[77:154]``,
``[154:231]``): raw caption, synthetic caption, generated caption, each tokenised by
open_clip's ``tokenize`` (BPE vocab 49408, context 77, SOT/EOT, zero padded, truncated
with EOT kept). A missing variant (None/empty) repeats the raw caption.

The original's ``data2rec.py`` wrote only two captions (154 labels); such records are
accepted and padded by repeating the second caption as the third (``normalize_labels``).
Any other label count is a :class:`DataError`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .recordio import DataError

CONTEXT_LENGTH = 77
NUM_CAPTIONS = 3
NUM_LABELS = NUM_CAPTIONS * CONTEXT_LENGTH  # 231
VOCAB_SIZE = 49408

_tokenize = None


def _get_tokenize():
    global _tokenize
    if _tokenize is None:
        from open_clip import tokenize  # bundled BPE vocab: no download
        _tokenize = tokenize
    return _tokenize


def tokenize_texts(texts: Sequence[str]) -> np.ndarray:
    """Tokenise a list of strings -> int64 array (len(texts), 77)."""
    if len(texts) == 0:
        return np.zeros((0, CONTEXT_LENGTH), dtype=np.int64)
    uniq = list(dict.fromkeys(texts))  # tokenise each distinct string once
    tok = _get_tokenize()(uniq, context_length=CONTEXT_LENGTH).numpy().astype(np.int64)
    if len(uniq) == len(texts):
        return tok
    pos = {t: i for i, t in enumerate(uniq)}
    return tok[[pos[t] for t in texts]]


def _variants(raw: str, synthetic: str | None, generated: str | None) -> list[str]:
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("raw caption is missing or empty")
    out = [raw]
    for v in (synthetic, generated):
        out.append(v if isinstance(v, str) and v.strip() else raw)
    return out


def encode_captions(raw: str, synthetic: str | None = None,
                    generated: str | None = None) -> np.ndarray:
    """Three captions -> int64 array (231,) = concat of three 77-token rows."""
    return tokenize_texts(_variants(raw, synthetic, generated)).reshape(-1)


def encode_captions_batch(rows: Sequence[tuple]) -> np.ndarray:
    """[(raw, synthetic, generated), ...] -> int64 array (N, 231); one tokenizer call."""
    texts = []
    for r in rows:
        texts.extend(_variants(*r))
    return tokenize_texts(texts).reshape(len(rows), NUM_LABELS)


def normalize_labels(labels, where: str | None = None, record=None) -> np.ndarray:
    """Validate a stored label vector and return int64 (231,).

    Accepts 231 values, or 154 (two captions, as the original's data2rec wrote) which
    are padded by repeating the second caption. Values must be integral token ids in
    [0, 49408).
    """
    arr = np.asarray(labels).reshape(-1)
    n = arr.size
    if n == NUM_LABELS:
        pass
    elif n == 2 * CONTEXT_LENGTH:
        arr = np.concatenate([arr, arr[CONTEXT_LENGTH:]])
    else:
        raise DataError(f"record has {n} labels; expected {NUM_LABELS} (3 captions x "
                        f"{CONTEXT_LENGTH} tokens) or {2 * CONTEXT_LENGTH} (2 captions)",
                        where, record)
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise DataError("labels are not integral token ids", where, record)
    out = arr.astype(np.int64)
    if out.min() < 0 or out.max() >= VOCAB_SIZE:
        raise DataError(f"token ids outside [0, {VOCAB_SIZE})", where, record)
    return out


def labels_for_rec(tokens: np.ndarray) -> np.ndarray:
    """int token ids (231,) -> float32 labels as stored in the IRHeader (exact below 2**24)."""
    return np.asarray(tokens, dtype=np.int64).reshape(-1).astype(np.float32)


def decode_tokens(tokens) -> list[str]:
    """int tokens (231,) or (3, 77) -> the three caption strings (for inspection)."""
    from open_clip.tokenizer import _tokenizer  # SimpleTokenizer instance
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1, CONTEXT_LENGTH)
    out = []
    for row in arr:
        ids = [int(t) for t in row if t not in (0, 49406, 49407)]
        out.append(_tokenizer.decode(ids).strip())
    return out
