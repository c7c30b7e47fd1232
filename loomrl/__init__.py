"""loomrl: multimodal RL training platform."""

__version__ = "0.1.0"
