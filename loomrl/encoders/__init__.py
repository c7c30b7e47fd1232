"""Vision and audio encoders (transformers' Qwen2-VL / Qwen2-Audio towers) and
their preprocessing, done without torchvision."""
