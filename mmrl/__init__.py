"""mmrl: reinforcement-learning post-training for multimodal and embodied models (shared core)."""

import logging

__version__ = "0.1.0"

# bitsandbytes (optimizer: adamw_8bit), which peft imports whenever it is installed, warns at import on
# CPUs with bfloat16 instructions that its 4-bit CPU kernels need another package; mmrl uses none of them
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
