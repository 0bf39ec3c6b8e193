"""Text tokenizer: open_clip's CLIP BPE (vocab 49408, context 77), used as is."""
from __future__ import annotations

import importlib.util
import os
import threading
from types import ModuleType

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


_MODULE: ModuleType | None = None
_LOCK = threading.Lock()


def open_clip_tokenizer() -> ModuleType:
    """open_clip's ``tokenizer`` module (the BPE and its bundled vocabulary, unchanged),
    loaded from its file alone: importing the ``open_clip`` package would also import
    torchvision, timm and transformers, seconds before the first caption. The file
    imports nothing from its package."""
    global _MODULE
    with _LOCK:
        if _MODULE is None:
            spec = importlib.util.find_spec("open_clip")  # locates it without running it
            if spec is None or not spec.submodule_search_locations:
                raise ModuleNotFoundError("rwkv_clip: the tokenizer needs open_clip_torch "
                                          "(pip install open_clip_torch)")
            path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer.py")
            file_spec = importlib.util.spec_from_file_location("rwkv_clip._clip_bpe", path)
            assert file_spec is not None and file_spec.loader is not None
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
            _MODULE = module
        return _MODULE


def tokenize(texts: str | list[str], context_length: int = 77) -> torch.LongTensor:
    """Caption(s) -> (N, context_length) token ids with start/end tokens, zero padded."""
    return open_clip_tokenizer().tokenize(texts, context_length=context_length)
