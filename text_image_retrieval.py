#!/usr/bin/env python
"""Zero-shot image-text retrieval of RWKV-CLIP on MSCOCO / Flickr30k (Karpathy test splits),
the long-caption sets Urban1k, ShareGPT4V and DCI, or a JSONL of pairs. Accepts every flag
of the original script of this name, so its shell/test_zero_shot_retrieval.sh runs with
only its paths filled in (the data folder: --data-root).
``python text_image_retrieval.py --help``."""
import sys

from rwkv_clip.eval.cli import retrieval_main as main

if __name__ == "__main__":
    sys.exit(main())
