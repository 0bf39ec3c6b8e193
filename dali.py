"""The original's ``dali.py`` entry point, kept as a thin shim.

``from dali import dali_dataloader`` works as in deepglint/RWKV-CLIP; the pipeline
itself (GPU and CPU-only modes, RecordIO and WebDataset, evaluation variant, input
checks) lives in :mod:`rwkv_clip.data.dali_pipeline`.
"""

from rwkv_clip.data.dali_pipeline import DALIWrapper, build_dali_loader, dali_dataloader

__all__ = ["dali_dataloader", "build_dali_loader", "DALIWrapper"]
