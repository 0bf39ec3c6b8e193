#!/usr/bin/env python
"""Zero-shot evaluation of RWKV-CLIP: classification on the paper's 11 sets or any image
folder, and image-text retrieval. ``python zero_shot.py --help`` lists every flag; the
original's shell/test_zero_shot_classificaiton.sh runs with its paths filled in (the data
folder: --data-root)."""
import sys

from rwkv_clip.eval.cli import zero_shot_main as main

if __name__ == "__main__":
    sys.exit(main())
