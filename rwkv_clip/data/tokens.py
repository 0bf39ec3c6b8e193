"""Caption tokens as stored in the data: 3 x L CLIP token ids per sample.

Raw, synthetic and generated caption, in the original's layout (:func:`encode_captions`),
each L = 77 tokens as the original stored them, or L = the model's ``ctx_len`` for longer
(or shorter) captions. Stored 77-token captions are fitted to any ``ctx_len`` (padded, or
cut with end-of-text kept: :func:`~rwkv_clip.tokenizer.fit_context_length`); the original
data2rec's two-caption records are accepted (:func:`normalize_labels`); any other label
count is a :class:`DataError`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import DataError
from ..tokenizer import EOT_TOKEN, SOT_TOKEN, fit_context_length, open_clip_tokenizer, tokenize

CONTEXT_LENGTH = 77
NUM_CAPTIONS = 3
NUM_LABELS = NUM_CAPTIONS * CONTEXT_LENGTH  # 231
VOCAB_SIZE = 49408

def tokenize_texts(texts: Sequence[str], context_length: int = CONTEXT_LENGTH) -> np.ndarray:
    """Tokenise a list of strings -> int64 array (len(texts), context_length), with
    open_clip's ``tokenize`` (BPE vocab 49408, SOT/EOT, zero padded, truncated with EOT
    kept)."""
    if len(texts) == 0:
        return np.zeros((0, context_length), dtype=np.int64)
    uniq = list(dict.fromkeys(texts))  # tokenise each distinct string once
    tok = tokenize(uniq, context_length=context_length).numpy().astype(np.int64)
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


def encode_captions(raw: str, synthetic: str | None = None, generated: str | None = None,
                    context_length: int = CONTEXT_LENGTH) -> np.ndarray:
    """Three captions -> int64 array (3 L,) = concat of three L-token rows (L =
    ``context_length``, 77 by default).

    The order is the original's, read by its train.py as ``token[:77]`` (raw),
    ``[77:154]`` (synthetic), ``[154:231]`` (generated); a missing variant (None/empty)
    repeats the raw caption.
    """
    return tokenize_texts(_variants(raw, synthetic, generated), context_length).reshape(-1)


def encode_captions_batch(rows: Sequence[tuple], context_length: int = CONTEXT_LENGTH
                          ) -> np.ndarray:
    """[(raw, synthetic, generated), ...] -> int64 array (N, 3 L); one tokenizer call."""
    texts = []
    for r in rows:
        texts.extend(_variants(*r))
    return tokenize_texts(texts, context_length).reshape(len(rows), NUM_CAPTIONS * context_length)


def stored_layout(n: int, ctx_len: int, counts: Sequence[int] = (2, 3)) -> tuple[int, int] | None:
    """(captions k, tokens per caption L) of a stored row of ``n`` token ids, or None.

    A row of k x ``ctx_len`` values is read at the model's context length; otherwise a
    row of k x 77 is the original's layout (fitted to ``ctx_len`` when they differ).
    ``counts``: the caption counts the row may hold.
    """
    for length in dict.fromkeys((ctx_len, CONTEXT_LENGTH)):
        if n % length == 0 and n // length in counts:
            return n // length, length
    return None


def expected_layouts(ctx_len: int, counts: Sequence[int] = (2, 3)) -> str:
    """The row widths :func:`stored_layout` accepts, in words (for error messages)."""
    ks = "/".join(str(k) for k in sorted(counts, reverse=True))
    if ctx_len == CONTEXT_LENGTH:
        return f"{ks} captions x {CONTEXT_LENGTH} tokens"
    return (f"{ks} captions x {ctx_len} tokens (--ctx-len {ctx_len}) or x {CONTEXT_LENGTH} "
            "(the original's layout)")


def fit_labels(arr: np.ndarray, k: int, length: int, ctx_len: int) -> np.ndarray:
    """k captions of ``length`` tokens -> (3 ctx_len,): missing variants repeat the last
    stored one (two captions) or the only one (one caption); each caption fitted to
    ``ctx_len`` as :func:`~rwkv_clip.tokenizer.fit_context_length` does (padding, or
    the tail cut and the last kept token set to end-of-text)."""
    rows = arr.reshape(k, length)
    rows = rows[[0, 0, 0] if k == 1 else [0, 1, 1] if k == 2 else [0, 1, 2]]
    if length != ctx_len:
        rows = fit_context_length(torch.from_numpy(np.ascontiguousarray(rows)), ctx_len).numpy()
    return rows.reshape(-1)


def normalize_labels(labels, where: str | None = None, record=None,
                     ctx_len: int = CONTEXT_LENGTH) -> np.ndarray:
    """Validate a stored label vector and return int64 (3 ctx_len,).

    Accepts 3 captions of ``ctx_len`` or of 77 tokens, or 2 captions (as the original's
    data2rec wrote) which are padded by repeating the second caption; 77-token captions
    are fitted to ``ctx_len`` (:func:`fit_labels`). Values must be integral token ids in
    [0, 49408).
    """
    arr = np.asarray(labels).reshape(-1)
    layout = stored_layout(arr.size, ctx_len)
    if layout is None:
        raise DataError(f"record has {arr.size} labels; expected {expected_layouts(ctx_len)}",
                        where, record)
    problem = label_problem(arr)
    if problem:
        raise DataError(problem, where, record)
    return fit_labels(arr.astype(np.int64), *layout, ctx_len)


def label_problem(arr: np.ndarray) -> str | None:
    """Why stored label values are not token ids (None if they are): the one check every
    loader and :func:`~.recordio.check_rec` apply."""
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            return "labels are not integral token ids"
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        return f"token ids outside [0, {VOCAB_SIZE})"
    return None


def tokens_from_row(row, where: str | None = None, record=None,
                    ctx_len: int = CONTEXT_LENGTH) -> np.ndarray:
    """A stored token row of k x ``ctx_len`` or k x 77 values (k = 1, 2 or 3) -> int64
    (3 ctx_len,).

    k = 2 and 3 follow :func:`normalize_labels`; one caption (k = 1) fills all three
    variants, as a missing variant repeats the raw caption when captions are tokenised.
    """
    arr = np.asarray(row).reshape(-1)
    layout = stored_layout(arr.size, ctx_len, (1, 2, 3))
    if layout is None:
        raise DataError(f"token row has {arr.size} values; expected "
                        f"{expected_layouts(ctx_len, (1, 2, 3))}", where, record)
    problem = label_problem(arr)
    if problem:
        raise DataError(problem, where, record)
    return fit_labels(arr.astype(np.int64), *layout, ctx_len)


def merge_caption_tokens(row, base: np.ndarray | None, where: str | None = None,
                         record=None, ctx_len: int = CONTEXT_LENGTH) -> np.ndarray:
    """Caption-token array row (k x L) over a sample's own tokens (3 ctx_len,) or None.

    The array's k captions replace the first k variants (raw, synthetic, generated); the
    variants it lacks keep the sample's own when it has captions, else are padded as in
    :func:`tokens_from_row`.
    """
    row = np.asarray(row).reshape(-1)
    full = tokens_from_row(row, where, record, ctx_len)
    if base is None:
        return full
    layout = stored_layout(row.size, ctx_len, (1, 2, 3))
    assert layout is not None  # tokens_from_row checked it
    out = np.array(base, dtype=np.int64).reshape(-1)
    out[:layout[0] * ctx_len] = full[:layout[0] * ctx_len]
    return out


class CaptionTokens:
    """``--caption-tokens FILE.npy``: a memory-mapped (N, L x k) token array, row i
    belonging to record / sample i (k = 1, 2 or 3 captions of L = ``ctx_len`` or 77
    tokens; the original's raw + OFA captions were shared as (15061515, 154)). Opened
    lazily per process, so it pickles cheaply into data-loader workers."""

    def __init__(self, path: str, ctx_len: int = CONTEXT_LENGTH):
        self.path = str(path)
        self.ctx_len = int(ctx_len)
        arr = self._open()
        if arr.ndim != 2 or stored_layout(arr.shape[1], self.ctx_len, (1, 2, 3)) is None:
            width = (f"rows of {arr.shape[1]} tokens" if arr.ndim == 2 else
                     f"shape {tuple(arr.shape)}")
            raise DataError(f"caption-token array has {width}; expected (N, L x k) with k = "
                            f"1, 2 or 3 captions of L = {self.ctx_len} tokens (--ctx-len)"
                            + ("" if self.ctx_len == CONTEXT_LENGTH else
                               f" or {CONTEXT_LENGTH} (the original's layout)"), self.path)
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
        """int64 (3 ctx_len,) tokens of sample ``i`` (see :func:`merge_caption_tokens`)."""
        if self._arr is None:
            self._arr = self._open()
        return merge_caption_tokens(self._arr[i], base, self.path, f"row {i}", self.ctx_len)


def labels_for_rec(tokens: np.ndarray) -> np.ndarray:
    """int token ids (3 L,) -> float32 labels as stored in the IRHeader (exact below 2**24)."""
    return np.asarray(tokens, dtype=np.int64).reshape(-1).astype(np.float32)


def decode_tokens(tokens, ctx_len: int = CONTEXT_LENGTH) -> list[str]:
    """int tokens (3 L,) or (3, L) -> the three caption strings (for inspection)."""
    bpe = open_clip_tokenizer()._tokenizer  # its SimpleTokenizer instance
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1, ctx_len)
    out = []
    for row in arr:
        ids = [int(t) for t in row if t not in (0, SOT_TOKEN, EOT_TOKEN)]
        out.append(bpe.decode(ids).strip())
    return out
