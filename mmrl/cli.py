"""`mmrl` command line: train, pretrain, eval, bench, report, list.

User mistakes (bad config, missing file, unknown name) print one ``error: ...`` line and exit 2;
a traceback means a bug in mmrl.

User code plugs in as a module that registers entries when imported (`REWARDS.register(name)`,
`ADVANTAGES.register(name)`, `sim.register_task(...)`): `--plugin MODULE` on any subcommand, or
``plugins: [MODULE, ...]`` in a config file, imports it after mmrl's own modules and before the config
is checked. MODULE is a module name (the working directory is searched after the installed packages)
or a path to a .py file. Packages can instead declare the ``mmrl.plugins`` entry point.

The commands' arguments are `mmrl.cli_parser`.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path

from mmrl.bench_all import bench_kwargs
from mmrl.cli_parser import parse_args
from mmrl.config import (
    BaseConfig,
    ConfigError,
    apply_overrides,
    list_recipes,
    load_config,
    read_yaml,
    resolve_config_path,
)
from mmrl.memory_plan import LaunchConfig
from mmrl.registry import ALL_REGISTRIES, BENCHES, EVALUATORS, REPLICAS, TRAINERS, UnknownNameError
from mmrl.run_stops import TrainingInterrupted, TrainingStopped
from mmrl.runlog import strict_json
from mmrl.trainer import finite_or_named

BUILTIN_MODULES = (
    "mmrl.advantages",
    "mmrl.samplers",
    "mmrl.losses",
    "mmrl.rewards",
    "mmrl.precision",
    "mmrl.bench_core",
    "mmrl.bench_all",
    "mmrl.bench_gpu",
    "mmrl.bench_realsize",
)


def load_plugins() -> None:
    """Fill the registries: mmrl's own modules, then the packages that declare the ``mmrl.plugins``
    entry point (the demo trainers in mmrl.examples, diffusion_rl, vlm_rl, vla_rl), so the core imports
    none of them. Their register modules only name the modules that register entries
    (`mmrl.registry.provide`); an entry's module is imported when it is first used, and one whose
    dependencies are missing or of other versions
    says so then, while the others still work: e.g. `mmrl eval vla` in a LeRobot venv, whose
    transformers is too old for vlm_rl. A register module that fails to import is skipped with a
    warning."""
    for name in BUILTIN_MODULES:
        importlib.import_module(name)
    for entry in entry_points(group="mmrl.plugins"):
        try:
            entry.load()
        except ImportError as err:
            print(
                f"warning: mmrl plugin {entry.name} not loaded, its commands are missing: {err}",
                file=sys.stderr,
            )


def load_user_plugins(specs: Iterable[str], origin: str) -> None:
    """Import the user's modules named by `origin` (--plugin, or a config's plugins key), each once."""
    for spec in specs:
        try:
            import_plugin(spec)
        except ConfigError:
            raise
        except (SystemExit, KeyboardInterrupt) as err:  # would end mmrl having done nothing
            what = (
                f"called sys.exit({err.code!r})"
                if isinstance(err, SystemExit)
                else "was interrupted (KeyboardInterrupt)"
            )
            raise ConfigError(
                f"plugin {spec!r} ({origin}) {what} while it was imported: a plugin module only registers "
                'entries; put code that runs it under `if __name__ == "__main__":`'
            ) from None
        except Exception as err:  # the user's code may raise anything: one line, naming the plugin
            reason = " ".join(f"{type(err).__name__}: {err}".split())
            hint = ""
            if isinstance(err, ModuleNotFoundError) and err.name == spec:
                hint = "; give an importable module name (run mmrl in its directory) or a path to a .py file"
            raise ConfigError(f"plugin {spec!r} ({origin}) failed to import: {reason}{hint}") from None


def import_plugin(spec: str) -> None:
    """Import a module by name (the working directory searched after the installed packages) or, for
    a spec ending in .py or holding a path separator, from that file under its stem's name."""
    if not spec.strip():
        raise ConfigError("plugin '' is empty: give a module name or a path to a .py file")
    if not (spec.endswith(".py") or "/" in spec or os.sep in spec):
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        importlib.import_module(spec)
        return
    path = Path(spec).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"plugin {spec!r}: no such file; give a path to a .py file or a module name")
    loaded = sys.modules.get(path.stem)
    if loaded is not None:
        if getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
            return
        raise ConfigError(
            f"plugin {spec!r}: a module named {path.stem!r} is already imported "
            f"({getattr(loaded, '__file__', None) or 'built in'}); rename the file"
        )
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"plugin {spec!r}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module  # before running it, as an import does (dataclasses look it up)
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[path.stem]
        raise


def load_checked_config(name_or_path: str, overrides: list[str]) -> BaseConfig:
    """`load_config`, after importing the modules of the config's ``plugins`` key: the rest of the
    config may name their tasks, rewards and advantages, which validation looks up."""
    data = apply_overrides(read_yaml(resolve_config_path(name_or_path)), list(overrides))
    plugins = data.get("plugins") or []
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(
            f"config error: plugins = {plugins!r} must be a list of module names or .py paths, "
            "e.g. plugins: [my_tasks]"
        )
    load_user_plugins(plugins, f"plugins in {name_or_path}")
    return load_config(name_or_path, overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        load_plugins()
        load_user_plugins(args.plugin, "--plugin")
        return COMMANDS[args.command](args)
    except (ConfigError, UnknownNameError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        see = " (see stopped.json in the run directory)" if err.recorded else ""
        print(f"error: run stopped: {err}{see}", file=sys.stderr)
        return 1
    except TrainingInterrupted as err:
        see = " (see stopped.json in the run directory)" if err.recorded else ""
        print(f"error: run stopped: {err}{see}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def cmd_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + (["resume=true"] if args.resume else [])
    config = load_checked_config(args.config, overrides)
    processes, launch_file = getattr(args, "processes", None), getattr(args, "launch", None)
    if processes is not None and processes < 1:
        raise ConfigError(f"--processes {processes}: give a number of processes of at least 1")
    if getattr(args, "dry_run", False):
        launch = None
        if launch_file is not None:
            try:
                launch = LaunchConfig.from_file(launch_file)
            except ValueError as err:
                raise ConfigError(f"--launch: {err}") from None
            if processes is not None and processes != launch.processes:
                raise ConfigError(
                    f"--processes {processes} but {launch_file} launches {launch.processes}: give one of them"
                )
            processes = launch.processes
        if processes is None:
            processes = int(os.environ.get("WORLD_SIZE", "1"))
        plan = TRAINERS.get(config.trainer).memory_plan(config, args.config, processes)
        if launch is not None:
            try:
                plan = plan.sharded(launch)
            except ValueError as err:
                raise ConfigError(f"--launch {launch_file}: {err}") from None
        print(plan.format())
        return 0
    if processes is not None or launch_file is not None:
        raise ConfigError("--processes and --launch plan a run: use them with --dry-run")
    trainer = TRAINERS.get(config.trainer)(config)
    accelerator, is_main = trainer.accelerator, trainer.is_main
    try:
        result = trainer.train()
    except BaseException as err:  # what a trainer does after the shared loop (saving its model) too
        stopped = trainer.stopped_by(err)
        if stopped is err:
            raise
        raise stopped from err
    finally:
        trainer.release_run_dir()
        # Tear the process group down before the interpreter exits: gloo threads still running at exit
        # can abort a rank ("terminate called without an active exception") after a good run. The DDP
        # wrapper's reducer holds the group, so free the trainer first: otherwise the group outlives
        # end_training, dies when the trainer is collected after the other rank may have exited, and
        # its destructor waits forever for gloo threads (seen as a hang under CPU load).
        del trainer
        accelerator.free_memory()
        gc.collect()
        accelerator.end_training()
    if is_main:
        print(json.dumps(strict_json(result), allow_nan=False))
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    """Only recipe names: `pretrain/{name}` would otherwise also reach files outside configs/pretrain
    (``../x``) that `mmrl train` is the command for."""
    names = [recipe.removeprefix("pretrain/") for recipe in list_recipes() if recipe.startswith("pretrain/")]
    if args.name not in names:
        raise ConfigError(
            f"mmrl pretrain {args.name!r}: not a pretraining recipe; choose one of {', '.join(names)} "
            "(configs/pretrain/NAME.yaml), or run a YAML file of your own with `mmrl train PATH.yaml`"
        )
    args.config = f"pretrain/{args.name}"
    return cmd_train(args)


def cmd_eval(args: argparse.Namespace) -> int:
    if args.config in EVALUATORS:
        EVALUATORS.get(args.config)(list(args.overrides))
        return 0
    config = load_checked_config(args.config, list(args.overrides))
    saved = Path(config.output_dir) / "config.yaml"
    if saved.is_file():  # a run directory: its own config, the command line's overrides on top
        try:
            run = load_checked_config(str(saved), list(args.overrides))
        except ConfigError as err:
            raise ConfigError(f"{saved} (the run's config): {err}") from None
        if run.trainer != config.trainer:
            raise ConfigError(
                f"{args.config!r} names trainer {config.trainer!r}, but the run in {config.output_dir!r} was "
                f"trained by {run.trainer!r} (its config.yaml): evaluate it with `mmrl eval {saved}`"
            )
        run.output_dir = config.output_dir
        config = run
    metrics = TRAINERS.get(config.trainer)(config).evaluate_checkpoint()
    finite_or_named(metrics, f"the evaluation of {config.output_dir}", "the JSON printed")
    print(json.dumps(strict_json(metrics), allow_nan=False))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    bench = BENCHES.get(args.name)
    bench(**bench_kwargs(bench, apply_overrides({}, list(args.overrides))))
    return 0


def cmd_replica(args: argparse.Namespace) -> int:
    """Save a replica once its options are checked (a device this machine has, a seed torch takes, an
    output directory that can be made and is empty); the saver checks that what it builds fits."""
    from mmrl.config import check_device, check_output_dir

    save = REPLICAS.get(args.name)
    options = apply_overrides({}, list(args.overrides))
    unknown = sorted(set(options) - {"output_dir", "seed", "full", "weights", "device"})
    if unknown:
        raise ConfigError(
            f"mmrl replica: unknown option {unknown[0]!r}: the options are output_dir, seed, full, weights "
            "and device"
        )
    seed, full = options.get("seed", 0), options.get("full", False)
    weights, device = options.get("weights", not full), str(options.get("device", "cpu"))
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise ConfigError(
            f"mmrl replica: seed = {seed!r} must be an integer from 0 to {2**64 - 1} (what torch.manual_seed "
            "takes)"
        )
    for key, value in (("full", full), ("weights", weights)):
        if not isinstance(value, bool):
            raise ConfigError(f"mmrl replica: {key} = {value!r} must be true or false")
    device = check_device(device, "device")
    output_dir = check_output_dir(str(options.get("output_dir", f"runs/replicas/{args.name}")), "output_dir")
    if output_dir.exists() and any(output_dir.iterdir()):
        raise ConfigError(
            f"mmrl replica: output_dir {str(output_dir)!r} is not empty: give another output_dir="
        )
    print(save(output_dir, seed=seed, full=full, weights=weights, device=device))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from mmrl.compare import compare_runs
    from mmrl.report import write_report

    if args.displacement:
        from mmrl.displacement import displacement_summary, print_displacement

        print_displacement(displacement_summary(args.run_dir, args.label, args.seed_key))
        if not args.compare:
            return 0
    if args.compare:
        training = args.training_metric is not None
        metric = args.training_metric if training else args.metric
        png = compare_runs(args.run_dir, metric, args.compare, args.label, args.seed_key, training=training)
        print(png)
        print(png.with_suffix(".json"))
        return 0
    if args.label or args.seed_key or args.training_metric:
        raise ConfigError(
            "--label, --seed-key and --training-metric are for a comparison: pass --compare PNG with them"
        )
    if len(args.run_dir) > 1:
        raise ConfigError("mmrl report takes one run directory; pass --compare PNG to compare several")
    print(write_report(args.run_dir[0]))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    del args
    print("recipes (mmrl train NAME):")
    for recipe in list_recipes():
        print(f"  {recipe}")
    for kind, registry in sorted(ALL_REGISTRIES.items()):
        print(f"{kind} ({registry.doc}):")
        for name in registry.names():
            kind, source = registry.kind_of(name), registry.tag(name, "source")
            about = [kind.describe()] if kind is not None else []
            print(
                f"  {name}"
                + (f"  ({'; '.join(about + ([source] if source else []))})" if about or source else "")
            )
    return 0


COMMANDS = {
    "train": cmd_train,
    "pretrain": cmd_pretrain,
    "eval": cmd_eval,
    "bench": cmd_bench,
    "replica": cmd_replica,
    "report": cmd_report,
    "list": cmd_list,
}

if __name__ == "__main__":
    sys.exit(main())
