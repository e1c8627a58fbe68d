"""Fine-tuning of vision-language-action robot policies in MuJoCo (HABC, baselines, datasets)."""
