"""`mmrl train RECIPE --dry-run`: the plan built on the meta device against the allocations a CPU run
of the same recipe makes (measured by torch's profiler), the full-size plan without weights, the batch
on another number of processes, and the errors."""

import pytest
import torch
from safetensors.torch import load_file
from test_replicas import RECIPES, TRAIN_PROMPTS, replica_run
from torch.profiler import ProfilerActivity, profile

from diffusion_rl.loading import load
from mmrl.cli import load_plugins, main
from mmrl.config import load_config
from mmrl.memory_plan import (
    LaunchConfig,
    LiveTensorBytes,
    MemoryPlan,
    PhasePeak,
    fused_attention_on_meta,
    largest_blocks,
)
from mmrl.registry import REPLICAS, TRAINERS

load_plugins()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    return {name: REPLICAS.get(name)(root / name) for name in ("sd35m", "flux_dev", "pickscore")}


def peak_allocation(run) -> int:
    """The most bytes the CPU allocator held at once during `run()` beyond what it held before, from
    the profiler's allocation and free events in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


RUNS = {
    **RECIPES,
    "diffusion/nft": (
        None,
        ["rollout.prompts_per_step=2", "rollout.group_size=8", "rollout.steps=4", "eval.prompts=16"],
    ),
}


def run_config(recipe, replicas, tmp_path, *extra):
    """The recipe on its replica, small; a LoRA recipe with its base in bfloat16 on the CPU too, as the
    plan holds it (model.base_dtype auto plans the GPU's bfloat16)."""
    model, sizes = RUNS[recipe]
    overrides = (
        ["steps=1", "progress=false", "eval.steps=2"]
        if model is None
        else replica_run(replicas, model, tmp_path)
    )
    if load_config(recipe, []).model.lora_rank > 0:
        overrides.append("model.base_dtype=bfloat16")
    return load_config(recipe, [*overrides, f"output_dir={tmp_path / 'run'}", *sizes, *extra])


SLOW_RUNS = ("diffusion/sol_rl_flux",)  # the FLUX replica's plan is checked by flux_dev_branchgrpo


@pytest.mark.parametrize(
    "recipe", [pytest.param(r, marks=pytest.mark.slow) if r in SLOW_RUNS else r for r in sorted(RUNS)]
)
def test_the_plan_is_within_a_fifth_of_what_a_cpu_run_allocates(replicas, tmp_path, recipe):
    config = run_config(recipe, replicas, tmp_path)
    trainer_class = TRAINERS.get(config.trainer)
    plan = trainer_class.memory_plan(config, recipe, 1)
    measured = peak_allocation(lambda: trainer_class(config).train())  # loading the weights included
    assert abs(plan.peak_bytes / measured - 1) < 0.2, (plan.peak_bytes, measured)


def test_meta_tensors_count_what_the_same_cpu_update_allocates(replicas):
    """Attention as a fused kernel on the meta device: the math path would hold every attention matrix."""
    peaks = {}
    for device in ("cpu", "meta"):
        with torch.device(device):
            pipe = load(replicas["sd35m"], weights=False)
        cond, uncond = pipe.encode_prompts(["a red square"] * 4), pipe.encode_prompts([""] * 4)
        x = torch.zeros(4, *pipe.latent_shape(), device=device)
        tracker = LiveTensorBytes()
        with fused_attention_on_meta(), tracker:
            pipe.velocity(
                x, torch.full((4,), 0.5, device=device), cond, 4.5, uncond
            ).square().mean().backward()
        peaks[device] = tracker.peak
    assert peaks["meta"] == peaks["cpu"] > 0


def test_a_run_that_skips_a_phase_is_planned_without_it():
    """`mmrl bench gpu` times training steps that never evaluate: their peak leaves evaluation out."""
    phases = {"update": PhasePeak(10, 20, 100), "evaluation (4 prompts)": PhasePeak(10, 20, 300)}
    plan = MemoryPlan("r", 1, 0, 0, 0, other_weights={"vae": 7}, phases=phases, held={"buffer": 3})
    assert plan.peak_phase == "evaluation (4 prompts)" and plan.peak_bytes == 330 + 10
    assert plan.peak_bytes_of(["update"]) == 130 + 10


def test_fsdp_shards_the_trained_module_and_gathers_its_blocks(replicas, tmp_path, capsys):
    """`--launch` with the recipe's FSDP config: 1/N of the denoiser's weights, gradients and optimizer
    states per process, two wrapped blocks gathered in bfloat16, the frozen encoders whole (eight
    training prompts: the plan checks a step on 8 processes draws no prompt twice, as train does)."""
    prompts = tmp_path / "eight_prompts.txt"
    prompts.write_text("\n".join(TRAIN_PROMPTS * 2) + "\n")
    config = run_config("diffusion/sd35m_pickscore_lora", replicas, tmp_path, f"prompt_file={prompts}")
    whole = TRAINERS.get(config.trainer).memory_plan(config, "sd35m", 8)
    launch = LaunchConfig.from_file("configs/accelerate/fsdp_1node_8gpu_sd3.yaml")
    assert (launch.processes, launch.fsdp, launch.wrap_classes) == (8, True, ("JointTransformerBlock",))
    plan = whole.sharded(launch)
    with torch.device("meta"):
        denoiser = load(replicas["sd35m"], weights=False).denoiser
    block = whole.blocks["JointTransformerBlock"]  # with its LoRA layers
    assert largest_blocks(denoiser)["JointTransformerBlock"] < block < whole.trained_module_parameters()
    assert plan.held["FSDP gathered blocks"] == 2 * block * 2  # this one and the prefetched one, bf16
    for name, phase in whole.phases.items():
        assert plan.phases[name].weights == phase.weights // 8
        assert plan.phases[name].optimizer == phase.optimizer // 8
    update = next(name for name in whole.phases if name.startswith("update"))
    assert whole.phases[update].gradients == whole.gradients > 0
    shrink = whole.gradients - whole.gradients // 8
    assert plan.phases[update].transient == whole.phases[update].transient - shrink
    assert plan.other_weights == whole.other_weights  # text encoders, VAE, reward models: not sharded
    assert plan.peak_bytes < whole.peak_bytes
    ddp = LaunchConfig.from_file("configs/accelerate/ddp_1node_8gpu.yaml")
    assert not ddp.fsdp and whole.sharded(ddp).phases == whole.phases
    flux_blocks = "FluxSingleTransformerBlock, which the model does not have; its block classes: Joint"
    with pytest.raises(ValueError, match=flux_blocks):
        whole.sharded(LaunchConfig.from_file("configs/accelerate/fsdp_1node_8gpu_flux.yaml"))
    # on the command line the launch file sets the processes
    args = ["train", "diffusion/sd35m_pickscore_lora", "--dry-run", *replica_run(replicas, "sd35m", tmp_path)]
    args.append(f"prompt_file={prompts}")
    assert main([*args, "--launch", "configs/accelerate/fsdp_1node_8gpu_sd3.yaml"]) == 0
    out = capsys.readouterr().out
    assert "on 8 process(es)" in out and "FSDP gathered blocks" in out and "note: FSDP over 8" in out
    assert main([*args, "--launch", "configs/accelerate/fsdp_1node_8gpu_sd3.yaml", "--processes", "2"]) == 2
    assert "--processes 2 but" in capsys.readouterr().err
    assert main([*args, "--launch", str(tmp_path / "none.yaml")]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_a_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "diffusion/nft", f"output_dir={out}", "--dry-run"]) == 0
    text = capsys.readouterr().out
    for line in ("parameters", "trainable", "optimizer states", "activations", "expected peak"):
        assert line in text
    assert "denoiser evaluations in rollouts: 640" in text  # 4 prompts x 16 samples x 10 steps
    assert not out.exists()


def test_the_batch_that_keeps_the_recipe_s_on_fewer_processes(tmp_path, capsys):
    args = ["train", "diffusion/nft", f"output_dir={tmp_path / 'run'}", "processes=8", "--dry-run"]
    assert main([*args, "--processes", "2"]) == 0
    text = capsys.readouterr().out
    assert "rollout.prompts_per_step=16 keeps that on 2" in text  # 4 per process x 8 = 32 in all
    assert (
        "warning: on 2 process(es) the effective rollout.prompts_per_step is 8, not the recipe's 32" in text
    )
    assert main([*args, "--processes", "3"]) == 0
    assert "which 3 process(es) cannot split evenly" in capsys.readouterr().out
    assert main([*args, "--processes", "8"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_a_run_on_another_number_of_processes_than_the_recipe_s_warns(replicas, tmp_path, capsys):
    config = run_config("diffusion/sd35m_pickscore_lora", replicas, tmp_path, "processes=4")
    TRAINERS.get(config.trainer)(config).train()
    assert "written for 4 process(es); on 1 the effective batch differs" in capsys.readouterr().err


def test_dry_run_mistakes_are_one_line_errors(tmp_path, capsys):
    assert main(["train", "diffusion/nft", f"output_dir={tmp_path / 'a'}", "--processes", "2"]) == 2
    assert "use them with --dry-run" in capsys.readouterr().err
    assert main(["train", "pretrain/vla", f"output_dir={tmp_path / 'b'}", "--dry-run"]) == 2
    assert "the vla_bc trainer has no memory plan yet; trainers with one: " in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def full_size_flux(tmp_path) -> list[str]:
    """FLUX.1-dev and PickScore at full size without weights (`mmrl replica NAME full=true`), as the
    recipe's overrides."""
    flux, clip = tmp_path / "flux", tmp_path / "pickscore"
    assert main(["replica", "flux_dev", "full=true", f"output_dir={flux}"]) == 0
    assert main(["replica", "pickscore", "full=true", f"output_dir={clip}"]) == 0
    assert not list(flux.rglob("*.safetensors"))
    return [
        f"model.path={flux}",
        f"reward.options.model_path={clip}",
        f"eval.gold_reward.options.model_path={clip}",
    ]


def test_the_full_size_model_plans_from_its_configs_alone(tmp_path, capsys):
    """FLUX.1-dev at full size with LoRA, in seconds."""
    overrides = full_size_flux(tmp_path)
    capsys.readouterr()
    config = load_config("diffusion/flux_dev_branchgrpo_lora", overrides)
    trainer_class = TRAINERS.get(config.trainer)
    plan = trainer_class.memory_plan(config, "flux", 8).as_dict()
    # transformer 11.9B, T5-XXL 4.76B, CLIP-L 0.12B, VAE 0.08B
    assert 16.8e9 < plan["parameters"] < 17.0e9
    assert 0 < plan["trainable_parameters"] < 0.01 * plan["parameters"]  # a LoRA adapter
    sizes = plan["bytes"]
    # the transformer's frozen base in bfloat16 (model.base_dtype auto, on a GPU) with its float32
    # adapter, the text encoders in bfloat16 (model.frozen_dtype), the reward models
    transformer = sizes["weights"] - sum(plan["other_weights"].values())
    adapter = 4 * plan["trainable_parameters"]
    assert 2 * 11.8e9 < transformer - adapter < 2 * 11.95e9
    assert plan["other_weights"]["text encoders"] < 2.01 * 4.88e9
    assert sizes["gradients"] == 4 * plan["trainable_parameters"]
    # AdamW's two moments, and a step count per tensor
    assert 2 * sizes["gradients"] < sizes["optimizer_states"] < 2 * sizes["gradients"] + 10_000
    assert sizes["peak"] > sizes["weights"] + sizes["activations_and_gradients"] - 1


@pytest.mark.slow
def test_at_full_size_gradient_checkpointing_cuts_the_update_s_activations_fivefold(tmp_path):
    """The recipe recomputes blocks in the backward pass; keeping their activations costs far more.
    (The same cut on a replica, with the same result: the next test.)"""
    overrides = full_size_flux(tmp_path)
    plans = {
        flag: TRAINERS.get("branch_grpo").memory_plan(
            load_config(
                "diffusion/flux_dev_branchgrpo_lora", [*overrides, f"model.gradient_checkpointing={flag}"]
            ),
            "flux",
            8,
        )
        for flag in ("true", "false")
    }
    update = next(name for name in plans["true"].phases if name.startswith("update"))
    assert plans["true"].phases[update].transient * 5 < plans["false"].phases[update].transient


def test_gradient_checkpointing_cuts_the_update_s_activations_and_not_its_result(replicas, tmp_path):
    results, plans = {}, {}
    for flag in (False, True):
        run = tmp_path / str(flag)
        run.mkdir()
        config = run_config(
            "diffusion/sd35m_pickscore_lora", replicas, run, f"model.gradient_checkpointing={flag}"
        )
        trainer_class = TRAINERS.get(config.trainer)
        plans[flag] = trainer_class.memory_plan(config, "sd35m", 1).phases
        trainer_class(config).train()
        results[flag] = load_file(run / "run" / "final" / "pytorch_lora_weights.safetensors")
    update = next(name for name in plans[False] if name.startswith("update"))
    assert plans[True][update].transient < 0.9 * plans[False][update].transient  # 2 blocks only
    assert results[True].keys() == results[False].keys()
    for name, weight in results[False].items():
        torch.testing.assert_close(results[True][name], weight, rtol=0, atol=1e-6)


def test_frozen_networks_in_bfloat16_take_half_the_memory_and_the_run_trains(replicas, tmp_path):
    recipe = "diffusion/sd35m_pickscore_lora"
    plans = {}
    for dtype in ("float32", "bfloat16"):
        (tmp_path / dtype).mkdir()
        config = run_config(recipe, replicas, tmp_path / dtype, f"model.frozen_dtype={dtype}")
        plans[dtype] = TRAINERS.get(config.trainer).memory_plan(config, recipe, 1).other_weights
    for part in ("text encoders", "vae"):  # integer buffers (position ids) keep their dtype
        assert abs(2 * plans["bfloat16"][part] / plans["float32"][part] - 1) < 0.02
    result = TRAINERS.get(config.trainer)(config).train()  # the bfloat16 run
    assert all(torch.isfinite(torch.tensor(value)) for value in result.values())
    pipe = load(tmp_path / "bfloat16" / "run" / "final")
    assert pipe.denoiser.dtype == torch.float32  # only the frozen networks change dtype, in the run
