"""Caption tokens as stored in the data: 3 x 77 CLIP token ids per sample.

Raw, synthetic and generated caption, in the original's layout (:func:`encode_captions`);
the original data2rec's two-caption records are accepted (:func:`normalize_labels`), any
other label count is a :class:`DataError`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..errors import DataError
from ..tokenizer import EOT_TOKEN, SOT_TOKEN, open_clip_tokenizer, tokenize

CONTEXT_LENGTH = 77
NUM_CAPTIONS = 3
NUM_LABELS = NUM_CAPTIONS * CONTEXT_LENGTH  # 231
VOCAB_SIZE = 49408

def tokenize_texts(texts: Sequence[str]) -> np.ndarray:
    """Tokenise a list of strings -> int64 array (len(texts), 77), with open_clip's
    ``tokenize`` (BPE vocab 49408, context 77, SOT/EOT, zero padded, truncated with EOT
    kept)."""
    if len(texts) == 0:
        return np.zeros((0, CONTEXT_LENGTH), dtype=np.int64)
    uniq = list(dict.fromkeys(texts))  # tokenise each distinct string once
    tok = tokenize(uniq, context_length=CONTEXT_LENGTH).numpy().astype(np.int64)
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
    """Three captions -> int64 array (231,) = concat of three 77-token rows.

    The order is the original's, read by its train.py as ``token[:77]`` (raw),
    ``[77:154]`` (synthetic), ``[154:231]`` (generated); a missing variant (None/empty)
    repeats the raw caption.
    """
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
    problem = label_problem(arr)
    if problem:
        raise DataError(problem, where, record)
    return arr.astype(np.int64)


def label_problem(arr: np.ndarray) -> str | None:
    """Why stored label values are not token ids (None if they are): the one check every
    loader and :func:`~.recordio.check_rec` apply."""
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            return "labels are not integral token ids"
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        return f"token ids outside [0, {VOCAB_SIZE})"
    return None


def tokens_from_row(row, where: str | None = None, record=None) -> np.ndarray:
    """A stored token row of 77 x k values (k = 1, 2 or 3) -> int64 (231,).

    k = 2 and 3 follow :func:`normalize_labels`; one caption (k = 1) fills all three
    variants, as a missing variant repeats the raw caption when captions are tokenised.
    """
    arr = np.asarray(row).reshape(-1)
    if arr.size == CONTEXT_LENGTH:
        arr = np.concatenate([arr, arr, arr])
    return normalize_labels(arr, where, record)


def merge_caption_tokens(row, base: np.ndarray | None, where: str | None = None,
                         record=None) -> np.ndarray:
    """Caption-token array row (77 x k) over a sample's own tokens (231,) or None.

    The array's k captions replace the first k variants (raw, synthetic, generated); the
    variants it lacks keep the sample's own when it has captions, else are padded as in
    :func:`tokens_from_row`.
    """
    row = np.asarray(row).reshape(-1)
    full = tokens_from_row(row, where, record)
    if base is None:
        return full
    out = np.array(base, dtype=np.int64).reshape(-1)
    out[:row.size] = full[:row.size]
    return out


class CaptionTokens:
    """``--caption-tokens FILE.npy``: a memory-mapped (N, 77 x k) token array, row i
    belonging to record / sample i (k = 1, 2 or 3; the original's raw + OFA captions
    were shared as (15061515, 154)). Opened lazily per process, so it pickles cheaply
    into data-loader workers."""

    def __init__(self, path: str):
        self.path = str(path)
        arr = self._open()
        if arr.ndim != 2 or arr.shape[1] not in (CONTEXT_LENGTH, 2 * CONTEXT_LENGTH,
                                                 NUM_LABELS):
            raise DataError(f"caption-token array has shape {tuple(arr.shape)}; expected "
                            f"(N, {CONTEXT_LENGTH} x k) with k = 1, 2 or 3", self.path)
        if arr.dtype.kind not in "iuf":
            raise DataError(f"caption-token array has dtype {arr.dtype}; expected integer "
                            "token ids", self.path)
        self.shape = tuple(arr.shape)
        self._arr: np.ndarray | None = None

    def _open(self) -> np.ndarray:
        if not os.path.isfile(self.path):
            raise DataError("caption-token file not found", self.path)
        try:
            return np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"not a readable .npy array ({e})", self.path) from None

    def __getstate__(self):
        st = self.__dict__.copy()
        st["_arr"] = None
        return st

    def __len__(self) -> int:
        return self.shape[0]

    def check(self, n: int, what: str, where: str | None = None, max_id: int | None = None):
        """Raise unless the array has one row per sample: ``n`` samples in ``what`` and,
        for keyed records, every id below the row count."""
        if self.shape[0] != n:
            raise DataError(f"caption-token array has {self.shape[0]} rows but {what} holds "
                            f"{n} samples (row i belongs to sample i)", self.path)
        if max_id is not None and max_id >= self.shape[0]:
            raise DataError(f"{what} has record id {max_id} but the caption-token array has "
                            f"only {self.shape[0]} rows (ids 0..{self.shape[0] - 1})",
                            self.path, where)

    def tokens(self, i: int, base: np.ndarray | None = None) -> np.ndarray:
        """int64 (231,) tokens of sample ``i`` (see :func:`merge_caption_tokens`)."""
        if self._arr is None:
            self._arr = self._open()
        return merge_caption_tokens(self._arr[i], base, self.path, f"row {i}")


def labels_for_rec(tokens: np.ndarray) -> np.ndarray:
    """int token ids (231,) -> float32 labels as stored in the IRHeader (exact below 2**24)."""
    return np.asarray(tokens, dtype=np.int64).reshape(-1).astype(np.float32)


def decode_tokens(tokens) -> list[str]:
    """int tokens (231,) or (3, 77) -> the three caption strings (for inspection)."""
    bpe = open_clip_tokenizer()._tokenizer  # its SimpleTokenizer instance
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1, CONTEXT_LENGTH)
    out = []
    for row in arr:
        ids = [int(t) for t in row if t not in (0, SOT_TOKEN, EOT_TOKEN)]
        out.append(bpe.decode(ids).strip())
    return out
