"""Vision and audio encoders (transformers' Qwen2-VL / Qwen2.5-VL / Qwen2-Audio towers),
their preprocessing (done without torchvision), loading towers from local Hugging Face
checkpoint folders, and the content-hashed encoding cache (cache.py, bench.py)."""
