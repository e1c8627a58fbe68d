"""vLLM's memory beside training: the GPU share or cache size (one of them), and sleep mode, in which
the engine frees its memory after the rollouts and wakes with the new weights before the next ones.
vLLM itself is not installed here: the engine's calls into it and the trainer's calls into the engine
are checked with stand-ins that record them."""

from types import SimpleNamespace

import pytest

import vlm_rl.trainer
from mmrl.cli import load_plugins
from mmrl.config import ConfigError, load_config
from vlm_rl.data import DataConfig, task_vocabulary
from vlm_rl.models import VLMAdapter
from vlm_rl.trainer import ToolGRPOTrainer
from vlm_rl.vllm_engine import VLLMTurnGenerator

load_plugins()


class RecordingLLM:
    """The parts of `vllm.LLM` the engine calls, recording each call."""

    def __init__(self) -> None:
        self.calls: list = []
        self.llm_engine = SimpleNamespace(
            reset_encoder_cache=lambda: self.calls.append("reset encoder cache")
        )

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake", *tags))

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.calls.append((method, len(list(kwargs["weights_iterator"]))))

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset prefix cache")


def engine_over(llm: RecordingLLM, sleeps: bool) -> VLLMTurnGenerator:
    engine = object.__new__(VLLMTurnGenerator)  # without building vLLM
    engine.llm, engine.sleeps, engine.asleep = llm, sleeps, False
    return engine


def test_an_engine_asleep_wakes_its_weights_then_its_cache_around_the_copy():
    model = VLMAdapter.tiny(task_vocabulary(DataConfig(), samples=20)).model
    tensors = len(model.state_dict())
    llm = RecordingLLM()
    engine = engine_over(llm, sleeps=True)
    engine.sleep()
    engine.sleep()  # already asleep: nothing more
    engine.load_weights(model)
    assert llm.calls == [
        ("sleep", 2),
        ("wake", "weights"),
        ("reload_weights", tensors),
        ("wake", "kv_cache"),
        "reset prefix cache",
        "reset encoder cache",
    ]
    assert not engine.asleep

    awake = RecordingLLM()
    engine = engine_over(awake, sleeps=False)
    engine.sleep()  # sleep mode off: the engine keeps its memory
    engine.load_weights(model)
    assert awake.calls == [("reload_weights", tensors), "reset prefix cache", "reset encoder cache"]


class RecordingEngine:
    """A stand-in for VLLMTurnGenerator that generates with the policy and records what the trainer asks."""

    def __init__(self, path, adapter, **options) -> None:
        self.adapter, self.options, self.events, self.awake = adapter, options, [], True

    def load_weights(self, model) -> None:
        self.events.append("load weights")
        self.awake = True

    def sleep(self) -> None:
        self.events.append("sleep")
        self.awake = False

    def generate_turn(self, *args, **kwargs):
        assert self.awake, "the engine generated while asleep"
        if self.events[-1] != "generate":
            self.events.append("generate")
        return self.adapter.generate_turn(*args, **kwargs)

    def close(self) -> None:
        pass


def test_the_trainer_puts_the_engine_to_sleep_for_every_update(tmp_path, monkeypatch):
    monkeypatch.setattr(vlm_rl.trainer, "VLLMTurnGenerator", RecordingEngine)
    monkeypatch.setattr(vlm_rl.trainer, "vllm_available", lambda: True)
    config = load_config(
        "vlm/tool_grpo",
        [
            f"output_dir={tmp_path}",
            "rollout.backend=vllm",
            "rollout.vllm_kv_cache_gib=null",
            "rollout.vllm_gpu_memory_fraction=0.3",
            "rollout.vllm_sleep=true",
            "rollout.max_new_tokens=8",
            "steps=2",
            "train.questions_per_step=2",
            "train.group_size=2",
            "data.heldout_size=2",
            "data.train_size=16",
            "eval_modes=[auto]",
            "progress=false",
        ],
    )
    trainer = ToolGRPOTrainer(config)
    optimise = trainer.optimise

    def recorded_optimise(*args, **kwargs):
        trainer.engine.events.append("update" if not trainer.engine.awake else "update while awake")
        return optimise(*args, **kwargs)

    trainer.optimise = recorded_optimise
    trainer.train()
    engine = trainer.engine
    assert engine.options == {
        "max_model_len": config.rollout.max_tokens,
        "max_images": config.rollout.max_images,
        "kv_cache_gib": None,
        "gpu_memory_fraction": 0.3,
        "sleep": True,
    }
    rollouts = ["load weights", "generate", "sleep"]
    # evaluation before, two training steps, evaluation after
    assert engine.events == rollouts + (rollouts + ["update"]) * 2 + rollouts


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.vllm_gpu_memory_fraction=0.5"], "give exactly one"),
        (["rollout.vllm_kv_cache_gib=null"], "give exactly one"),
        (
            ["rollout.vllm_kv_cache_gib=null", "rollout.vllm_gpu_memory_fraction=1.5"],
            "vllm_gpu_memory_fraction",
        ),
    ],
)
def test_the_cache_size_and_the_gpu_share_are_one_or_the_other(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("vlm/tool_grpo", overrides)
