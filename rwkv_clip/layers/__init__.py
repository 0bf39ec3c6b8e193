"""Building blocks shared by the two towers, one concept per file."""
from ..ops.products import conv2d, matmul
from .channel_mix import channel_mix
from .drop_path import DropPath, drop_path
from .linear import Linear
from .patch_embed import PatchEmbed
from .pos_embed import resize_pos_embed
from .time_mix import TimeMixBase

__all__ = ["channel_mix", "DropPath", "drop_path", "Linear", "conv2d", "matmul", "PatchEmbed",
           "resize_pos_embed", "TimeMixBase"]
