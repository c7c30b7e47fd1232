"""Vision and audio encoders (transformers' Qwen2-VL / Qwen2.5-VL / Qwen2-Audio towers),
their preprocessing (done without torchvision), loading towers from local Hugging Face
checkpoint folders, and the content-hashed encoding cache (cache.py).

Each kind of medium is a registered `Modality` (base.py); the modules below register theirs
when this package is imported.
"""

from loomrl.encoders import audio, video, vision  # noqa: F401  (register the modalities)
