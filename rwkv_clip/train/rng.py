"""Random generator states: captured and restored in one place, for exact resume (every
generator, in the checkpoint) and for replaying a micro-batch's dropout masks (torch's)."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _as_lists(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_as_lists(v) for v in value]
    return value


def capture_rng(device: torch.device | None = None, *, host: bool = True) -> dict[str, Any]:
    """torch's CPU generator and ``device``'s CUDA generator (None on the CPU); with
    ``host`` also numpy's and Python's ``random`` (as tensors and lists, so that
    ``torch.load(weights_only=True)`` reads them back)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "cuda": None}
    if device is not None and device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if host:
        np_state: Any = np.random.get_state()
        states["numpy"] = {"keys": torch.from_numpy(np_state[1].astype(np.int64)),
                           "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                           "cached_gaussian": float(np_state[4])}
        states["python"] = _as_lists(random.getstate())
    return states


def restore_rng(states: dict[str, Any], device: torch.device | None = None) -> None:
    """Set every generator :func:`capture_rng` recorded in ``states``."""
    torch.set_rng_state(states["torch"].cpu())
    if states.get("cuda") is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)
    if "numpy" in states:
        n = states["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached_gaussian"]))
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
