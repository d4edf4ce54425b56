"""``python -m framework.run --help``: each config group with what it picks and its options, the simulator's
model presets, the sweep launchers, then Hydra's flags. Stored as Hydra's ``hydra/help=servelab`` option."""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from framework.harness.overrides import group_options

#: Config group -> (how it is given, what it picks), in the order --help lists them.
GROUPS = {
    "policy": ("+policy=NAME", "scheduling policy (FCFS when none is given); a registered policy needs no file"),
    "backend": ("backend=NAME", "attention backend"),
    "allocator": ("allocator=NAME", "KV-block allocator"),
    "preparer": ("preparer=NAME", "input preparation: v1 (flat persistent batch) or v0 (per sequence group)"),
    "executor": ("executor=NAME", "what runs a step: the model (the default) or sim (a cost model, simulated time)"),
    "model": ("model=NAME", "model settings; model.name=PRESET or a Hugging Face checkpoint directory"),
    "workload": ("workload=NAME", "the requests sent and when they arrive"),
    "logger": ("logger=NAME", "where the metrics go besides the run's folder (wandb: Weights & Biases)"),
    "hardware": ("+hardware=NAME", "the simulated device (executor=sim)"),
    "cluster": ("+cluster=NAME", "simulated replicas behind a router (executor=sim)"),
    "experiment": ("+experiment=NAME", "a named experiment, most of them a sweep of their own"),
}

#: Sweep launchers (``-m hydra/launcher=NAME``) and what they do.
LAUNCHERS = {"basic": "the default: one job after another", "parallel": "jobs in local processes (joblib)",
             "slurm": "SLURM jobs (Submitit); submitit_local: the same as local processes",
             "ray": "tasks on a Ray cluster (pip install '.[cluster]')"}

HELP_OPTION = "hydra/help=servelab"


def model_presets() -> tuple[list[str], list[str]]:
    """(presets with random weights, which run for real; shapes of released models, for executor=sim only)."""
    from models.presets import PRESETS, SHAPE_ONLY_PRESETS

    return sorted(set(PRESETS) - set(SHAPE_ONLY_PRESETS)), sorted(SHAPE_ONLY_PRESETS)


def help_text() -> str:
    """The --help page (a ``string.Template``: ``$FLAGS_HELP`` becomes Hydra's flags)."""
    lines = ["servelab-run (python -m framework.run): serve a workload with the chosen parts and measure it.",
             "Usage: python -m framework.run [-m] [GROUP=OPTION | +GROUP=OPTION | key=value ...]", "",
             "== Config groups =="]
    for group, (given, what) in GROUPS.items():
        lines += [f"{given:<18} {what}", f"{'':<18} options: {', '.join(group_options(group))}"]
    random_weights, shapes = model_presets()
    lines += ["", "== Model presets (model.name=NAME) ==", f"random weights: {', '.join(random_weights)}",
              f"released models' shapes, for executor=sim only: {', '.join(shapes)}", "",
              "== Sweep launchers (-m hydra/launcher=NAME) ==", *(f"{k:<18} {v}" for k, v in LAUNCHERS.items()), "",
              "Files: outputs/DATE/TIME (multirun/DATE/TIME/N for a sweep); see experiments/README.md.",
              "--cfg job prints the composed config.", "", "== Flags ==", "$FLAGS_HELP"]
    return "\n".join(lines)


def help_overrides(argv: list[str]) -> list[str]:
    """``[HELP_OPTION]`` (its config stored) when ``argv`` asks for --help, else ``[]``: the overrides that make
    Hydra print this page."""
    if not any(a in ("--help", "-h") for a in argv):
        return []
    node = {"app_name": "servelab-run", "header": "", "footer": "", "template": help_text()}
    ConfigStore.instance().store(group="hydra/help", name="servelab", node=node)
    return [HELP_OPTION]
