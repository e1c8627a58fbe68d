"""The flow model most diffusion tests build: the shipped architecture at a size that trains in seconds."""

from diffusion_rl.models import TinyFlowSpec

SMALL = TinyFlowSpec(
    image_size=16, patch_size=4, layers=1, heads=2, head_dim=8, text_hidden=16, text_layers=1
)
