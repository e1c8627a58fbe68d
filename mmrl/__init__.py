"""mmrl: reinforcement-learning post-training for multimodal and embodied models (shared core)."""

__version__ = "0.1.0"
