"""``python -m framework.compare DIR... [--out OUT] [--x KEY] [--label KEY,...]``: compare runs.

Reads every run under the given directories (a run is a folder holding ``summary.json``; a
single run, a multirun tree or a folder of several) and writes to ``OUT`` (default: the only
DIR given, else ``./comparison``):

- ``comparison.md`` and ``comparison.csv``: one row per run;
- ``throughput_vs_rate.png`` and ``p99_latency_vs_rate.png``: the metrics against ``--x``
  (default ``workload.rate``), one line per configuration.

A configuration is labelled by the config keys whose values differ between the runs (other than
``--x``), e.g. ``policy=chunked``; by the file where only a group's file differs (``workload=chat``);
a run that left a group out counts as the part it ran, with its defaults (``policy=fcfs``).
``--label`` picks the keys instead. A multirun writes its own comparison (``CompareCallback``).

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
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from framework.common.config import PART_NAMES, EngineConfig

log = logging.getLogger(__name__)

COLUMNS = ["label", "x", "status", "completed", "failed", "duration_s", "request_throughput", "output_throughput",
           "total_token_throughput", "request_goodput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
           "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "mean_queueing_delay_ms", "prefix_cache_hit_rate",
           "num_preemptions", "num_swaps", "total_prefill_tokens", "blocks_swapped_out"]
#: Config keys that never tell configurations apart.
IGNORED_PREFIXES = ("hydra.", "logger.", "progress", "plots", "save_workload", "clock")
THROUGHPUT = [("output_throughput", "output tokens/s"), ("request_throughput", "requests/s")]
P99 = [("p99_ttft_ms", "p99 TTFT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)"), ("p99_e2el_ms", "p99 E2EL (ms)")]


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
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if not isinstance(v, list) else json.dumps(v)
    return out


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
                flat.setdefault(f"{part}.{key}", value)
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
        return {**summary, **csv_metrics(run_dir, {k: flat.get(f"slo.{k}") for k in ("ttft_ms", "tpot_ms", "e2el_ms")})}
    except (OSError, ValueError, csv.Error) as exc:  # unreadable, or not a run's CSV: the run shows without them
        log.warning("%s: no metrics from its CSVs: %s", run_dir, exc)
        return summary


def csv_metrics(run_dir: Path, slo: dict[str, Any] | None = None) -> dict[str, Any]:
    """``metrics.summarize`` of the rows in the run's ``requests.csv`` and ``steps.csv`` (a row a kill cut short
    left out) over the time they span, goodput by ``slo`` (``SLO``'s keys); ITLs and hit rate unknown (None)."""
    from framework.harness.metrics import SLO, summarize  # numpy and the engine: only for a run that needs it

    records = _csv_records(run_dir / "requests.csv")
    steps, steps_end = _csv_steps(run_dir / "steps.csv")
    end = max([steps_end, *(r.arrival_time + r.e2el for r in records if r.e2el is not None)])
    return summarize(records, end, SLO(**(slo or {})), steps)


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


def _csv_steps(path: Path) -> tuple[Any, float]:
    """The ``StepTotals`` of ``steps.csv``'s rows (none without the file) and when the last step ended."""
    from framework.harness.metrics import StepTotals

    totals, end, kv_usage = StepTotals(), 0.0, []
    sums = dict.fromkeys(("num_scheduled_tokens", "num_prefill_tokens", "num_swapped_out_blocks",
                          "num_swapped_in_blocks"), 0)
    for row in _complete_rows(path) if path.is_file() else ():
        kv_usage.append(float(row["kv_usage"]))
        end = max(end, float(row["time_s"]) + float(row["duration"]))
        for key in sums:
            sums[key] += int(row[key])
    totals.add(len(kv_usage), kv_usage, *sums.values())
    return totals, end


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
    """Config keys whose values differ between runs, other than ``x`` and bookkeeping keys."""
    varying = [k for k in varying_keys(flats) if k != x]
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
        # A failed run lacks what only a run records (the parts' names in its summary): the labels
        # come from the runs that ran.
        ran = [f for s, f in loaded if s.get("status") != "failed"]
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
        row.update(label=text, x=flat.get(x, summary.get(x.split(".")[-1])), run_dir=str(run_dir))
        rows.append(row)
    rows.sort(key=lambda r: (r["label"], r["x"] is None, r["x"] if isinstance(r["x"], (int, float)) else 0))
    return rows


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


def markdown(rows: Sequence[dict[str, Any]], x: str) -> str:
    columns = _columns(rows)
    header = [x if c == "x" else c for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    extra = sorted({k for r in rows for k in r if k.startswith("prio")})
    return COLUMNS + extra + ["run_dir"]


def write_comparison(dirs: Sequence[str | Path], out: str | Path | None = None, x: str = "workload.rate",
                     label: Sequence[str] | None = None, rows: list[dict[str, Any]] | None = None) -> dict[str, Path]:
    """Write the table and plots of the runs under ``dirs`` to ``out`` (``rows``: their
    ``comparison_rows``, when the caller has them); return the paths."""
    from framework.harness.plots import metric_vs_x

    rows = comparison_rows(dirs, x, label) if rows is None else rows
    out = Path(out) if out is not None else (Path(dirs[0]) if len(dirs) == 1 else Path("comparison"))
    if out.exists() and not out.is_dir():  # mkdir's FileExistsError would not say what is wrong
        raise ValueError(f"{out} is not a directory (the table and plots are written into one)")
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "comparison.md", "csv": out / "comparison.csv"}
    paths["markdown"].write_text(markdown(rows, x))
    columns = _columns(rows)
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([x if c == "x" else c for c in columns])
        writer.writerows([r.get(c) for c in columns] for r in rows)
    xname = x.split(".")[-1]
    paths["throughput"] = metric_vs_x(rows, "x", THROUGHPUT, out / f"throughput_vs_{xname}.png",
                                      "Throughput", xlabel=x)
    paths["p99_latency"] = metric_vs_x(rows, "x", P99, out / f"p99_latency_vs_{xname}.png",
                                       "p99 latency", xlabel=x)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m framework.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", help="run directories, multirun trees, or folders holding them")
    parser.add_argument("--out", help="where to write the table and plots")
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
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


class CompareCallback(Callback):
    """Hydra callback: at the end of a multirun, compare its runs at the sweep's root (a
    failure to compare only warns), then exit with status 1 if any run failed."""

    #: The sweep under way in this process, for ``compare_stopped_sweep``.
    sweep_dir: Path | None = None
    #: Whether this process started a multirun (``-m``, or ``hydra.mode: MULTIRUN`` in a named
    #: experiment's file): its exit status 1 is a failed job's, not a configuration error's.
    multirun_started = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        CompareCallback.sweep_dir = Path(config.hydra.sweep.dir)
        CompareCallback.multirun_started = True

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        CompareCallback.sweep_dir = None
        sweep_dir = Path(config.hydra.sweep.dir)
        rows: list[dict[str, Any]] = []
        try:
            rows = comparison_rows([sweep_dir])
            paths = write_comparison([sweep_dir], sweep_dir, rows=rows)
        except Exception as exc:
            log.warning("could not compare the runs in %s: %s", sweep_dir, exc)
        else:
            print(paths["markdown"].read_text())
            print(f"comparison: {paths['markdown']} (and .csv, plots) in {sweep_dir}")
        failed = [r["run_dir"] for r in rows if r["status"] == "failed"]
        if failed:
            print(f"{len(failed)} run(s) failed: {', '.join(failed)} (see their summary.json and logs)", file=sys.stderr)
            sys.exit(1)


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

