"""Fine-tuning modes of the planner: a locked tower, LoRA adapters (``train.py
--lock-image/--lock-text``, ``--lora-rank``).

Frozen parameters have no gradient or moments and save less (:func:`configure_walker`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..lora import ADAPTER_NAME, DEFAULT_TARGETS, TOWERS, target_names
from .params import DTYPE_NAMES, ParamTable

_MATRIX_MODULES = (nn.Linear, nn.Embedding, nn.Conv2d)


@dataclass(frozen=True)
class FineTune:
    """What trains: ``lora_rank`` 0 and no lock is a full fine-tune."""
    lock_image: bool = False
    lock_text: bool = False
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS
    lora_base_precision: str = "fp32"
    lora_dropout: float = 0.0

    @property
    def label(self) -> str:
        if self.lora_rank:
            base = ", bf16 base" if self.lora_base_precision == "bf16" else ""
            lock = "".join(f", {t} locked" for t, on in (("image", self.lock_image),
                                                          ("text", self.lock_text)) if on)
            return f"LoRA r={self.lora_rank}{base}{lock}"
        locked = [t for t, on in (("image", self.lock_image), ("text", self.lock_text)) if on]
        return "full" if not locked else "lock-" + "+".join(locked)

    def towers(self) -> tuple[str, ...]:
        """The towers whose parameters (full) or adapters (LoRA) train."""
        return tuple(t for t, locked in zip(TOWERS, (self.lock_image, self.lock_text),
                                            strict=True) if not locked)

    def set_tower(self, walker: Any, tower: str) -> None:
        walker.train_params = not self.lora_rank and tower in self.towers()


def finetune_table(model: nn.Module, ft: FineTune) -> ParamTable:
    """The parameter table of ``model`` (built on the meta device) fine-tuned as ``ft``:
    stored dtypes, the adapters and the frozen names."""
    modules = dict(model.named_modules())
    adapted = target_names(model, ft.lora_targets, ft.towers()) if ft.lora_rank else []
    items: list[tuple[str, int, str]] = []
    frozen: set[str] = set()
    for name, p in model.named_parameters():
        owner = modules[name.rsplit(".", 1)[0]] if "." in name else model
        dtype = DTYPE_NAMES[p.dtype]
        if ft.lora_rank and ft.lora_base_precision == "bf16" and isinstance(owner,
                                                                            _MATRIX_MODULES):
            dtype = "bf16"
        items.append((name, p.numel(), dtype))
        if ft.lora_rank or not name.startswith(tuple(t + "." for t in ft.towers())) \
                and name != "logit_scale":
            frozen.add(name)
    for name in adapted:
        linear = modules[name]
        assert isinstance(linear, nn.Linear)
        items.append((f"{name}.lora_A.{ADAPTER_NAME}.weight",
                      ft.lora_rank * linear.in_features, "fp32"))
        items.append((f"{name}.lora_B.{ADAPTER_NAME}.weight",
                      linear.out_features * ft.lora_rank, "fp32"))
    return ParamTable(items, frozenset(frozen), ft)


def configure_walker(walker: Any, ft: FineTune, table: ParamTable) -> None:
    """The walker's LoRA state: adapted linears and their rank, base dtype, dropout.

    A frozen parameter has no gradient and no AdamW moments; the walker follows which
    tensors need a gradient: a frozen tower saves nothing; through frozen weights the graph
    keeps only what the gradient of the input needs (the weight, not the input); each
    adapted linear adds peft's LoRA branch (fp32 ``lora_A`` (r, in) and ``lora_B`` (out,
    r)). With a bf16 base the frozen matrices are stored in bf16, as
    :func:`rwkv_clip.lora.add_adapters` stores them."""
    suffix = f".lora_A.{ADAPTER_NAME}.weight"
    walker.adapted = {name[:-len(suffix)]: ft.lora_rank for name, _, _ in table.items
                      if name.endswith(suffix)}
    walker.base_dtype = "bf16" if ft.lora_rank and ft.lora_base_precision == "bf16" else None
    walker.lora_dropout = ft.lora_dropout if ft.lora_rank else 0.0
