"""Fine-tuning of vision-language-action robot policies in MuJoCo (HABC, baselines, datasets)."""

import mmrl  # noqa: F401  (first: its package setup, e.g. quieter logging, comes before any model library)
