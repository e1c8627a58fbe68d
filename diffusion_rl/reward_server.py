"""`http_reward`: the client of an external reward server (images as base64 PNGs and the batch's fields
posted as JSON, one reward per image answered), with a deadline on every request, and the check that
refuses a run whose server does not answer before the run writes anything (`check_reward_server`).
It follows the `mmrl.rewards` convention of `diffusion_rl.rewards`."""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import socket
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from diffusion_rl.rewards import OPTIONS_KEY, ImageBatch, as_image_list, to_pil
from mmrl.config import ConfigError
from mmrl.registry import REWARDS
from mmrl.rewards import RewardFn

DEFAULT_REWARD_SERVER_URL = "http://127.0.0.1:8000/reward"
SERVER_CHECK = "check_server"  # the attribute of a reward function that asks its server once (http_reward)
CHECK_IMAGE_SIZE = 32  # side of the blank image `check_server` sends


class RewardServerError(RuntimeError):
    """The reward server could not be reached or answered badly; the trainer stops on it and keeps its
    last checkpoint."""


class _DeadlineSocket(io.RawIOBase):
    """A connected socket as http.client uses it (`sendall`, and `makefile` to read the answer), whose
    every send and receive may take only what is left before `deadline` (of time.monotonic()): a server
    that trickles its answer a byte at a time cannot stretch a request past its deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def time_left(self) -> None:
        """Give the socket what is left of the request's time; TimeoutError once nothing is."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self.time_left()
        self.sock.sendall(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.time_left()
        return self.sock.recv_into(buffer)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self)

    def close(self) -> None:
        """Nothing: http.client closes its connection while the answer is still read from it, so the
        socket is closed by whoever made it, once the answer is read."""


def png_base64(image: Tensor) -> str:
    """A [3, H, W] image as base64 (standard alphabet, no data: prefix) of its 8-bit RGB PNG."""
    buffer = io.BytesIO()
    to_pil(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _excerpt(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "..."


def _parse_rewards(body: bytes, expected: int, url: str) -> Tensor:
    """The "rewards" list of a server answer, checked to be `expected` finite numbers."""
    try:
        answer = json.loads(body)
    except ValueError as error:
        raise RewardServerError(
            f"reward server {url} answered with invalid JSON ({error}): {_excerpt(body)!r}"
        ) from error
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    if not isinstance(rewards, list):
        raise RewardServerError(f"reward server {url} answered without a 'rewards' list: {_excerpt(body)!r}")
    if len(rewards) != expected:
        raise RewardServerError(f"reward server {url} sent {len(rewards)} rewards for {expected} images")
    bad = [
        value
        for value in rewards
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
    ]
    if bad:
        raise RewardServerError(f"reward server {url} sent non-numeric or non-finite rewards: {bad[:5]}")
    return torch.tensor(rewards, dtype=torch.float32)


@REWARDS.register("http_reward")
def http_reward(
    url: str = DEFAULT_REWARD_SERVER_URL, timeout: float = 30, retries: int = 3, backoff: float = 1.0
) -> RewardFn:
    """Rewards from an external server over HTTP (standard library only).

    Protocol: one POST per batch to `url` with a JSON body
    ``{"prompts": [str, ...], "images": [base64 PNG, ...], "metadata": [...]}``, lists aligned with the
    images; prompts are "" when the batch has no `prompts` field, and "metadata" (the batch field of
    that name, any JSON values) is sent only when the batch has it. The server answers 200 with
    ``{"rewards": [number, ...]}``, one finite number per image.

    Each request may take `timeout` seconds in all, from connecting to the last byte of the answer (a
    server that trickles its answer times out as one that sends nothing). Connection errors, timeouts
    and 5xx answers are tried `retries` times in all (the first attempt included), waiting
    ``backoff * 2**k`` seconds after the k-th failure; then a `RewardServerError` names the URL and the
    last error. 4xx answers, redirects (never followed) and malformed answers raise it at once. Proxy
    environment variables are ignored: the server is expected on localhost or the cluster network.

    The reward function's `check_server(prompt)` (`SERVER_CHECK`) sends one blank image, so that a
    trainer can refuse a server that is down before a run starts (`check_reward_server`); building the
    reward contacts no server.
    """
    check_server_options(url, timeout, retries, backoff, DEFAULT_REWARD_SERVER_URL)
    post = JsonPoster(str(url), timeout, retries, backoff).post

    def reward(
        images: ImageBatch,
        prompts: Sequence[str] | None = None,
        metadata: Sequence[Any] | None = None,
        **_: Any,
    ) -> Tensor:
        images = as_image_list(images)
        fields: dict[str, list[Any]] = {
            "prompts": list(prompts) if prompts is not None else [""] * len(images)
        }
        if metadata is not None:
            fields["metadata"] = list(metadata)
        for name, values in fields.items():
            if len(values) != len(images):
                raise ValueError(f"batch field {name!r} has {len(values)} entries for {len(images)} images")
        payload = {**fields, "images": [png_base64(image) for image in images]}
        return _parse_rewards(post(json.dumps(payload).encode()), len(images), url)

    def check_server(prompt: str) -> None:
        """One request of a blank image and `prompt`: RewardServerError if the server does not answer it."""
        reward([torch.full((3, CHECK_IMAGE_SIZE, CHECK_IMAGE_SIZE), 0.5)], prompts=[prompt])

    setattr(reward, SERVER_CHECK, check_server)
    return reward


class JsonPoster:
    """POSTs of JSON to `url` with a deadline on each and retries (the rules of `http_reward`'s
    docstring), shared by the rewards that ask a server; `headers` are added to every request."""

    def __init__(
        self, url: str, timeout: float, retries: int, backoff: float, headers: dict[str, str] | None = None
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.host, self.port = parsed.hostname, parsed.port
        self.target = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
        self.connection_class = (
            http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
        )
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def post_once(self, body: bytes) -> tuple[int, str, str | None, bytes]:
        """One POST within `timeout` seconds in all: status, reason, Location header and answer."""
        deadline = time.monotonic() + self.timeout
        connection, sock = self.connection_class(self.host, self.port, timeout=self.timeout), None
        try:
            connection.connect()
            sock = connection.sock
            connection.sock = _DeadlineSocket(sock, deadline)
            connection.request("POST", self.target, body=body, headers=self.headers)
            response = connection.getresponse()
            return response.status, response.reason, response.getheader("Location"), response.read()
        except TimeoutError:  # the socket's own, or `_DeadlineSocket`'s: one message for both
            raise TimeoutError(f"timed out: no complete answer within timeout = {self.timeout:g} s") from None
        finally:
            connection.close()
            if sock is not None:
                sock.close()

    def post(self, body: bytes) -> bytes:
        """The answer of a 2xx; RewardServerError after `retries` failed attempts (connection errors,
        timeouts, 5xx) or at once (4xx, a redirect)."""
        url, last_error = self.url, ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                status, reason, location, answer = self.post_once(body)
            except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out, cut short
                last_error = f"{type(error).__name__}: {error}"
                continue
            if status < 300:
                return answer
            if status < 400:
                raise RewardServerError(
                    f"reward server {url} redirected (HTTP {status}) to {location!r}; redirects are not "
                    "followed"
                )
            if status < 500:
                raise RewardServerError(
                    f"reward server {url} answered HTTP {status} {reason}: {_excerpt(answer)!r}"
                )
            last_error = f"HTTP {status} {reason}: {_excerpt(answer)!r}"
        raise RewardServerError(f"reward server {url} failed {self.retries} times; last error: {last_error}")


def check_server_options(url: str, timeout: float, retries: int, backoff: float, example: str) -> None:
    """A ConfigError naming the option (reward.options.url, .timeout, ...) a server reward cannot use."""
    parsed = urllib.parse.urlsplit(str(url))
    try:
        port_ok = parsed.port is None or parsed.port >= 0  # None: the scheme's own
    except ValueError:  # not a number in 0..65535
        port_ok = False
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not port_ok:
        raise ConfigError(
            f"config error: {OPTIONS_KEY}.url = {url!r}: the reward server is reached over http or https "
            f"only: write http(s)://HOST[:PORT]/PATH, e.g. {example} (the default)"
        )
    for key, value, allowed, limit in (
        ("timeout", timeout, timeout > 0, "> 0 seconds"),
        ("retries", retries, retries >= 1, ">= 1 (attempts in all)"),
        ("backoff", backoff, backoff >= 0, ">= 0 seconds"),
    ):
        if not allowed:
            raise ConfigError(f"config error: {OPTIONS_KEY}.{key} = {value!r}: must be {limit}")


def check_reward_server(fn: RewardFn, prompt: str, key: str) -> None:
    """Refuse a reward whose server does not answer one request now (a ConfigError naming config key
    `key` and the server), before a run writes anything; rewards without a server pass."""
    check = getattr(fn, SERVER_CHECK, None)
    if check is None:
        return
    try:
        check(prompt)
    except RewardServerError as err:
        raise ConfigError(
            f"config error: {key}: {err}: start the reward server (one that answers within its timeout), "
            f"or give its address as {key}.options.url"
        ) from None
