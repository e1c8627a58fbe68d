"""Faults of the diffusion family a user meets through the command line, each refused in one line: pickle
weights, rewards that return the wrong number of values or values past float32, reward servers that
trickle, are down at the start or die in a held-out evaluation, prompt files that are not UTF-8 or hold
prompts the model cannot read, a dry run that skipped the prompt count, and `mmrl replica` options.

A mistake found before the run starts exits 2 with one ``error:`` line and writes nothing; a started run
that cannot go on exits 1, says why in one line and in stopped.json, and keeps its checkpoint."""

import json
import socket
import socketserver
import time
from pathlib import Path

import pytest
import torch
from local_server import LocalServer
from safetensors.torch import load_file
from test_image_rewards import FakeRewardServer
from test_replicas import HELDOUT_PROMPTS, TRAIN_PROMPTS
from tiny_flow import SMALL

from diffusion_rl.models import FlowPipeline
from diffusion_rl.shapes import vocabulary
from mmrl.cli import load_plugins, main
from mmrl.registry import REPLICAS

load_plugins()
TINY = ["steps=1", "progress=false", "rollout.prompts_per_step=1", "rollout.steps=6", "eval.prompts=2"]
TINY += ["eval.steps=4", "rollout.branch_factor=4"]  # flat_grpo: 4 leaves per prompt
PLUGIN = """
import torch
from mmrl.registry import REWARDS


@REWARDS.register("fault_short")
def fault_short():
    return lambda images, **_: torch.ones(len(images) - 1)


@REWARDS.register("fault_long")
def fault_long():
    return lambda images, **_: torch.ones(len(images) + 1)


@REWARDS.register("fault_huge")
def fault_huge():
    return lambda images, **_: [1e308] * len(images)
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> str:
    """A --plugin file registering rewards that return too few, too many and too large values."""
    path = tmp_path_factory.mktemp("plugin") / "fault_rewards.py"
    path.write_text(PLUGIN)
    return str(path)


def run(argv: list[str]) -> int:
    """`mmrl ARGV` in this process: its exit code, whether returned or raised (argparse exits)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)


def error_line(capsys) -> str:
    """The one `error:` line on stderr; no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def train(out: Path, *overrides: str, recipe: str = "diffusion/flat_grpo", plugin: str | None = None) -> int:
    plugins = ["--plugin", plugin] if plugin else []
    return run(["train", recipe, *plugins, f"output_dir={out}", *TINY, *overrides])


# -- 1: weights only ever from safetensors ---------------------------------------------------------


def test_a_model_with_pickle_weights_is_refused_before_anything_is_written(tmp_path, capsys):
    model = tmp_path / "model"
    pipe = FlowPipeline.tiny(vocabulary(), SMALL)
    pipe.save_pretrained(model)
    pipe.denoiser.save_pretrained(model / "transformer", safe_serialization=False)
    (model / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    encoder = model / "text_encoder"
    torch.save(load_file(encoder / "model.safetensors"), encoder / "pytorch_model.bin")
    (encoder / "model.safetensors").unlink()

    assert train(tmp_path / "run", f"model.path={model}") == 2
    line = error_line(capsys)
    assert f"model.path = '{model}'" in line and "pickle" in line and "safe_serialization=True" in line
    assert not (tmp_path / "run").exists()
    assert run(["eval", "diffusion", f"models=[{model}]", f"output_dir={tmp_path / 'eval'}"]) == 2
    assert "pickle" in error_line(capsys) and not (tmp_path / "eval").exists()


# -- 2, 5: a reward's output is one float32 number per sample ---------------------------------------


@pytest.mark.parametrize(
    ("reward", "said"),
    [
        ("fault_short", "'fault_short' returned shape (3,) for 4 samples"),
        ("fault_long", "'fault_long' returned shape (5,) for 4 samples"),
        ("fault_huge", "'fault_huge' returned 1e+308 (sample 0), beyond float32's range"),
    ],
)
def test_a_reward_of_the_wrong_length_or_past_float32_stops_the_run(plugin, tmp_path, capsys, reward, said):
    out = tmp_path / "run"
    assert train(out, f"reward.name={reward}", "eval.gold_reward=null", plugin=plugin) == 1
    line = error_line(capsys)
    assert said in line and "checkpoint of step 0" in line
    stopped = json.loads((out / "stopped.json").read_text())
    assert said in stopped["reason"] and stopped["checkpoint"].endswith("step_00000000")
    assert not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text()


def test_a_reward_of_the_wrong_length_in_the_held_out_evaluation_stops_the_run(plugin, tmp_path, capsys):
    """With a gold reward the trained reward also scores the held-out samples, before training."""
    out = tmp_path / "run"
    assert train(out, "reward.name=fault_short", plugin=plugin) == 1
    line = error_line(capsys)
    assert "in the held-out evaluation, reward 'fault_short' returned shape (1,) for 2 samples" in line
    assert json.loads((out / "stopped.json").read_text())["checkpoint"] is None


# -- 3, 4: reward servers ------------------------------------------------------------------------


class TricklingServer(LocalServer):
    """A local HTTP server that answers every request with a valid reward, one byte every 0.25 s."""

    def __init__(self) -> None:
        super().__init__()
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += self.request.recv(65536)
                head, body = data.split(b"\r\n\r\n", 1)
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                while len(body) < length:
                    body += self.request.recv(65536)
                answer = json.dumps({"rewards": [0.5]}).encode()
                reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer)
                for byte in reply:
                    if server.stopping.wait(0.25):
                        return
                    try:
                        self.request.sendall(bytes([byte]))
                    except OSError:  # the client gave up
                        return

        tcp = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        tcp.daemon_threads = True
        self.serve(tcp, "/reward")


def http_reward(url: str) -> list[str]:
    return ["reward.name=http_reward", f"reward.options={{url: '{url}', timeout: 1, retries: 1}}"]


def test_a_server_that_trickles_its_answer_times_out_within_the_timeout(tmp_path, capsys):
    server = TricklingServer()
    try:
        started = time.monotonic()
        assert train(tmp_path / "run", *http_reward(server.url)) == 2
        elapsed = time.monotonic() - started
    finally:
        server.close()
    line = error_line(capsys)
    assert server.url in line and "timed out" in line and "timeout = 1 s" in line
    assert elapsed < 20  # the answer takes about 12 s to trickle; the request is cut at 1 s
    assert not (tmp_path / "run").exists()


def test_a_reward_server_down_at_the_start_is_refused_before_anything_is_written(tmp_path, capsys):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/reward"
    assert train(tmp_path / "run", *http_reward(url)) == 2
    line = error_line(capsys)
    assert (
        f"config error: reward: reward server {url} failed 1 times" in line and "reward.options.url" in line
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("answered", [1, 3])  # the check at setup, then: before / after training
def test_a_reward_server_dying_in_the_held_out_evaluation_stops_the_run_and_keeps_its_work(
    tmp_path, capsys, answered
):
    """Requests: the check at setup, the evaluation before training, the step, the one after."""
    alive = {"until": answered}

    def respond(n: int, payload: dict) -> tuple[int, object]:
        if n >= alive["until"]:
            return 500, {"error": "down"}
        return 200, {"rewards": [0.5] * len(payload["images"])}

    server = FakeRewardServer(respond)
    out = tmp_path / "run"
    try:
        assert train(out, *http_reward(server.url)) == 1
        line = error_line(capsys)
        assert f"in the held-out evaluation, reward 'http_reward': reward server {server.url}" in line
        stopped = json.loads((out / "stopped.json").read_text())
        if answered == 1:  # before training: nothing to keep yet
            assert stopped["checkpoint"] is None and "launch the run again" in line
            assert not (out / "final").exists()
            return
        assert stopped["checkpoint"].endswith("step_00000001")
        assert (out / "final").is_dir() and f"`mmrl eval {out / 'config.yaml'}`" in line
        alive["until"] = 1000  # the server is back: the command the line gives evaluates the checkpoint
        assert run(["eval", str(out / "config.yaml")]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == 1
    finally:
        server.close()


# -- 6, 7: prompt files --------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["prompt_file", "eval.prompt_file"])
def test_a_prompt_file_that_is_not_utf8_is_one_line(tmp_path, capsys, key):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a red square\na r\xe9d circle\n")
    assert train(tmp_path / "run", f"{key}={prompts}") == 2
    line = error_line(capsys)
    assert f"{key} = '{prompts}' is not UTF-8 text: byte 16 (line 2) is 0xe9" in line
    assert "save the file as UTF-8" in line and not (tmp_path / "run").exists()


LONG = "a red square and a blue circle and a green triangle and a white cross and a purple square"


@pytest.mark.parametrize(
    ("key", "prompt", "said"),
    [
        ("prompt_file", "a photo of a red square", "the word 'photo' is not in the model's vocabulary"),
        ("prompt_file", "a red squäre", "the word 'squäre' is not in the model's vocabulary"),
        ("prompt_file", LONG, "is 21 tokens long, more than the 16 the model's text encoder reads"),
        ("eval.prompt_file", "a photo of a red square", "the word 'photo'"),
        ("eval.prompt_file", LONG, "is 21 tokens long"),
    ],
)
def test_a_prompt_the_tiny_model_cannot_read_is_refused_at_setup(tmp_path, capsys, key, prompt, said):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"a red square\n\n{prompt}\na blue circle\n")
    assert train(tmp_path / "run", f"{key}={prompts}", "eval.prompts=3") == 2
    line = error_line(capsys)
    assert f"{key} = '{prompts}' line 3 ({prompt!r})" in line and said in line
    assert not (tmp_path / "run").exists()


def test_a_diffusers_model_reads_long_prompts_cut_and_says_how_many(tmp_path, capsys):
    replicas = tmp_path / "replicas"
    model, clip = REPLICAS.get("sd35m")(replicas / "sd35m"), REPLICAS.get("pickscore")(replicas / "pickscore")
    train_file, heldout_file = tmp_path / "train.txt", tmp_path / "heldout.txt"
    train_file.write_text("\n".join([*TRAIN_PROMPTS, " and ".join([LONG] * 2)]) + "\n")
    heldout_file.write_text("\n".join(HELDOUT_PROMPTS) + "\n")
    overrides = [
        f"model.path={model}",
        f"prompt_file={train_file}",
        f"eval.prompt_file={heldout_file}",
        f"reward.options.model_path={clip}",
        f"eval.gold_reward.options.model_path={clip}",
        f"output_dir={tmp_path / 'run'}",
        *["steps=1", "progress=false", "rollout.image_size=64", "rollout.prompts_per_step=1"],
        *["rollout.branch_factor=4", "rollout.steps=3", "eval.prompts=2", "eval.steps=2"],
    ]
    assert run(["train", "diffusion/sd35m_pickscore_lora", *overrides]) == 0
    err = capsys.readouterr().err
    assert err.count("prompts are longer than the text encoders read") == 1, err
    line = next(line for line in err.splitlines() if "longer than the text encoders read" in line)
    count = len(TRAIN_PROMPTS) + 1 + len(set(HELDOUT_PROMPTS[:2]) - set(TRAIN_PROMPTS))
    assert f"warning: 1 of the {count} training and held-out prompts" in line
    assert f"the first: prompt_file = '{train_file}' line {len(TRAIN_PROMPTS) + 1}" in line


# -- 8: the dry run checks what train checks ------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "overrides", "said"),
    [
        (
            "diffusion/nft",
            ["rollout.prompts_per_step=4096"],
            "rollout.prompts_per_step = 4096 x 1 process(es)",
        ),
        ("diffusion/flat_grpo", ["rollout.prompts_per_step=300", "--processes", "2"], "300 x 2 process(es)"),
    ],
)
def test_a_dry_run_refuses_more_prompts_per_step_than_the_pool_at_once(
    tmp_path, capsys, recipe, overrides, said
):
    started = time.monotonic()
    assert run(["train", recipe, f"output_dir={tmp_path / 'run'}", "--dry-run", *overrides]) == 2
    assert time.monotonic() - started < 30
    line = error_line(capsys)
    assert said in line and "the 540 built-in prompts" in line and not (tmp_path / "run").exists()


def test_a_dry_run_reads_the_prompt_file_as_train_does(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\na blue circle\n")
    args = [
        "train",
        "diffusion/flat_grpo",
        "--dry-run",
        f"output_dir={tmp_path / 'run'}",
        f"prompt_file={prompts}",
    ]
    assert run(args) == 2
    assert "is more than the 2 prompts of prompt_file" in error_line(capsys)
    prompts.write_bytes(b"\xff\xfea red square\n")
    assert run([*args, "rollout.prompts_per_step=1"]) == 2
    assert "is not UTF-8 text: byte 0 (line 1) is 0xff" in error_line(capsys)


# -- 9: mmrl replica -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "said"),
    [
        pytest.param(
            "device=cuda",
            "device = 'cuda' does not exist on this machine",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
        ("device=banana", "device = 'banana' is not a device"),
        ("output_dir={file}", "is a file: give a directory path"),
        (f"seed={2**70}", f"seed = {2**70} must be an integer from 0 to {2**64 - 1}"),
        ("seed=-1", "seed = -1 must be an integer from 0"),
    ],
)
def test_replica_options_are_checked_before_anything_is_written(tmp_path, capsys, option, said):
    (tmp_path / "file").write_text("a file")
    option = option.format(file=tmp_path / "file")
    assert run(["replica", "sd35m", f"output_dir={tmp_path / 'replica'}", option]) == 2
    assert said in error_line(capsys)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]
    assert (tmp_path / "file").read_text() == "a file"


@pytest.mark.parametrize("name", ["pickscore", "qwen25vl_3b"])
def test_full_size_replica_weights_are_refused_when_they_do_not_fit(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setenv("MMRL_MEMORY_LIMIT_GB", "0.5")
    started = time.monotonic()
    assert run(["replica", name, "full=true", "weights=true", f"output_dir={tmp_path / 'replica'}"]) == 2
    assert time.monotonic() - started < 60
    line = error_line(capsys)
    assert f"mmrl replica {name} full=true weights=true builds" in line
    assert "MMRL_MEMORY_LIMIT_GB allows 0.5 GiB available" in line and "weights=false" in line
    assert not (tmp_path / "replica").exists()
