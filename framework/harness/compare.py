"""``python -m framework.compare DIR... [--out OUT] [--x KEY] [--label KEY,...]``: compare runs.

Reads every run under the given directories (a run is a folder holding ``summary.json``; a
single run, a multirun tree or a folder of several) and writes to ``OUT`` (default: the only
DIR given, else ``./comparison``):

- ``comparison.csv``: one row per configuration and ``--x`` value, with ``n_repeats`` and, for each
  metric, the mean over the repeats and its 95% interval (``<metric>_ci95_low``/``_high``, ``stats.py``);
- ``comparison.md``: the same table (mean +- half the interval), which differences between
  configurations are significant, the machine's timing noise, and each run;
- ``runs.csv``: one row per run;
- figures, each as PNG and PDF: ``throughput_vs_<x>``, ``latency_vs_<x>`` (p50 and p99) and
  ``latency_cdfs`` (TTFT, TPOT and E2EL of every configuration overlaid), one colour per configuration.

A configuration is labelled by the config keys whose values differ between the runs (other than
``--x`` and the ``REPEAT_KEYS``), e.g. ``policy=chunked``; by the file where only a group's file
differs (``workload=chat``); a run that left a group out counts as the part it ran, with its
defaults (``policy=fcfs``). ``--label`` picks the keys instead. Runs with the same label and ``x``
are repeats of one configuration. A multirun writes its own comparison (``CompareCallback``).

A run whose summary holds no metrics (killed, SIGKILL or out of memory, before writing them) gets those its
``requests.csv`` and ``steps.csv`` give (no ITL statistics or prefix-cache hit rate: only a run keeps what they
need); one whose summary still says ``running`` (killed, or still under way) shows the status ``running (killed?)``.
"""
from __future__ import annotations

import argparse
import csv
import inspect
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from framework.common.config import PART_NAMES, EngineConfig
from framework.harness.overrides import REPEAT_KEYS, restore_hydra_reports, sweep_jobs
from framework.harness.recorder import claim_run_dir, make_run_dir
from framework.harness.stats import mean_ci95, overlap

log = logging.getLogger(__name__)

#: The metrics of a run that a comparison shows (and averages over a configuration's repeats).
METRICS = ["completed", "failed", "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
           "request_goodput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
           "p99_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "mean_queueing_delay_ms",
           "prefix_cache_hit_rate", "num_preemptions", "num_swaps", "total_prefill_tokens", "blocks_swapped_out",
           "step_time_noise_cv"]
#: A run's row: its configuration, which repeat it is (``repeat``, ``workload.seed``), its status and metrics.
COLUMNS = ["label", "x", "repeat", "seed", "status", *METRICS]
#: Config keys that never tell configurations apart.
IGNORED_PREFIXES = ("hydra.", "logger.", "progress", "plots", "save_workload", "clock")
#: What the figures and the significance table show of each configuration.
THROUGHPUT = [("output_throughput", "output throughput (tokens/s)"), ("request_throughput", "request throughput (req/s)")]
GOODPUT = ("request_goodput", "goodput (req/s meeting every SLO)")
LATENCY = [(f"{stat}_{name}_ms", f"{word} {what}") for stat, word in (("median", "p50"), ("p99", "p99"))
           for name, what in (("ttft", "time to first token (ms)"), ("tpot", "time per output token (ms)"),
                              ("e2el", "end-to-end latency (ms)"))]


def find_runs(dirs: Sequence[str | Path]) -> list[Path]:
    runs: list[Path] = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise ValueError(f"{d} is not a directory")
        runs += sorted((p.parent for p in d.rglob("summary.json")), key=_natural)
    if not runs:
        raise ValueError(f"no runs (folders holding summary.json) under {', '.join(map(str, dirs))}")
    return list(dict.fromkeys(runs))


def _natural(p: Path) -> list[tuple[int, Any]]:
    """Sort key: numbered folders (Hydra's jobs) by number, before named ones at the same level
    (a number and a name are never compared with each other)."""
    return [(0, int(part)) if part.isdecimal() else (1, part) for part in p.parts]


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 8.0}}`` -> ``{"a.b": 8}``: a whole float as its int, so that ``rate=8`` on one command line and
    ``8.0`` in a YAML file are one value; lists as JSON text."""
    if not isinstance(d, dict):
        return {prefix.rstrip("."): _whole(d)}
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(_whole(v)) if isinstance(v, list) else _whole(v)
    return out


def _whole(v: Any) -> Any:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [_whole(e) for e in v]
    if isinstance(v, dict):
        return {k: _whole(e) for k, e in v.items()}
    return v


def config_keys(run_dir: Path) -> dict[str, Any]:
    """The run's config, flattened, as its files say it (nothing filled in from its summary)."""
    # A run that failed on its configuration wrote no config.yaml; Hydra's copy says what it was.
    paths = [p for p in (run_dir / "config.yaml", run_dir / ".hydra" / "config.yaml") if p.is_file()]
    return flatten(_read_mapping(paths[0], yaml.safe_load, "YAML") or {} if paths else {})


def _read_mapping(path: Path, parse: Any, syntax: str) -> Any:
    """``path`` parsed by ``parse``: a mapping, or None (an empty YAML file). A syntax error or
    another value is a ValueError naming the file."""
    try:
        value = parse(path.read_text())
    except (ValueError, yaml.YAMLError) as exc:  # json's JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not a run's file (not valid {syntax}: {str(exc).splitlines()[0]})") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{path}: not a run's file (a {type(value).__name__} where a mapping belongs)")
    return value


def load_run(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(summary, flat config)`` of one run; the parts' names come from the summary, since a
    config without ``+policy`` has no policy node. An unfinished run's metrics come from its CSVs."""
    summary = _read_mapping(run_dir / "summary.json", json.loads, "JSON") or {}
    flat = config_keys(run_dir)
    summary = _with_csv_metrics(run_dir, summary, flat)
    written = set(flat)
    for part in PART_NAMES:
        if summary.get(part) is not None:
            flat[f"{part}.name"] = summary[part]
        elif f"{part}.name" not in flat:  # a run that failed before saying: the group was left out
            flat[f"{part}.name"] = getattr(EngineConfig, part)
    # A simulated run without +hardware ran on the executor's default device, which only the
    # summary names.
    if summary.get("hardware") is not None and "hardware.name" not in flat:
        flat["hardware.name"] = summary["hardware"]
    choices = _choices(run_dir)
    for group, choice in choices.items():
        flat[f"{group}{PRESET}"] = choice
    # A group left out (no +policy; executor's null default) ran the part the summary names, with
    # its defaults: labelled by that part and those options, as a run that chose them
    # (+policy=fcfs) is, not as policy=None beside policy=fcfs.
    for part in PART_NAMES:
        if summary.get(part) is not None and not any(k.startswith(f"{part}.") for k in written):
            if choices:
                flat.setdefault(f"{part}{PRESET}", summary[part])
            for key, value in _default_options(part, summary[part]).items():
                flat.setdefault(f"{part}.{key}", _whole(value))
    return summary, flat


#: The status shown for a run whose summary still says ``running``: killed (SIGKILL, out of memory), or under way.
UNFINISHED = "running (killed?)"


def _with_csv_metrics(run_dir: Path, summary: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with the metrics of its run's CSVs where it holds none (``flat``: the run's config, for its SLOs),
    and the status ``UNFINISHED`` where it still says ``running``; the files are only read."""
    if summary.get("status") == "running":
        summary = {**summary, "status": UNFINISHED}
    if "completed" in summary or not (run_dir / "requests.csv").is_file():
        return summary
    try:
        return {**summary, **csv_metrics(run_dir, {k: flat.get(f"slo.{k}") for k in ("ttft_ms", "tpot_ms", "e2el_ms")},
                                         simulated="hardware" in summary)}
    except (OSError, ValueError, csv.Error) as exc:  # unreadable, or not a run's CSV: the run shows without them
        log.warning("%s: no metrics from its CSVs: %s", run_dir, exc)
        return summary


def csv_metrics(run_dir: Path, slo: dict[str, Any] | None = None, simulated: bool = False) -> dict[str, Any]:
    """``metrics.summarize`` of the rows in the run's ``requests.csv`` and ``steps.csv`` (a row a kill cut short
    left out) over the time they span, goodput by ``slo`` (``SLO``'s keys); ITLs and hit rate unknown (None); and the
    steps' timing noise (``experiment.timing_noise``; none where ``simulated``: its step times are its cost model's)."""
    from framework.harness.experiment import timing_noise  # numpy and the engine: only when needed
    from framework.harness.metrics import SLO, summarize

    records = _csv_records(run_dir / "requests.csv")
    steps, steps_end, preempted = _csv_steps(run_dir / "steps.csv")
    end = max([steps_end, *(r.arrival_time + r.e2el for r in records if r.e2el is not None)])
    # The steps count the preemptions of requests the kill cut off, which have no row; either file may lag the
    # other by a flush, so the larger count is the nearer.
    preemptions = max(preempted, sum(r.num_preemptions for r in records)), sum(r.num_swaps for r in records)
    return {**summarize(records, end, SLO(**(slo or {})), steps, preemptions=preemptions),
            **timing_noise(run_dir / "steps.csv", simulated)}


def _complete_rows(path: Path) -> Iterator[dict[str, str]]:
    """The rows of CSV file ``path`` that have every column (the last one a kill cut short has not)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            if None not in row.values() and None not in row:
                yield row


def _csv_records(path: Path) -> list[Any]:
    """``RequestRecord``s of ``requests.csv``'s rows (latencies back in seconds; no token times)."""
    from framework.harness.metrics import RequestRecord

    def seconds(ms: str) -> float | None:
        return float(ms) / 1000 if ms else None

    return [RequestRecord(r["request_id"], r["status"], int(r["priority"]), float(r["arrival_s"]), int(r["prompt_len"]),
                          int(r["output_len"]), int(r["cached_tokens"]), seconds(r["queueing_delay_ms"]),
                          seconds(r["ttft_ms"]), seconds(r["tpot_ms"]), seconds(r["e2el_ms"]), [],
                          int(r["num_preemptions"]), int(r["num_swaps"]), r["message"])
            for r in _complete_rows(path)]


def _csv_steps(path: Path) -> tuple[Any, float, int]:
    """The ``StepTotals`` of ``steps.csv``'s rows (none without the file), when the last step ended, and how many
    preemptions they made."""
    from framework.harness.metrics import StepTotals

    totals, end, kv_usage, preempted = StepTotals(), 0.0, [], 0
    sums = dict.fromkeys(("num_scheduled_tokens", "num_prefill_tokens", "num_swapped_out_blocks",
                          "num_swapped_in_blocks"), 0)
    for row in _complete_rows(path) if path.is_file() else ():
        kv_usage.append(float(row["kv_usage"]))
        end = max(end, float(row["time_s"]) + float(row["duration"]))
        for key in sums:
            sums[key] += int(row[key])
        preempted += int(row["num_preempted"])
    totals.add(len(kv_usage), kv_usage, *sums.values())
    return totals, end, preempted


def _default_options(part: str, name: str) -> dict[str, Any]:
    """The options a ``part`` named ``name`` runs with when its group is left out: its
    constructor's defaults. Only a policy has any (the executor's default, ``model``, takes none);
    an unknown or broken plugin gives none."""
    if part != "policy":
        return {}
    from framework.scheduling.policy import POLICIES  # light, and only where a run left its policy out

    try:
        cls = POLICIES.get(name)
    except (ValueError, ImportError):
        return {}
    return {p.name: p.default for p in inspect.signature(cls).parameters.values() if p.default is not p.empty}


#: Key suffix of the config file a Hydra run chose for a group (``workload.preset`` = ``chat``).
PRESET = ".preset"


def _choices(run_dir: Path) -> dict[str, str]:
    """The files Hydra chose for the run's top-level groups (``.hydra/hydra.yaml``; none for a
    run made through the Python API), leaving out Hydra's own and unset ones."""
    path = run_dir / ".hydra" / "hydra.yaml"
    if not path.is_file():
        return {}
    choices = ((yaml.safe_load(path.read_text()) or {}).get("hydra") or {}).get("runtime", {}).get("choices") or {}
    return {g: str(c) for g, c in choices.items() if c is not None and "/" not in g and g != "hydra"}


def short_names(keys: Sequence[str]) -> dict[str, str]:
    """``policy.name`` -> ``policy``, ``engine.enable_prefix_caching`` -> ``enable_prefix_caching``;
    the full key where two short names would clash."""
    short = {k: (k.split(".")[-2] if k.endswith((".name", PRESET)) else k.split(".")[-1]) for k in keys}
    return {k: s if list(short.values()).count(s) == 1 else k for k, s in short.items()}


def varying_keys(flats: Sequence[dict[str, Any]]) -> list[str]:
    """Config keys whose values differ between runs, bookkeeping keys left out."""
    keys = sorted({k for f in flats for k in f})
    return [k for k in keys if not k.startswith(IGNORED_PREFIXES)
            and len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flats}) > 1]


def label_keys(flats: Sequence[dict[str, Any]], x: str) -> list[str]:
    """Config keys whose values differ between runs, other than ``x``, bookkeeping keys and the ``REPEAT_KEYS``
    (runs that differ only in those are repeats of one configuration)."""
    varying = [k for k in varying_keys(flats) if k != x and k not in REPEAT_KEYS]
    # A part's options follow its name; the name alone tells the parts apart. Where the name is
    # the same but the group's config file differs (workload=chat against workload=poisson, both
    # synthetic), the file's name stands for the options it set.
    names = {k[: -len(".name")] for k in varying if k.endswith(".name")}
    presets = {k[: -len(PRESET)] for k in varying if k.endswith(PRESET)} - names

    def labels(k: str) -> bool:
        if k.endswith(".name"):
            return True
        if k.endswith(PRESET):
            return k[: -len(PRESET)] in presets
        return k.split(".")[0] not in names | presets

    chosen = [k for k in varying if labels(k)]
    # An option swept beside its part's name (workload=poisson,chat x workload.num_requests=20,40)
    # is not implied by the name: it comes back where runs with the same label would differ in it.
    for k in varying:
        if k not in chosen:
            seen: dict[str, set[str]] = {}
            for f in flats:
                same_label = json.dumps([f.get(c) for c in (*chosen, x)], sort_keys=True, default=str)
                seen.setdefault(same_label, set()).add(json.dumps(f.get(k), sort_keys=True, default=str))
            if any(len(values) > 1 for values in seen.values()):
                chosen.append(k)
    return [k for k in varying if k in chosen]


def comparison_rows(dirs: Sequence[str | Path], x: str = "workload.rate",
                    label: Sequence[str] | None = None) -> list[dict[str, Any]]:
    runs = find_runs(dirs)
    loaded = [load_run(r) for r in runs]
    flats = [f for _, f in loaded]
    # As --label's keys: a misspelt key would otherwise put every run at x = None, silently.
    if not any(x in f or x.split(".")[-1] in summary for summary, f in loaded):
        raise ValueError(f"--x key {x!r} is not in the runs' configs{_choices_hint(flats)}")
    if label:
        keys = [_resolve_key(k, flats) for k in label]
    else:
        # A failed run, or one stopped before it said what it runs, lacks what only a run records (the
        # parts' names in its summary): the labels come from the runs that ran.
        ran = [f for s, f in loaded if s.get("status") != "failed" and s.get("policy") is not None]
        keys = label_keys(ran if ran else flats, x)
        if ran and len(ran) < len(flats):
            # A key every run's config file has and a failed run's differs in (the value that made
            # it fail, engine.block_size=3) labels every run, or the failed run would look like one
            # that ran; what only summaries record does not count.
            written = [config_keys(r) for r in runs]
            keys = sorted({*keys, *(k for k in label_keys(written, x) if all(k in f for f in written))})
    names = short_names(keys)
    rows = []
    for run_dir, (summary, flat) in zip(runs, loaded):
        if keys:
            text = ", ".join(f"{names[k]}={flat.get(k)}" for k in keys)
        else:
            text = f"{flat.get('policy.name')}/{flat.get('backend.name')}"
        row = {c: summary.get(c) for c in COLUMNS}
        row.update({k: v for k, v in summary.items() if k.startswith("prio")})
        row.update(label=text, x=_whole(flat.get(x, summary.get(x.split(".")[-1]))), repeat=flat.get("repeat"),
                   seed=flat.get("workload.seed"), run_dir=str(run_dir), summary=summary)
        order = [flat.get(k) for k in keys] if keys else [text]
        rows.append((tuple(map(_sort_key, order)), row))
    # By the labels' values, numbers as numbers (max_num_seqs 2, 8, 16; as text 16 came first), then by x.
    rows.sort(key=lambda r: (r[0], r[1]["label"], _sort_key(r[1]["x"])))
    return [row for _, row in rows]


def _sort_key(value: Any) -> tuple[int, Any]:
    """``value`` as a sort key: numbers by value, before anything else by its text; None last."""
    if value is None:
        return 2, ""
    if _number(value):
        return 0, value
    return 1, json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else value


def _resolve_key(key: str, flats: Sequence[dict[str, Any]]) -> str:
    known = {k for f in flats for k in f}
    for candidate in (key, f"{key}.name"):
        if candidate in known:
            return candidate
    matches = sorted(k for k in known if k.split(".")[-1] == key)
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"--label key {key!r} is ambiguous: {', '.join(matches)}")
    raise ValueError(f"--label key {key!r} is not in the runs' configs{_choices_hint(flats)}")


def _choices_hint(flats: Sequence[dict[str, Any]]) -> str:
    """What to pass instead of a key no run has: the config keys whose values differ between the
    runs (the ones worth an axis or a label), else examples."""
    differ = varying_keys(flats)
    if differ:
        return f"; keys that differ between these runs: {', '.join(differ)}"
    return " (full keys of their config.yaml, e.g. workload.rate, engine.max_num_seqs; no key differs between these runs)"


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _extra_metrics(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The per-priority metrics (``prio0_p99_ttft_ms``) some row has."""
    return sorted({k for r in rows for k in r if k.startswith("prio")})


def _run_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    return COLUMNS + _extra_metrics(rows) + ["run_dir"]


def aggregate(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration and ``x`` of the runs' ``rows`` (``comparison_rows``), in their order: ``n_repeats``,
    the status (``2 completed, 1 failed`` where they differ) and per metric the mean and 95% interval
    (``<metric>_ci95_low``/``_high``) over the completed repeats (over all where none completed), a simulated repeat
    identical to an earlier one of the same seed (a simulated run is deterministic) counted once (``duplicates``)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["label"], json.dumps(r["x"], default=str)), []).append(r)
    metrics = METRICS + _extra_metrics(rows)
    out = []
    for group in groups.values():
        completed = [r for r in group if r["status"] == "completed"] or group
        # A copy of a sample is no second sample: counted twice, it would narrow the interval for nothing. Only a
        # simulated run (on a named device) is deterministic.
        seen: set[tuple[Any, ...]] = set()
        used = []
        for r in completed:
            simulated = bool((r.get("summary") or {}).get("hardware"))
            sample = (r.get("seed"), *(json.dumps(r.get(m), default=str) for m in metrics)) if simulated else id(r)
            if sample not in seen:
                seen.add(sample)
                used.append(r)
        statuses = {s: sum(r["status"] == s for r in group) for s in dict.fromkeys(r["status"] for r in group)}
        row: dict[str, Any] = {"label": group[0]["label"], "x": group[0]["x"], "n_repeats": len(group),
                               "status": next(iter(statuses)) if len(statuses) == 1 else
                               ", ".join(f"{n} {s}" for s, n in statuses.items())}
        for m in metrics:
            values = [r.get(m) for r in used if _number(r.get(m))]
            mean, low, high = mean_ci95(values)
            if mean is not None and all(isinstance(v, int) for v in values) and mean == int(mean):
                mean = int(mean)  # counts stay counts where every repeat agrees
            row.update({m: mean, f"{m}_ci95_low": low, f"{m}_ci95_high": high})
        row["run_dir"] = " ".join(r["run_dir"] for r in group)
        row["runs"], row["used"], row["duplicates"] = group, used, len(completed) - len(used)
        out.append(row)
    return out


def _repeats_caption(configs: Sequence[dict[str, Any]], pooled: bool) -> str | None:
    """What a figure's caption says of the repeats behind each point: how many were used (``aggregate``'s: the
    completed ones) and how many not completed were left out; None where every point is one run."""
    used = sorted({len(c["used"]) for c in configs})
    left_out = sum(c["n_repeats"] - len(c["used"]) - c.get("duplicates", 0) for c in configs)
    if used == [1] and not left_out:
        return None
    counted = f"{used[0]}" if len(used) == 1 else f"{used[0]}-{used[-1]}"
    noun = "repeat" if counted == "1" else "repeats"
    text = f"{counted} {noun} pooled" if pooled else f"mean and 95% CI over {counted} {noun}"
    return text + (f" ({left_out} not completed left out)" if left_out else "")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt_ci(row: dict[str, Any], metric: str) -> str:
    """``mean +- half-width`` of ``metric`` in ``row`` (the mean alone without an interval, or a zero-width one)."""
    mean, low, high = row.get(metric), row.get(f"{metric}_ci95_low"), row.get(f"{metric}_ci95_high")
    if mean is None or low is None or high is None or high == low:
        return _fmt(mean)
    return f"{_fmt(mean)} ± {_fmt(high - mean)}"


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(line) + " |" for line in lines)]


def markdown(configs: Sequence[dict[str, Any]], x: str, caption: str = "") -> str:
    """``comparison.md`` of the ``aggregate`` rows ``configs``: the configurations, their significant
    differences, the machine's timing noise and, where a configuration ran more than once, every run."""
    runs = [r for c in configs for r in c["runs"]]
    metrics = METRICS + _extra_metrics(runs)
    repeated = any(c["n_repeats"] > 1 for c in configs)
    table = _table(["label", x, "n_repeats", "status", *metrics, "run_dir"],
                   [[c["label"], _fmt(c["x"]), str(c["n_repeats"]), c["status"], *(_fmt_ci(c, m) for m in metrics),
                     c["run_dir"]] for c in configs])
    blocks = ["\n".join(table)] + ([caption + "."] if caption else [])
    if repeated:
        blocks.append("Cells: the mean over a configuration's repeats ± half its 95% confidence interval (Student's "
                      "t; bounds in comparison.csv as `<metric>_ci95_low` / `_high`; each run in runs.csv).")
        blocks += _differences(configs, x)
    else:
        blocks.append("One run per configuration: no confidence intervals. Run each several times (`repeat=0,1,2`; "
                      "simulated runs: `workload.seed=0,1,2`) to see which differences are noise.")
    blocks += _noise(runs)
    if repeated:
        columns = _run_columns(runs)
        blocks += ["## Runs", "\n".join(_table([x if c == "x" else c for c in columns],
                                                [[_fmt(r.get(c)) for c in columns] for r in runs]))]
    return "\n\n".join(blocks) + "\n"


#: What the significance table compares (the figures' metrics).
DIFFERENCES = ["output_throughput", "request_goodput", *(key for key, _ in LATENCY)]


def _differences(configs: Sequence[dict[str, Any]], x: str) -> list[str]:
    """Markdown blocks: the ratio of every two configurations' means at one ``x``, marked ``n.s.`` where their
    intervals overlap; a note where repeats came out identical."""
    metrics = [m for m in DIFFERENCES if any(c.get(m) is not None for c in configs)]
    by_x: dict[str, list[dict[str, Any]]] = {}
    for c in configs:
        if c["n_repeats"] > 1:
            by_x.setdefault(json.dumps(c["x"], default=str), []).append(c)
    lines = [[_fmt(a["x"]), f"{a['label']} / {b['label']}", *(_ratio(a, b, m) for m in metrics)]
             for group in by_x.values() for i, a in enumerate(group) for b in group[i + 1:]]
    blocks = ["## Differences",
              f"Each cell: the first configuration's mean over the second's, at the same `{x}`; **n.s.** (not "
              "significant): their 95% intervals overlap, so noise may explain the difference (a conservative test). "
              "Configurations that ran once are left out."]
    duplicated = [c for c in configs if c.get("duplicates")]
    if duplicated:
        blocks.append(f"{len(duplicated)} configuration(s) had repeats identical to another of the same seed (a "
                      f"simulated run is deterministic): each such run counted once, "
                      f"{sum(c['duplicates'] for c in duplicated)} in all. Repeats of a simulated run must differ by "
                      f"seed (`workload.seed=0,1,2`).")
    identical = [c["label"] for c in configs if c["n_repeats"] > 1 and _identical(c)]
    if identical:
        blocks.append(f"The repeats of {len(identical)} configuration(s) gave identical results: a simulated run is "
                      "deterministic, so its repeats must differ by seed (`workload.seed=0,1,2`).")
    if lines:
        blocks.append("\n".join(_table([x, "configurations", *metrics], lines)))
    return blocks


def _ratio(a: dict[str, Any], b: dict[str, Any], metric: str) -> str:
    """``a``'s mean of ``metric`` over ``b``'s, marked **n.s.** where their intervals overlap (a mean of 0 is
    a measured one: goodput when no request met the SLO)."""
    if a.get(metric) is None or b.get(metric) is None or a[metric] == b[metric] == 0:
        return "-"
    same = overlap((a[f"{metric}_ci95_low"], a[f"{metric}_ci95_high"]),
                   (b[f"{metric}_ci95_low"], b[f"{metric}_ci95_high"]))
    ratio = "inf" if b[metric] == 0 else f"{a[metric] / b[metric]:.2f}x"
    # No interval where only one repeat had the metric: unknown, not significant.
    return ratio + {True: " **n.s.**", False: "", None: " (no interval)"}[same]


def _identical(config: dict[str, Any]) -> bool:
    """Whether every timed metric of ``config``'s repeats came out the same."""
    timed = [m for m in DIFFERENCES + ["duration_s"] if config.get(f"{m}_ci95_low") is not None]
    return bool(timed) and all(config[f"{m}_ci95_low"] == config[f"{m}_ci95_high"] for m in timed)


def _noise(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown blocks on the machine's timing noise during the runs (``summary.json``'s ``step_time_noise_cv``):
    the floor under which a difference between two runs means nothing."""
    measured = sorted(((r["step_time_noise_cv"], (r.get("summary") or {}).get("step_time_noise_steps"))
                       for r in runs if r.get("step_time_noise_cv") is not None), key=lambda m: m[0])
    head = "## Timing noise"
    if not measured:
        ran = [r for r in runs if r.get("status") != "failed"]  # a failed job's summary says nothing of its executor
        if ran and all((r.get("summary") or {}).get("hardware") for r in ran):
            return [head, "None: simulated runs are deterministic (their repeats differ only by seed)."]
        return [head, "Not measured (no step shape came 5 times, or the runs predate the measure)."]
    cv, steps = measured[len(measured) // 2]
    spread = f"; {measured[0][0]:.1%} to {measured[-1][0]:.1%} over {len(measured)} runs" if len(measured) > 1 else ""
    return [head, f"Steps of one shape (the same number of requests, prefill and decode tokens) varied in duration by "
                  f"a coefficient of variation of {cv:.1%} (the median run, from {steps} steps{spread}). A difference "
                  f"between two single runs smaller than this is within the machine's noise."]


def write_comparison(dirs: Sequence[str | Path], out: str | Path | None = None, x: str = "workload.rate",
                     label: Sequence[str] | None = None, rows: list[dict[str, Any]] | None = None) -> dict[str, Path]:
    """Write the tables and figures of the runs under ``dirs`` to ``out`` (``rows``: their
    ``comparison_rows``, when the caller has them); return the paths (a figure's PNG; its PDF is beside it)."""
    from framework.harness import plots

    rows = comparison_rows(dirs, x, label) if rows is None else rows
    out = Path(out) if out is not None else (Path(dirs[0]) if len(dirs) == 1 else Path("comparison"))
    if out.exists() and not out.is_dir():  # mkdir's FileExistsError would not say what is wrong
        raise ValueError(f"{out} is not a directory (the table and plots are written into one)")
    out.mkdir(parents=True, exist_ok=True)
    configs = aggregate(rows)
    summaries = [r["summary"] for r in rows if r.get("summary")]
    caption = plots.caption_line(summaries, _repeats_caption(configs, pooled=False))
    paths = {"markdown": out / "comparison.md", "csv": out / "comparison.csv", "runs": out / "runs.csv"}
    paths["markdown"].write_text(markdown(configs, x, caption))
    metrics = METRICS + _extra_metrics(rows)
    _write_csv(paths["csv"], ["label", "x", "n_repeats", "status",
                              *(k for m in metrics for k in (m, f"{m}_ci95_low", f"{m}_ci95_high")), "run_dir"],
               configs, x)
    _write_csv(paths["runs"], _run_columns(rows), rows, x)
    xname, xlabel = x.split(".")[-1], plots.axis_label(x)
    colour_of = plots.colours(c["label"] for c in configs)
    throughput = THROUGHPUT + ([GOODPUT] if any(c.get("request_goodput") is not None for c in configs) else [])
    paths["throughput"] = plots.metric_vs_x(configs, "x", throughput, out / f"throughput_vs_{xname}.png",
                                            "Throughput", xlabel=xlabel, colour_of=colour_of, caption=caption)
    paths["latency"] = plots.metric_vs_x(configs, "x", LATENCY, out / f"latency_vs_{xname}.png", "Latency",
                                         xlabel=xlabel, colour_of=colour_of, caption=caption, ncols=3)
    samples = {(c["label"], c["x"]): _pooled_latencies(c["used"]) for c in configs}
    if any(len(v) for s in samples.values() for v in s.values()):
        pooled = plots.caption_line(summaries, _repeats_caption(configs, pooled=True))
        paths["latency_cdf"] = plots.latency_cdf_overlay(samples, out / "latency_cdfs.png", xlabel, colour_of, pooled)
    return paths


def _write_csv(path: Path, columns: list[str], rows: Sequence[dict[str, Any]], x: str) -> None:
    """``rows``' ``columns`` as CSV, the column ``x`` headed by the config key it is."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([x if c == "x" else c for c in columns])
        writer.writerows([r.get(c) for c in columns] for r in rows)


def _pooled_latencies(runs: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """TTFT, TPOT and E2EL (ms) of the completed requests of ``runs`` (their ``requests.csv``), pooled."""
    from framework.harness.plots import CDF_METRICS

    pooled: dict[str, list[float]] = {name: [] for name, _ in CDF_METRICS}
    for run in runs:
        path = Path(run["run_dir"]) / "requests.csv"
        if not path.is_file():
            continue
        try:
            for r in _complete_rows(path):
                if r["status"] in ("length", "stop") and int(r["output_len"]) > 0:
                    for name, column in CDF_METRICS:
                        if r[column]:
                            pooled[name].append(float(r[column]))
        except (OSError, ValueError, KeyError, csv.Error) as exc:  # not a run's CSV: the figure goes without it
            log.warning("%s: its latencies left out of the CDFs: %s", path, exc)
    return pooled


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m framework.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", help="run directories, multirun trees, or folders holding them")
    parser.add_argument("--out", help="where to write the table and plots (default: the one folder given, "
                        "else ./comparison)")
    parser.add_argument("--x", default="workload.rate", help="config key on the x axis (default: workload.rate)")
    parser.add_argument("--label", help="comma-separated config keys that name a configuration")
    args = parser.parse_args(argv)
    try:
        paths = write_comparison(args.dirs, args.out, args.x, args.label.split(",") if args.label else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --out where nothing can be written (read-only, a missing mount), a run unreadable
        print(f"error: {exc.filename or args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in _files(paths)))
    return 0


def _files(paths: dict[str, Path]) -> list[Path]:
    """Every file ``write_comparison`` wrote: its ``paths``, and each figure's PDF beside its PNG."""
    return [q for p in paths.values() for q in ((p, p.with_suffix(".pdf")) if p.suffix == ".png" else (p,))]


class CompareCallback(Callback):
    """Hydra callback: holds the sweep's folder for the sweep (one a live sweep holds is refused, exit 2), and at its
    end compares its runs at the folder's root (a failure to compare only warns), then exits with status 1 if any run
    failed or was refused its folder."""

    #: The sweep under way in this process, for ``compare_stopped_sweep``.
    sweep_dir: Path | None = None
    #: Whether this process started a multirun (``-m``, or ``hydra.mode: MULTIRUN`` in a named
    #: experiment's file): its exit status 1 is a failed job's, not a configuration error's.
    multirun_started = False
    #: The claim on the sweep's folder (``recorder.claim_run_dir``), from its start to its end.
    _held = ExitStack()

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        restore_hydra_reports()  # composed: what fails from here (its logging) Hydra reports
        try:
            make_run_dir(Path(config.hydra.run.dir), "hydra.run.dir")  # before Hydra, which would give a traceback
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        restore_hydra_reports()  # a job's errors are reported by Hydra, as ever
        try:
            refusals = sweep_refusals(sweep_jobs(config) or [])
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        if refusals is not None:
            print("\n".join(f"error: {line}" for line in refusals), file=sys.stderr)
            sys.exit(2)
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            CompareCallback._held.enter_context(claim_run_dir(sweep_dir, "hydra.sweep.dir"))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        for stale in sweep_dir.glob(REFUSED_GLOB):  # an earlier sweep's, in a folder given again
            stale.unlink()
        CompareCallback.sweep_dir = sweep_dir
        CompareCallback.multirun_started = True

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        CompareCallback.sweep_dir = None
        sweep_dir = Path(config.hydra.sweep.dir)
        with CompareCallback._held:
            rows: list[dict[str, Any]] = []
            try:
                rows = comparison_rows([sweep_dir])
                paths = write_comparison([sweep_dir], sweep_dir, rows=rows)
            except Exception as exc:
                log.warning("could not compare the runs in %s: %s", sweep_dir, exc)
            else:
                print(paths["markdown"].read_text())
                print(f"comparison: {paths['markdown']} (and comparison.csv, runs.csv, figures) in {sweep_dir}")
            failed = [r["run_dir"] for r in rows if r["status"] == "failed"]
            if failed:
                print(f"{len(failed)} run(s) failed: {', '.join(failed)} (see their summary.json and logs)",
                      file=sys.stderr)
            refused = [path.read_text().strip() for path in sorted(sweep_dir.glob(REFUSED_GLOB))]
            if refused:
                print(f"{len(refused)} run(s) not started: " + "; ".join(refused), file=sys.stderr)
            if failed or refused:
                sys.exit(1)


def sweep_refusals(jobs: list[tuple[list[str], DictConfig]]) -> list[str] | None:
    """Checks each of a sweep's ``jobs`` (overrides, config) as its run will (``check_experiment``), before the first
    runs: where every job would be refused, the lines to refuse the sweep with (one per error); else None, having
    warned of the jobs that will fail, which the sweep runs to their error as it comes (a grid may hold cells a
    policy refuses)."""
    from framework.common.registry import UnavailableError
    from framework.harness.experiment import check_experiment

    refused: dict[str, list[int]] = {}
    for num, (_, job) in enumerate(jobs):
        try:
            check_experiment(job)
        except InterpolationResolutionError:
            continue  # ${hydra:...} resolves only in the job itself: checked there
        except (ValueError, UnavailableError, OmegaConfBaseException) as exc:
            refused.setdefault(str(exc), []).append(num)
        except Exception:  # no configuration error: the job's own run reports it, with its traceback
            log.debug("checking job %d", num, exc_info=True)
    if not refused:
        return None
    # A job is named by the values that set it apart: every job shares the others.
    values = [dict(o.partition("=")[::2] for o in overrides) for overrides, _ in jobs]
    varying = [key for key in values[0] if len({v.get(key) for v in values}) > 1]

    def name(num: int) -> str:
        return f"job {num}" + (f" ({', '.join(f'{k}={values[num][k]}' for k in varying)})" if varying else "")

    if sum(map(len, refused.values())) == len(jobs):
        return [message if len(refused) == 1 else f"{message} ({', '.join(map(name, nums))})"
                for message, nums in refused.items()]
    for message, nums in refused.items():
        print(f"warning: {', '.join(map(name, nums))} of {len(jobs)} will fail: {message}", file=sys.stderr)
    return None


#: A sweep's job refused its folder (another live run holds it) says so in ``refused-JOB_NUM.txt`` at the sweep's root:
#: the job's own folder is the other run's, and a launcher may run the job in another process.
REFUSED_FILE = "refused-{}.txt"
REFUSED_GLOB = "refused-*.txt"


def compare_stopped_sweep() -> Path | None:
    """Compare the runs of a sweep that stopped before its end (Ctrl-C), as its end would have:
    the table and plots at its root, over the runs that wrote a summary. Returns the table's path,
    or None when no sweep was under way or nothing could be compared (a warning says why)."""
    sweep_dir, CompareCallback.sweep_dir = CompareCallback.sweep_dir, None
    if sweep_dir is None or not sweep_dir.is_dir():
        return None
    try:
        return write_comparison([sweep_dir], sweep_dir)["markdown"]
    except Exception as exc:
        log.warning("could not compare the runs in %s: %s", sweep_dir, exc)
        return None

