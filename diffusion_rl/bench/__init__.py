"""The text-to-image benches (`mmrl bench`), one module per measure:

- `method_cost`: `mmrl bench diffusion`, the denoiser evaluations (NFE) and wall-clock per iteration
  of flat GRPO, the BranchGRPO variants, DiffusionNFT and Sol-RL on the same model, as ratios to flat
  GRPO, and the rollout time of each low-precision exploration pass against full precision;
- `gradient_signal`: `mmrl bench diffusion_gradient`, how much of each recipe's update is signal
  (SNR, alignment with a baseline's expected update, signal per second, push along finished runs);
- `real_models`: the text-to-image sections of `mmrl bench gpu`, the real models' architectures at
  their published sizes (FP8 against bfloat16 denoising steps, the FP8 pool's ranking, flat GRPO
  against BranchGRPO with the memory plan against the allocator).

Their rows follow `mmrl.bench_all`'s convention (``<stem>_ratio`` with ``<stem>_target``), so `mmrl
bench all` and `mmrl bench gpu` read their ratios and verdicts.
"""
