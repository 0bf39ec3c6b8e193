"""RWKV-CLIP: CLIP with bidirectional RWKV-6 image and text towers.

Notebook use::

    from rwkv_clip import load_model_configs, create_RWKV_Model, tokenize, image_transform
    args = load_model_configs("model_config/RWKV_CLIP_B32.json")
    model = create_RWKV_Model(args, model_weight_path="RWKV_CLIP_B32.pt").eval()

    import rwkv_clip  # published weights by name, open_clip's way
    model, _, preprocess = rwkv_clip.create_model_and_transforms("RWKV-CLIP-B32", "yfcc15m")
    tokenizer = rwkv_clip.get_tokenizer("RWKV-CLIP-B32")

Importing this package compiles nothing, reads no environment variables and starts no
process group.
"""
from .config import ModelArgs, load_model_configs
from .errors import CheckpointError, ConfigError
from .factory import create_model_and_transforms
from .image_rwkv import Image_RWKV
from .layers import DropPath
from .loss import ClipLoss
from .model import create_RWKV_Model, get_model, load_model_weight
from .ops import wkv6_bidirectional
from .pretrained import get_tokenizer, list_pretrained
from .text_rwkv import Text_RWKV
from .tokenizer import tokenize
from .transform import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, image_transform

__version__ = "0.1.0"

__all__ = ["load_model_configs", "create_RWKV_Model", "get_model", "Image_RWKV",
           "Text_RWKV", "DropPath", "ClipLoss", "tokenize", "image_transform",
           "load_model_weight", "wkv6_bidirectional", "ConfigError", "CheckpointError",
           "ModelArgs", "OPENAI_DATASET_MEAN", "OPENAI_DATASET_STD", "list_pretrained",
           "create_model_and_transforms", "get_tokenizer", "__version__"]
