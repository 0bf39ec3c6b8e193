"""The planner's parameter table: every parameter's name, size and dtype, and which are
frozen (shared by the walker and the fine-tuning modes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_SIZES = {"fp32": 4, "bf16": 2, "fp16": 2, "i64": 8, "bool": 1}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class ParamTable:
    """Every parameter of the model as (name, numel, dtype name); ``frozen``: the names
    that get no gradient and ``finetune`` the mode that froze them (:mod:`.finetune`)."""
    items: list[tuple[str, int, str]] = field(default_factory=list)
    frozen: frozenset[str] = frozenset()
    finetune: Any = None

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ParamTable:
        return cls([(name, p.numel(), DTYPE_NAMES[p.dtype])
                    for name, p in model.named_parameters()])

    def count(self, prefix: str = "") -> int:
        return sum(n for name, n, _ in self.items if name.startswith(prefix))

    def nbytes(self, prefix: str | tuple[str, ...] = "") -> int:
        return sum(n * _SIZES[d] for name, n, d in self.items if name.startswith(prefix))

    def largest_bytes(self) -> int:
        return max(n * _SIZES[d] for _, n, d in self.items)

    def trainable_nbytes(self, prefix: str | tuple[str, ...] = "") -> int:
        """Bytes of the parameters that train (their gradients and AdamW moments)."""
        return sum(n * _SIZES[d] for name, n, d in self.items
                   if name.startswith(prefix) and name not in self.frozen)

    def largest_trainable_bytes(self) -> int:
        return max((n * _SIZES[d] for name, n, d in self.items if name not in self.frozen),
                   default=0)

    def dtype(self, name: str) -> str:
        for item, _, d in self.items:
            if item == name:
                return d
        raise KeyError(name)
