"""Image transforms: open_clip's ``image_transform`` with the CLIP mean/std defaults."""
from __future__ import annotations

OPENAI_DATASET_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_DATASET_STD = (0.26862954, 0.26130258, 0.27577711)


def image_transform(image_size, is_train: bool, mean=None, std=None, **kwargs):
    """PIL image -> normalised tensor: resize + center crop (eval) or random resized crop
    (train), as open_clip; mean/std default to CLIP's."""
    from open_clip.transform import image_transform as open_clip_image_transform
    return open_clip_image_transform(image_size, is_train=is_train,
                                     mean=mean or OPENAI_DATASET_MEAN,
                                     std=std or OPENAI_DATASET_STD, **kwargs)
