"""Command-line overrides checked against ``conf/`` before Hydra sees them (it would fail with a traceback), Hydra's
own composition errors in one line, and the order in which a sweep runs its jobs (``interleave_repeats``)."""
from __future__ import annotations

import difflib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from framework.harness.plugin_configs import CONF_DIR, store_plugin_options


#: ``GROUP/NAME`` options of parts from installed packages (+policy=NAME for such a policy).
PLUGIN_OPTIONS = store_plugin_options(CONF_DIR)


#: Whether this process set ``HYDRA_FULL_ERROR`` (``hold_back_hydra_reports``).
_held_back = False


def hold_back_hydra_reports() -> None:
    """Until ``restore_hydra_reports``, Hydra raises a composition error where it would print it over several lines
    and exit (``HYDRA_FULL_ERROR``), so that the command can say it in one (``hydra_error_line``)."""
    global _held_back
    if "HYDRA_FULL_ERROR" not in os.environ:  # one the user set stays theirs
        os.environ["HYDRA_FULL_ERROR"] = "1"
        _held_back = True


def restore_hydra_reports() -> bool:
    """Hydra reports its errors itself again (once a run or sweep starts, or the command ends); whether they were held
    back until now, so that an error just raised came from composing (not from a job, or the user's own setting)."""
    global _held_back
    was, _held_back = _held_back, False
    if was:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    return was


#: The groups conf/config.yaml leaves out (or sets to null): setting one's key without choosing it first is a
#: mistake worth its own hint rather than a list of the root's keys.
_UNSELECTED_GROUPS = {
    "policy": "add +policy=NAME first (FCFS applies when none is given: +policy=fcfs policy.KEY=VALUE)",
    "executor": "add executor=model (the real forward pass, the default) or executor=sim first",
    "cost_model": "cost models time simulated steps: add executor=sim first",
    "hardware": "add +hardware=NAME and executor=sim first",
    "cluster": "add +cluster=NAME and executor=sim first",
}


def hydra_error_line(exc: BaseException) -> str:
    """Hydra's composition error ``exc`` in one line: an unknown key with its node's keys and the nearest of them, a
    missing group option with the group's options, else Hydra's lines and their cause's first; no search path."""
    from omegaconf import DictConfig
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    cause = exc.__cause__
    parent = getattr(cause, "parent_node", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and isinstance(parent, DictConfig) and cause.full_key:
        node, _, key = str(cause.full_key).rpartition(".")
        valid = sorted(str(k) for k in parent.keys())
        if valid:  # a node with none (null, or open) takes Hydra's own advice: +KEY=VALUE
            near = difflib.get_close_matches(key, valid, n=1)
            # A part without a config file (a plugin's, or one registered in code) holds its name alone.
            plus = f"; options of a part without a config file are added: +{node}.{key}=VALUE" \
                if valid == ["name"] and node else ""
            if not node and key in _UNSELECTED_GROUPS:  # an option of a group the defaults leave out
                return f"config: no {key} is selected, so {key}.* cannot be set: {_UNSELECTED_GROUPS[key]}"
            return (f"{node or 'config'}: unknown key {key}{f' (did you mean {near[0]}?)' if near else ''}; "
                    f"valid: {', '.join(valid)}{plus}")
    parts: list[str] = []
    for line in str(exc).splitlines():
        if line.startswith("Config search path"):
            break
        if not line.strip():
            continue
        if line[0].isspace() and parts:  # an item of the list the line before opened
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line.strip()
        else:
            parts.append(line.strip().rstrip("."))
    if isinstance(cause, OmegaConfBaseException) and str(cause).strip():
        parts.append(str(cause).strip().splitlines()[0])  # what Hydra prints under its own message
    line = "; ".join(parts).removeprefix("In 'config': ")
    if "Could not find 'hydra/launcher/ray'" in line:  # --help lists it; its plugin comes with the cluster extra
        line += "; the ray launcher comes with the cluster extra: pip install '.[cluster]'"
    if "Could not find 'model/" in line:  # model= picks a config file; presets and checkpoints go in model.name
        line += ("; a preset (tiny-mistral, small-llama, llama-3-8b, ...) or a checkpoint directory goes in "
                 "model.name=NAME")
    return line


def legacy_overrides(argv: list[str]) -> list[str]:
    """``argv`` with ``+executor=NAME``, the form older command lines use, as ``executor=NAME``:
    Hydra would refuse it as a second value for a group that has a default."""
    return [a[1:] if a.startswith("+executor=") else a for a in argv]


def swept_group_options(argv: list[str]) -> list[str]:
    """``argv`` with ``GROUP.KEY=VALUE`` as ``++GROUP.KEY=VALUE`` where the command adds conf/ group GROUP by a sweep
    (``+cluster=round_robin,least_outstanding cluster.num_replicas=4``): Hydra's sweep applies a plain override to its
    own config, which no job's group is in yet, and refuses it as no key of the config. A key the group's option does
    not take is still refused, by the job's own checks."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, conf = OverridesParser.create(), Path(CONF_DIR)

    def parsed(arg: str) -> Any:
        try:
            return parser.parse_override(arg)
        except Exception:  # unparsable: Hydra's to report
            return None

    overrides = [parsed(arg) for arg in argv]
    swept = {o.key_or_group for o in overrides if o is not None and o.is_add() and o.is_sweep_override()
             and (conf / o.key_or_group).is_dir()}
    return [f"++{arg}" if o is not None and not o.is_add() and not o.is_force_add() and not o.is_delete()
            and not o.is_sweep_override() and o.key_or_group.partition(".")[0] in swept and "." in o.key_or_group
            else arg for arg, o in zip(argv, overrides)]


def null_group_overrides(argv: list[str]) -> tuple[list[str], str | None]:
    """``(argv, error)``: ``GROUP=null``, a traceback in Hydra, is dropped with the group's earlier
    overrides where the group's default is null (``executor``), so that default runs; for another
    conf/ group, ``error`` names the group's options (else None)."""
    conf = Path(CONF_DIR)
    defaults = (yaml.safe_load((conf / "config.yaml").read_text()) or {}).get("defaults") or []
    null_defaults = {g for d in defaults if isinstance(d, dict) for g, v in d.items() if v is None}
    out: list[str] = []
    for arg in argv:
        group, sep, value = arg.partition("=")
        if not (sep and value == "null"):
            out.append(arg)
        elif group in null_defaults:
            out = [a for a in out if a.partition("=")[0] != group]
        # Hydra's own groups (hydra/launcher=...) have options outside conf/: left to Hydra.
        elif "/" not in group and (conf / group.lstrip("+")).is_dir():
            name = group.lstrip("+")
            return out, f"{arg}: the config group '{name}' needs one of its options: {', '.join(group_options(name))}"
        else:
            out.append(arg)
    return out, None


def non_string_group_overrides(argv: list[str]) -> str | None:
    """The error naming a conf/ group's options for an override whose value is no name (``backend=5``,
    ``logger=true``, ``backend=5,naive``), a traceback in Hydra; else None. Unparsable overrides and
    Hydra's own groups are left to Hydra. Runs after ``null_group_overrides``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    conf = Path(CONF_DIR)
    parser = None
    for arg in argv:
        group = arg.partition("=")[0].lstrip("+~")
        if "/" in group or not group or not (conf / group).is_dir():
            continue
        parser = parser or OverridesParser.create()
        try:
            override = parser.parse_override(arg)
            if override.is_delete():
                continue
            value = override.value()
            values = list(override.sweep_iterator()) if override.is_sweep_override() else (
                value if isinstance(value, list) else [value])
        except Exception:  # unparsable, or a sweep only Hydra expands (glob): Hydra's to report
            continue
        # A plain GROUP=null is gone (null_group_overrides), so a null here is one value of a sweep
        # or a list (executor=null,sim), which a job cannot take as the group's default. A mapping
        # merges into the group's node, as Hydra reports.
        bad = [v for v in values if not isinstance(v, (str, dict))]
        if bad:
            return (f"{arg}: {json.dumps(bad[0])} is not an option of the config group '{group}'; "
                    f"its options: {', '.join(group_options(group))}")
    return None


def group_options(group: str) -> list[str]:
    """The options of conf/ group ``group``: its files' and those installed plugins add."""
    return sorted({p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")}
                  | {o.partition("/")[2] for o in PLUGIN_OPTIONS if o.partition("/")[0] == group})


#: Config keys whose sweep repeats each configuration rather than making new ones: ``repeat`` (the same run
#: again) and ``workload.seed`` (the same configuration on other requests; a simulated run's only way to differ).
#: ``framework.compare`` averages over them; a sweep runs them slowest-varying.
REPEAT_KEYS = ("repeat", "workload.seed")


def repeats_first(overrides: Sequence[Any]) -> list[Any]:
    """Hydra ``Override``s with those of the ``REPEAT_KEYS`` first (in their order, the others in theirs): the basic
    sweeper varies the last key fastest, so every configuration runs once before any runs again, and a machine's
    drift over the sweep hits every configuration alike instead of one configuration's repeats."""
    def rank(override: Any) -> int:
        key = override.key_or_group
        return REPEAT_KEYS.index(key) if key in REPEAT_KEYS else len(REPEAT_KEYS)

    return sorted(overrides, key=rank)


#: The sweeper ``interleave_repeats`` orders: Hydra's default, whichever launcher runs the jobs.
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def interleave_repeats() -> None:
    """Make Hydra's basic sweeper order its jobs by ``repeats_first``, the sweep's own ``hydra.sweeper.params`` (a
    named experiment's) included. Idempotent."""
    from hydra.core.plugins import Plugins

    # The class Hydra instantiates is the one its plugin scan made (the scan executes the module again, replacing
    # the class an import gives): patched before the scan, the patch would be lost.
    sweeper = Plugins.instance().class_name_to_class.get(BASIC_SWEEPER)
    if sweeper is None:  # another Hydra that names it otherwise: its own order
        return
    split = sweeper.split_arguments
    if getattr(split, "repeats_first", False):
        return

    def split_arguments(overrides: list[Any], max_batch_size: int | None) -> list[list[list[str]]]:
        return split(repeats_first(overrides), max_batch_size)

    split_arguments.repeats_first = True  # type: ignore[attr-defined]
    sweeper.split_arguments = staticmethod(split_arguments)


def sweep_jobs(config: Any) -> list[tuple[list[str], Any]] | None:
    """Each job of a basic sweep's ``config``: its overrides and its composed config (None for another sweeper's
    sweep, which composes its own). ValueError, one line (``hydra_error_line``), for the first that does not compose:
    Hydra's own check, made before the sweep's folder is (Hydra's comes after it, over several lines)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.plugins import Plugins
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    sweeper = Plugins.instance().class_name_to_class.get(BASIC_SWEEPER)
    if sweeper is None or OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None
    loader = GlobalHydra.instance().config_loader()
    params = [f"{key}={value}" for key, value in (OmegaConf.select(config, "hydra.sweeper.params") or {}).items()]
    try:
        overrides = OverridesParser.create(config_loader=loader).parse_overrides(
            params + OmegaConf.to_container(config.hydra.overrides.task, resolve=False))  # as Hydra's sweeper reads them
        jobs = [(list(job), loader.load_sweep_config(config, list(job)))
                for batch in sweeper.split_arguments(overrides, None) for job in batch]
    except (HydraException, OmegaConfBaseException) as exc:
        raise ValueError(hydra_error_line(exc)) from None
    _composed.clear()  # another sweep's (a test's, or a script's, in this process) are not this one's
    _composed.update(tuple(job) for job, _ in jobs)
    return jobs


#: The jobs ``sweep_jobs`` composed in this process, which Hydra's basic sweeper does not compose again to check them.
_composed: set[tuple[str, ...]] = set()


def skip_composed_jobs_check() -> None:
    """Make Hydra's basic sweeper check (by composing) only the jobs ``sweep_jobs`` did not compose. Idempotent."""
    from hydra.core.plugins import Plugins

    sweeper = Plugins.instance().class_name_to_class.get(BASIC_SWEEPER)
    if sweeper is None or getattr(sweeper.validate_batch_is_legal, "skips_composed", False):
        return
    validate = sweeper.validate_batch_is_legal

    def validate_batch_is_legal(self: Any, batch: Sequence[Sequence[str]]) -> None:
        unchecked = [job for job in batch if tuple(job) not in _composed]
        if unchecked:
            validate(self, unchecked)

    validate_batch_is_legal.skips_composed = True  # type: ignore[attr-defined]
    sweeper.validate_batch_is_legal = validate_batch_is_legal


def hidden_composition_error(argv: Sequence[str]) -> str | None:
    """Hydra asks a config's ``hydra.mode`` (a named experiment's MULTIRUN) by composing it, and where that fails runs
    it as a single run, which refuses a swept value as ambiguous: the error that hid, found by composing ``argv``'s
    overrides without their swept values (``hydra_error_line``), or None where they compose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            compose(config_name="config", overrides=[o.input_line for o in overrides if not o.is_sweep_override()])
    except (HydraException, OmegaConfBaseException) as exc:
        return hydra_error_line(exc)
    return None
