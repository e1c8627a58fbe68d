"""`vlm_judge` against a local server that speaks vLLM's OpenAI-compatible chat-completions format: the
scores in both formats, the requests in flight, the API key from the environment, and the faults (the
server down at start, gone mid-run, answering garbage or too slowly): clear errors or counted retries,
never a silent 0."""

from __future__ import annotations

import base64
import io
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from local_server import LocalServer
from PIL import Image

from diffusion_rl.judge_reward import score_of
from diffusion_rl.reward_server import RewardServerError, check_reward_server
from diffusion_rl.reward_terms import build_reward
from mmrl.cli import load_plugins
from mmrl.config import ConfigError

load_plugins()

MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
Reply = Callable[[int, float, str], object]  # (request number, image brightness, text) -> content or answer


def completion(content: str, yes: float | None = None) -> dict:
    """A chat completion as vLLM writes it; with `yes`, the first token's top_logprobs for yes and no."""
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    if yes is not None:
        top = [
            {"token": "Yes", "logprob": math.log(max(yes, 1e-9)), "bytes": [89, 101, 115]},
            {"token": "No", "logprob": math.log(max(1 - yes, 1e-9)), "bytes": [78, 111]},
        ]
        choice["logprobs"] = {
            "content": [{"token": content, "logprob": top[0]["logprob"], "top_logprobs": top}]
        }
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": MODEL, "choices": [choice]}


class FakeJudge(LocalServer):
    """A local chat-completions server; `reply` gives each request's answer (a dict sent as JSON, bytes
    sent as they are, or "hang" to answer nothing for 10 s)."""

    def __init__(self, reply: Reply, delay: float = 0.0) -> None:
        super().__init__()
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.open, self.most_open = 0, 0
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.requests.append(request)
                    judge.headers.append(dict(self.headers))
                    number = len(judge.requests) - 1
                    judge.open += 1
                    judge.most_open = max(judge.most_open, judge.open)
                time.sleep(delay)
                if self.path != "/v1/chat/completions" or request.get("model") != MODEL:
                    status, answer = (
                        404,
                        {"object": "error", "message": f"The model `{request.get('model')}` does not exist."},
                    )
                else:
                    image, text = request["messages"][0]["content"]
                    png = base64.b64decode(image["image_url"]["url"].removeprefix("data:image/png;base64,"))
                    brightness = float(np.asarray(Image.open(io.BytesIO(png))).mean() / 255)
                    status, answer = 200, reply(number, brightness, text["text"])
                with judge.lock:
                    judge.open -= 1
                if answer == "hang":
                    judge.stopping.wait(10)
                    return
                body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.serve(ThreadingHTTPServer(("127.0.0.1", 0), Handler), "/v1")


@pytest.fixture
def serve() -> Iterator[Callable[..., FakeJudge]]:
    judges: list[FakeJudge] = []

    def start(reply: Reply, delay: float = 0.0) -> FakeJudge:
        judges.append(FakeJudge(reply, delay))
        return judges[-1]

    yield start
    for judge in judges:
        judge.close()


def judge(url: str, **options):
    return build_reward("vlm_judge", {"model": MODEL, "url": url, "backoff": 0, **options}, "reward.")


def grey(levels: list[float]) -> torch.Tensor:
    return torch.stack([torch.full((3, 16, 16), level) for level in levels])


def test_yes_no_scores_are_the_probability_of_yes_with_bounded_requests_in_flight(serve):
    server = serve(lambda n, brightness, text: completion("Yes", yes=brightness), delay=0.1)
    reward = judge(server.url, max_in_flight=3)
    levels = [0.0, 0.2, 0.5, 0.8, 1.0, 0.5]
    scores = reward(grey(levels), prompts=[f"prompt {i}" for i in range(6)])
    torch.testing.assert_close(scores, torch.tensor(levels), atol=0.01, rtol=0)
    assert server.most_open == 3  # three at once, never more
    texts = sorted(request["messages"][0]["content"][1]["text"] for request in server.requests)
    assert texts[0] == 'Does this image show "prompt 0"? Answer yes or no.'
    assert all(request["temperature"] == 0 and request["top_logprobs"] == 10 for request in server.requests)


def test_number_scores_map_the_range_to_0_1_and_a_number_outside_it_is_a_failure(serve):
    server = serve(lambda n, brightness, text: completion(f"Score: {round(10 * brightness)}/10"))
    scores = judge(server.url, score_format="number")(grey([0.0, 0.7, 1.0]), prompts=["a", "b", "c"])
    torch.testing.assert_close(scores, torch.tensor([0.0, 0.7, 1.0]), atol=1e-6, rtol=0)
    assert "one number from 0 to 10" in server.requests[0]["messages"][0]["content"][1]["text"]
    with pytest.raises(
        RewardServerError, match=r"could not score 1 of 1 images.*outside score_range \[0, 5\]"
    ):
        judge(server.url, score_format="number", score_range=[0, 5], retries=2)(grey([1.0]), prompts=["a"])


def test_a_garbage_reply_is_asked_again_and_never_scored_0(serve):
    garbage = serve(
        lambda n, brightness, text: b"<html>oops</html>" if n == 0 else completion("Yes", yes=0.9)
    )
    assert judge(garbage.url)(grey([0.5]), prompts=["a"]).item() == pytest.approx(0.9, abs=1e-6)
    assert len(garbage.requests) == 2  # the unreadable reply was retried
    words = serve(lambda n, brightness, text: completion("I cannot tell"))  # no log-probabilities
    with pytest.raises(RewardServerError, match=r"could not score 2 of 2 images.*no top_logprobs"):
        judge(words.url, retries=2)(grey([0.5, 0.5]), prompts=["a", "b"])
    assert len(words.requests) == 4  # every image asked retries times


def test_a_server_down_at_start_gone_mid_run_or_too_slow_is_a_clear_error(serve):
    server = serve(lambda n, brightness, text: completion("Yes", yes=brightness))
    reward = judge(server.url, timeout=2, retries=2)
    check_reward_server(reward, "a cat", "reward")  # answers: the run may start
    server.close()
    with pytest.raises(ConfigError, match=r"config error: reward: .*failed 2 times.*start the reward server"):
        check_reward_server(reward, "a cat", "reward")
    with pytest.raises(RewardServerError, match=r"could not score 2 of 2 images.*ConnectionRefusedError"):
        reward(grey([0.5, 0.5]), prompts=["a", "b"])
    slow = serve(lambda n, brightness, text: "hang")
    started = time.monotonic()
    with pytest.raises(RewardServerError, match=r"failed 2 times.*timed out.*timeout = 0.3 s"):
        judge(slow.url, timeout=0.3, retries=2)(grey([0.5]), prompts=["a"])
    assert time.monotonic() - started < 3
    wrong = serve(lambda n, brightness, text: completion("Yes", yes=0.5))
    with pytest.raises(RewardServerError, match=r"HTTP 404.*does not exist"):
        build_reward("vlm_judge", {"model": "other", "url": wrong.url}, "reward.")(grey([0.5]), prompts=["a"])


def test_the_api_key_comes_from_the_environment_only(serve, monkeypatch):
    server = serve(lambda n, brightness, text: completion("Yes", yes=0.5))
    with pytest.raises(ConfigError, match=r"reward.options.api_key_env = 'JUDGE_KEY'.*not set"):
        judge(server.url, api_key_env="JUDGE_KEY")
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    judge(server.url, api_key_env="JUDGE_KEY")(grey([0.5]), prompts=["a"])
    assert server.headers[0]["Authorization"] == "Bearer sk-test"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"score_format": "stars"}, r"score_format = 'stars': yes_no .* or number"),
        ({"template": "Rate it."}, r"template = 'Rate it.' has no \{prompt\}"),
        ({"score_range": [5, 1]}, r"score_range = \[5, 1\]"),
        ({"max_in_flight": 0}, r"max_in_flight = 0: must be an integer >= 1"),
        ({"url": "ftp://host/v1"}, r"url = 'ftp://host/v1'.*http or https"),
        ({"timeout": 0}, r"timeout = 0: must be > 0"),
    ],
)
def test_bad_options_name_their_key(options, message):
    with pytest.raises(ConfigError, match=message):
        build_reward("vlm_judge", {"model": MODEL, **options}, "reward.")


def test_score_of_reads_the_declared_format_only():
    assert score_of(completion("7"), "number", 0, 10) == pytest.approx(0.7)
    assert score_of(completion("yes", yes=0.25), "yes_no", 0, 10) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="no number"):
        score_of(completion("great"), "number", 0, 10)
    with pytest.raises(ValueError, match="not a chat completion"):
        score_of({"rewards": [1]}, "yes_no", 0, 10)
