"""`vlm_judge`: a vision-language model asked over an OpenAI-compatible chat-completions API (vLLM's
`vllm serve`, SGLang, a hosted endpoint) to judge each image against its prompt, in the manner of
UnifiedReward and LLM-as-judge rewards.

Each image is one request to ``URL/chat/completions``: a user message holding the image as a base64
PNG data URL and the text of `template` with ``{prompt}`` replaced by the image's prompt, answered at
temperature 0. The score is read from the reply in the declared `score_format`:

- ``number``: the first number in the reply's text, which must lie in `score_range` (then mapped to
  [0, 1] over it);
- ``yes_no``: P(yes) / (P(yes) + P(no)) from the log-probabilities of the reply's first token (the
  server's ``top_logprobs``), the tokens compared in lower case without spaces; a server that returns
  no log-probabilities for them gives a failed reply.

A request that fails (no connection, a timeout, a 5xx) or a reply that cannot be read is asked again,
`retries` attempts in all; then the batch fails with a `RewardServerError` that counts its failed
images and names the last problem, and the trainer stops with its last checkpoint: a judge never
gives a silent 0. At most `max_in_flight` requests are open at once. The API key, when the server
needs one, is read from the environment variable `api_key_env` at each request (never from the
config, which is saved with the run).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from diffusion_rl.reward_server import (
    CHECK_IMAGE_SIZE,
    SERVER_CHECK,
    JsonPoster,
    RewardServerError,
    check_server_options,
    png_base64,
)
from diffusion_rl.rewards import OPTIONS_KEY, ImageBatch, as_image_list
from mmrl.config import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards import RewardFn

DEFAULT_JUDGE_URL = "http://127.0.0.1:8000/v1"
TEMPLATES = {
    "yes_no": 'Does this image show "{prompt}"? Answer yes or no.',
    "number": 'How well does this image show "{prompt}"? Answer with one number from 0 to 10.',
}
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


class UnreadableReply(ValueError):
    """A judge's reply without a score in the declared format."""


def score_of(answer: dict[str, Any], score_format: str, low: float, high: float) -> float:
    """The [0, 1] score in a chat-completions answer (the module docstring); UnreadableReply otherwise."""
    try:
        choice = answer["choices"][0]
        text = choice["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise UnreadableReply(f"not a chat completion: {json.dumps(answer)[:200]}") from None
    if score_format == "number":
        found = NUMBER.search(text)
        if found is None:
            raise UnreadableReply(f"no number in the reply {text[:200]!r}")
        value = float(found.group())
        if not low <= value <= high:
            raise UnreadableReply(f"the reply's number {value:g} is outside score_range [{low:g}, {high:g}]")
        return (value - low) / (high - low)
    try:
        first = choice["logprobs"]["content"][0]["top_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise UnreadableReply("the server returned no top_logprobs for the reply's first token") from None
    probability = {"yes": 0.0, "no": 0.0}
    for entry in first:
        token = str(entry.get("token", "")).strip().lower()
        logprob = entry.get("logprob")
        if token in probability and isinstance(logprob, int | float) and math.isfinite(logprob):
            probability[token] += math.exp(logprob)
    total = probability["yes"] + probability["no"]
    if total == 0:
        raise UnreadableReply(f"neither yes nor no in the first token's top_logprobs (reply {text[:80]!r})")
    return probability["yes"] / total


@REWARDS.register("vlm_judge")
def vlm_judge(
    model: str,
    url: str = DEFAULT_JUDGE_URL,
    score_format: str = "yes_no",
    template: str | None = None,
    score_range: Sequence[float] = (0, 10),
    max_tokens: int = 8,
    timeout: float = 60,
    retries: int = 3,
    backoff: float = 1.0,
    max_in_flight: int = 8,
    api_key_env: str | None = None,
) -> RewardFn:
    """A VLM judge's score of each image for its prompt, in [0, 1] (the module docstring). `model` is
    the served model's name; `url` the API's base (its ``/chat/completions`` is asked)."""
    check_server_options(url, timeout, retries, backoff, DEFAULT_JUDGE_URL)
    if score_format not in TEMPLATES:
        raise ConfigError(
            f"config error: {OPTIONS_KEY}.score_format = {score_format!r}: yes_no (the log-probabilities of "
            "yes and no) or number (the first number of the reply, in score_range)"
        )
    template = TEMPLATES[score_format] if template is None else template
    if "{prompt}" not in template:
        raise ConfigError(
            f"config error: {OPTIONS_KEY}.template = {template!r} has no {{prompt}}: the judge would not "
            "see what the image was asked to show"
        )
    if len(score_range) != 2 or not score_range[0] < score_range[1]:
        raise ConfigError(
            f"config error: {OPTIONS_KEY}.score_range = {score_range!r}: give [low, high] with low < high"
        )
    for key, value in (("max_tokens", max_tokens), ("max_in_flight", max_in_flight)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"config error: {OPTIONS_KEY}.{key} = {value!r}: must be an integer >= 1")
    if api_key_env is not None and not os.environ.get(api_key_env):
        raise ConfigError(
            f"config error: {OPTIONS_KEY}.api_key_env = {api_key_env!r}: that environment variable is not "
            "set; export the API key in it (keys are never written in the config, which a run saves)"
        )
    low, high = float(score_range[0]), float(score_range[1])
    endpoint = url.rstrip("/") + "/chat/completions"

    def ask(image: Tensor, prompt: str) -> float:
        """One image's score, asking again while the reply cannot be read (`retries` attempts)."""
        headers = {"Authorization": f"Bearer {os.environ[api_key_env]}"} if api_key_env else None
        poster = JsonPoster(endpoint, timeout, retries, backoff, headers)
        content = [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_base64(image)}"}},
            {"type": "text", "text": template.replace("{prompt}", prompt)},
        ]
        request = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": max_tokens,
        }
        if score_format == "yes_no":
            request |= {"logprobs": True, "top_logprobs": 10}
        body, problem = json.dumps(request).encode(), ""
        for _ in range(retries):
            answer = poster.post(body)  # retries its own failures; RewardServerError past them
            try:
                return score_of(json.loads(answer), score_format, low, high)
            except ValueError as err:  # invalid JSON, or UnreadableReply
                problem = str(err)
        raise UnreadableReply(f"{retries} replies could not be read; the last: {problem}")

    def reward(images: ImageBatch, prompts: Sequence[str] | None = None, **_: Any) -> Tensor:
        images = as_image_list(images)
        if prompts is None or len(prompts) != len(images):
            raise ValueError(f"the vlm_judge reward needs one prompt per image ({len(images)} images)")
        if not images:
            return torch.zeros(0, dtype=torch.float32)
        with ThreadPoolExecutor(max_workers=min(max_in_flight, len(images))) as pool:
            futures = [pool.submit(ask, image, prompt) for image, prompt in zip(images, prompts, strict=True)]
        scores, failed, last = [], 0, ""
        for future in futures:
            error = future.exception()
            if error is None:
                scores.append(future.result())
            elif isinstance(error, RewardServerError | UnreadableReply):
                failed, last = failed + 1, str(error)
            else:
                raise error
        if failed:
            raise RewardServerError(
                f"the judge at {endpoint} could not score {failed} of {len(images)} images; the last "
                f"problem: {last}"
            )
        return torch.tensor(scores, dtype=torch.float32)

    def check_server(prompt: str) -> None:
        """One blank image judged now: RewardServerError if the server does not answer it."""
        reward([torch.full((3, CHECK_IMAGE_SIZE, CHECK_IMAGE_SIZE), 0.5)], prompts=[prompt])

    setattr(reward, SERVER_CHECK, check_server)
    return reward
