"""Text tokenizer: open_clip's CLIP BPE (vocab 49408, context 77), used as is."""
from __future__ import annotations

import torch

SOT_TOKEN = 49406  # "<start_of_text>" in CLIP's BPE
EOT_TOKEN = 49407  # "<end_of_text>"


def fit_context_length(tokens: torch.Tensor, context_length: int) -> torch.Tensor:
    """(N, L) zero-padded token ids -> (N, context_length), as ``tokenize`` would have
    made them: zero padding added, or the tail cut with the last kept token set to
    end-of-text where the caption was longer (open_clip's ``truncate``). Stored captions
    are 77 tokens; a model with a shorter ``ctx_len`` trains and evaluates on the same
    text."""
    length = tokens.shape[1]
    if length == context_length:
        return tokens
    if length < context_length:
        return torch.nn.functional.pad(tokens, (0, context_length - length))
    cut = tokens[:, :context_length].clone()
    longer = tokens[:, context_length:].ne(0).any(dim=1)
    cut[longer, -1] = EOT_TOKEN
    return cut


def tokenize(texts: str | list[str], context_length: int = 77) -> torch.LongTensor:
    """Caption(s) -> (N, context_length) token ids with start/end tokens, zero padded."""
    from open_clip.tokenizer import tokenize as open_clip_tokenize  # bundled vocab, offline
    return open_clip_tokenize(texts, context_length=context_length)
