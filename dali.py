"""The original's ``dali.py`` entry point, kept as a thin shim.

``from dali import dali_dataloader`` works as in deepglint/RWKV-CLIP; the pipeline
itself (GPU and CPU-only modes, RecordIO and WebDataset, evaluation variant, input
checks) lives in :mod:`rwkv_clip.data.dali_pipeline`. As a command, ``python dali.py
--train-data PREFIX`` reads a few batches through it and prints their shapes and rate.
"""

from rwkv_clip.data.dali_pipeline import DALIWrapper, build_dali_loader, dali_dataloader

__all__ = ["dali_dataloader", "build_dali_loader", "DALIWrapper"]

if __name__ == "__main__":
    import sys

    from rwkv_clip.data.dali_pipeline import main
    from rwkv_clip.errors import run_cli

    sys.exit(run_cli(main, prog="dali.py"))
