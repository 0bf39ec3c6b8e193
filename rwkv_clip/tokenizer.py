"""Text tokenizer: open_clip's CLIP BPE (vocab 49408, context 77), used as is."""
from __future__ import annotations

import torch


def tokenize(texts: str | list[str], context_length: int = 77) -> torch.LongTensor:
    """Caption(s) -> (N, context_length) token ids with start/end tokens, zero padded."""
    from open_clip.tokenizer import tokenize as open_clip_tokenize  # bundled vocab, offline
    return open_clip_tokenize(texts, context_length=context_length)
