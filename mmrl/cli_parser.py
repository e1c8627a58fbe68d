"""The arguments of the `mmrl` command: a subcommand each (train, pretrain, eval, bench, replica,
report, list), the options common to all (``--plugin``), and key=value arguments allowed between
the options (`parse_args`)."""

from __future__ import annotations

import argparse

DESCRIPTION = "`mmrl` command line: train, pretrain, eval, bench, report, list."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmrl", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a module name, also found in the working directory, or a path to a .py "
        "file) before the config is checked, so that it can name the module's tasks, rewards, "
        "advantages; repeatable",
    )

    add_command(
        sub,
        common,
        "train",
        "train a recipe",
        "Train from a recipe (e.g. core/tiny_grpo) or a YAML path, with dotted overrides such as "
        "train.lr=1e-4. Multi-process: accelerate launch -m mmrl train CONFIG.",
        ("config", "recipe name (see `mmrl list`) or path to a YAML file"),
        "key=value overrides, dotted for sections",
        resume=True,
    )
    train = sub.choices["train"]
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan instead of training: parameters, memory per process (weights, gradients, "
        "optimizer states, activations; the model built on the meta device), work per iteration and the "
        "batch on --processes",
    )
    train.add_argument(
        "--processes", type=int, default=None, metavar="N", help="with --dry-run: plan for N processes"
    )
    train.add_argument(
        "--launch",
        default=None,
        metavar="FILE",
        help="with --dry-run: plan for the Accelerate config FILE you will launch with "
        "(configs/accelerate/*.yaml): its processes, FSDP sharding and mixed precision",
    )
    add_command(
        sub,
        common,
        "pretrain",
        "build a tiny base model that RL recipes start from",
        "Run the pretraining recipe configs/pretrain/NAME.yaml (`mmrl list` shows them as "
        "pretrain/NAME). NAME is a recipe name, not a path: run a YAML file of your own with "
        "`mmrl train PATH.yaml`.",
        ("name", "pretraining recipe name, e.g. tiny_lm"),
        "key=value overrides",
        resume=True,
    )
    add_command(
        sub,
        common,
        "eval",
        "evaluate models side by side, or a run's newest checkpoint on held-out data",
        "With an evaluator name (`mmrl list` shows them; e.g. `mmrl eval diffusion "
        "models=[A,B] seeds=4`), evaluate models side by side. With a recipe, load the newest good "
        "checkpoint in its output_dir and print its held-out metrics as JSON.",
        ("config", "evaluator name, or recipe name or YAML path of the run"),
        "key=value overrides (e.g. output_dir=...)",
    )
    add_command(
        sub,
        common,
        "bench",
        "run a benchmark (ours vs baseline, side by side)",
        "Run a named benchmark; `mmrl list` shows them. key=value options become the "
        "bench's keyword arguments (e.g. `mmrl bench core repeats=1`); `mmrl bench all` runs every "
        "bench and takes a section per bench (core.repeats=1), only=[...], skip=[...], output=PATH.",
        ("name", "benchmark name, e.g. core, or all"),
        "key=value options passed to the bench",
    )

    add_command(
        sub,
        common,
        "replica",
        "save a tiny replica of a real model",
        "Save a tiny replica of a real model (`mmrl list` shows them under replica): the real model's "
        "classes and layout, loaded by the code that loads its real weights, with every size scaled "
        "down so that its recipes run on a CPU. Options: output_dir (default runs/replicas/NAME), seed, "
        "full=true (the full-size model's configs, tokenizers and scheduler without weights: what "
        "`mmrl train RECIPE --dry-run` needs to plan the real model), weights=true with full=true "
        "(random full-size weights in bfloat16, built on device=cuda in seconds: what `mmrl bench gpu` "
        "trains and times).",
        ("name", "replica name, e.g. sd35m"),
        "key=value options: output_dir=DIR, seed=N, full=true, weights=true, device=cuda",
    )

    report = sub.add_parser(
        "report",
        parents=[common],
        help="turn a run directory into an HTML page, or compare runs in one plot",
        description="Write RUN_DIR/report.html with metric curves and sample grids. With --compare, "
        "plot the held-out metric of several runs against wall-clock and, as logged, denoiser "
        "evaluations (NFE) or environment steps, and write its numbers to the PNG's name with .json. "
        "Runs whose config.yaml differs only in seed, output_dir, checkpoint_every, progress and the "
        "gold reward are seeds of one method: drawn "
        "once, as the mean over seeds with a band (min-max for 2 seeds, mean +- std from 3).",
    )
    report.add_argument("run_dir", nargs="+", help="run directory (several with --compare)")
    report.add_argument("--compare", metavar="PNG", help="write a comparison plot of the runs to PNG")
    report.add_argument(
        "--displacement",
        action="store_true",
        help="print how far each method's runs moved their weights from their start (model.path) and "
        "how much of the move its seeds share; methods are grouped, and take --label and --seed-key, "
        "as with --compare",
    )
    report.add_argument(
        "--metric",
        default="heldout_alignment",
        help="held-out metric to compare (eval.json and eval_<metric> in metrics.jsonl), e.g. "
        "success_rate for robot runs",
    )
    report.add_argument(
        "--training-metric",
        metavar="NAME",
        help="with --compare, plot NAME as every training step logged it in metrics.jsonl instead of a "
        "held-out metric, e.g. autonomous_success_rate for the rollouts of robot runs",
    )
    report.add_argument(
        "--label",
        action="append",
        metavar="NAME",
        help="with --compare, a method's legend label; once per method, in the order its first run is "
        "given (default: the common prefix of its run directory names)",
    )
    report.add_argument(
        "--seed-key",
        action="append",
        metavar="KEY",
        help="with --compare, a config key (dotted) that may also differ between seeds of one method, "
        "e.g. model.path and train.demos when every seed fine-tunes its own base; once per key",
    )
    report.set_defaults(rest="run_dir")

    sub.add_parser(
        "list",
        parents=[common],
        help="list recipes and every registry with its entries",
        description="List recipes and every registry with its entries.",
    )
    return parser


def add_command(
    sub: argparse._SubParsersAction,
    common: argparse.ArgumentParser,
    name: str,
    help: str,
    description: str,
    target: tuple[str, str],
    overrides: str,
    resume: bool = False,
) -> None:
    """A subcommand that takes one target (recipe, evaluator, bench; `target` is its argument name and
    help) and key=value arguments after it, collected in ``overrides``."""
    parser = sub.add_parser(name, parents=[common], help=help, description=description)
    parser.add_argument(target[0], help=target[1])
    parser.add_argument("overrides", nargs="*", help=overrides)
    if resume:
        parser.add_argument("--resume", action="store_true", help="same as resume=true")
    parser.set_defaults(rest="overrides")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, options allowed between the positional ones (`mmrl pretrain vla --plugin m
    key=value`): argparse leaves positionals after an option unparsed, and they join the list."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    rest = getattr(args, "rest", None)
    if extra and (rest is None or any(arg.startswith("-") for arg in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        getattr(args, rest).extend(extra)
    return args
