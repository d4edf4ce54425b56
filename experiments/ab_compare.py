"""Time a command on this tree against the same command on a baseline git revision, interleaved.

This shared machine's speed drifts by tens of percent from one minute to the next, so two
series timed one after the other compare two machines. Here every round runs both sides back to
back (the order alternating from round to round), and the figure that counts is the per-round
ratio (this tree / baseline): both sides of a pair saw the same minute.

    python experiments/ab_compare.py --baseline HEAD~1 -- python experiments/bench_sim_scale.py --out {out}
    python experiments/ab_compare.py --baseline main --rounds 8 -- \\
        python -m framework.run executor=sim workload.num_requests=2000 hydra.run.dir={out}
    python experiments/ab_compare.py --baseline HEAD -- ...      # A/A: the set-up's own spread

The baseline is checked out into a temporary git worktree (removed afterwards; it holds tracked
files only, so an ignored calibration or checkpoint the command reads must be given by an
absolute path). The command runs from the root of each tree, whatever the folder it was started
from, with that tree first on ``PYTHONPATH``; before timing, the tool checks that each side
imports its own packages. Uncommitted changes count as this tree. Both trees' packages are
byte-compiled first, so neither pays for compiling at every start, and one untimed round of each
side runs first (``--warmup``). The time is the whole process's wall time, from start to exit;
each side's output of the last round is kept in ``OUT/<side>.log``.

``{out}`` in the command becomes an output folder per side (``OUT/baseline`` and
``OUT/current``, emptied and created first). After the last round the files the two sides wrote
there are compared byte for byte, so a change meant to be faster is also checked to change
nothing it writes: each side's own output folder, where a file names it (a sweep's
comparison.md lists its runs' folders), counts as ``{out}``; JSON files are compared without
their wall-clock and path keys (``VOLATILE_KEYS``), Hydra's hydra.yaml and multirun.yaml (which
also hold the tree's path) not at all; ``--ignore NAME`` leaves out more.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("baseline", "current")
#: Importable packages of a tree, checked to come from that tree; experiments/ is only compiled.
PACKAGES = ("framework", "policies", "backends", "models")
#: Hydra's records of a run or sweep: they hold the tree's path, so they differ between any two runs.
IGNORED = ("hydra.yaml", "multirun.yaml")
#: Keys of a JSON object (summary.json) that differ between any two runs.
VOLATILE_KEYS = ("wall_time_s", "run_dir")


@dataclass
class Comparison:
    """Per-round wall times in seconds of each side, and the files compared after the last round
    (``compared`` is False when the command has no ``{out}``)."""
    seconds: dict[str, list[float]] = field(default_factory=lambda: {side: [] for side in SIDES})
    compared: bool = False
    identical: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)
    only_one_side: list[str] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """current / baseline, one per round."""
        return [c / b for b, c in zip(self.seconds["baseline"], self.seconds["current"])]

    def report(self) -> str:
        lines = []
        for side in SIDES:
            s = self.seconds[side]
            lines.append(f"{side:9s} median {statistics.median(s):.3f} s, min {min(s):.3f} s, max {max(s):.3f} s")
        r = self.ratios
        faster = sum(x < 1 for x in r)
        lines.append(f"current / baseline: median of the {len(r)} pairs {statistics.median(r):.3f}x "
                     f"(range {min(r):.3f}-{max(r):.3f}); current faster in {faster} of {len(r)}")
        if not self.compared:
            lines.append("outputs not compared: the command has no {out}")
        elif not (self.identical or self.different or self.only_one_side):
            lines.append("outputs not compared: neither side wrote a file under {out}")
        else:
            lines.append(f"files identical: {', '.join(self.identical) or 'none'}")
            if self.different:
                lines.append(f"files that differ: {', '.join(self.different)}")
            if self.only_one_side:
                lines.append(f"files written by one side only: {', '.join(self.only_one_side)}")
        return "\n".join(lines)


def _git(*args: str, cwd: Path) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()


def _same(a: Path, b: Path, a_out: Path, b_out: Path) -> bool:
    """Whether ``a`` (written under ``a_out``) and ``b`` (under ``b_out``) hold the same, once
    each side's output folder is read as ``{out}``."""
    if filecmp.cmp(a, b, shallow=False):
        return True
    x, y = (f.read_bytes().replace(str(out).encode(), b"{out}") for f, out in ((a, a_out), (b, b_out)))
    if x == y:
        return True
    if a.suffix != ".json":
        return False
    try:
        x, y = json.loads(x), json.loads(y)
    except ValueError:
        return False
    if not (isinstance(x, dict) and isinstance(y, dict)):
        return False
    return {k: v for k, v in x.items() if k not in VOLATILE_KEYS} == {k: v for k, v in y.items() if k not in VOLATILE_KEYS}


def compare_outputs(base: Path, current: Path, ignore: set[str], result: Comparison) -> None:
    """Sort the files under the two output folders into identical, different and one-sided."""
    result.compared = True
    a, b = _files(base), _files(current)
    for name in sorted(a | b):
        if Path(name).name in ignore:
            continue
        if name not in a or name not in b:
            result.only_one_side.append(name)
        elif _same(base / name, current / name, base, current):
            result.identical.append(name)
        else:
            result.different.append(name)


def run_once(command: list[str], cwd: Path, out: Path, env: dict[str, str], log: Path) -> float:
    """Run ``command`` (``{out}`` filled in) in ``cwd``; its wall time in seconds. Its output
    goes to ``log``; a failing command stops the comparison with the end of it."""
    argv = [arg.replace("{out}", str(out)) for arg in command]
    with open(log, "w") as f:
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        except OSError as exc:  # not found, not executable: the command's fault, not a crash
            raise SystemExit(f"cannot run {argv[0]!r} in {cwd}: {exc.strerror}") from None
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{shlex.join(argv)} failed in {cwd} (exit {done.returncode}):\n{tail}")
    return seconds


def side_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    return env


def byte_compile(tree: Path) -> None:
    """Compile a tree's packages: with PYTHONDONTWRITEBYTECODE set (as on this machine) a tree
    without bytecode would pay for compiling at every start, and the other would not."""
    folders = [str(tree / name) for name in (*PACKAGES, "experiments") if (tree / name).is_dir()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *folders], check=True, capture_output=True)


def check_imports_from(tree: Path, env: dict[str, str], neutral: Path) -> None:
    """Each of the tree's packages must be imported from the tree itself, not from an installed
    copy. Run from ``neutral`` so that the working folder does not put the tree on the path."""
    names = [name for name in PACKAGES if (tree / name / "__init__.py").is_file()]
    # find_spec locates a package as an import would, without running it (backends loads torch).
    probe = "import importlib.util, sys\nfor n in sys.argv[1:]: print(importlib.util.find_spec(n).origin)"
    done = subprocess.run([sys.executable, "-c", probe, *names], cwd=neutral, env=env, capture_output=True,
                          text=True, errors="replace")
    if done.returncode != 0:
        raise SystemExit(f"cannot find {', '.join(names)} from {tree}:\n{done.stderr.strip()[-1000:]}")
    for name, where in zip(names, done.stdout.split()):
        if tree.resolve() not in Path(where).resolve().parents:
            raise SystemExit(f"the tree {tree} imports {name} from {where}, not from itself")


def _remove_worktree(root: Path, tree: Path) -> None:
    # A failure here must not hide the comparison's own error: warn and let git forget it.
    done = subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"warning: could not remove the worktree {tree}: {done.stderr.strip()}", file=sys.stderr)
        subprocess.run(["git", "worktree", "prune"], cwd=root, capture_output=True)


def compare(command: list[str], baseline: str, rounds: int, ignore: set[str], out_root: Path,
            root: Path = ROOT, warmup: int = 1, echo: Callable[[str], None] = print) -> Comparison:
    """Run ``warmup`` untimed rounds, then ``rounds`` timed ones of ``command`` on ``baseline``
    (checked out) and on the working tree at ``root``, and compare the files the two sides wrote
    under ``out_root``."""
    inside = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    if inside.returncode != 0:
        raise SystemExit(f"{root} is not inside a git repository: the baseline is a git revision")
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{baseline}^{{commit}}"], cwd=root,
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--baseline {baseline!r} is not a commit of the repository at {root} "
                         f"(give a commit, branch or tag, e.g. HEAD~1 or main)")
    rev = found.stdout.strip()
    out_root.mkdir(parents=True, exist_ok=True)
    for side in SIDES:  # files left by an earlier comparison would be compared as this one's
        shutil.rmtree(out_root / side, ignore_errors=True)
        (out_root / side).mkdir()
    result = Comparison()
    with tempfile.TemporaryDirectory(prefix="ab_baseline_") as tmp:
        tree = Path(tmp) / "tree"
        _git("worktree", "add", "--detach", str(tree), rev, cwd=root)
        try:
            trees = {"baseline": tree, "current": root}
            envs = {side: side_env(trees[side]) for side in SIDES}
            for side in SIDES:
                check_imports_from(trees[side], envs[side], Path(tmp))
                byte_compile(trees[side])
            echo(f"baseline {baseline} ({rev[:10]}) against this tree, {rounds} round{'s' * (rounds != 1)}: {shlex.join(command)}")

            def run(side: str) -> float:
                return run_once(command, trees[side], out_root / side, envs[side], out_root / f"{side}.log")

            for _ in range(warmup):  # the first run of a fresh tree reads its files from disk
                for side in SIDES:
                    run(side)
            for i in range(1, rounds + 1):
                # Alternate which side goes first, so that what a second run inherits from the
                # first (caches, the machine's rhythm) does not always land on the same side.
                order = SIDES if i % 2 else SIDES[::-1]
                for side in order:
                    result.seconds[side].append(run(side))
                b, c = result.seconds["baseline"][-1], result.seconds["current"][-1]
                echo(f"round {i} ({order[0]} first): baseline {b:.3f} s, current {c:.3f} s ({c / b:.3f}x)")
        finally:
            _remove_worktree(root, tree)
    if any("{out}" in arg for arg in command):
        compare_outputs(out_root / "baseline", out_root / "current", ignore, result)
    return result


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM (a timeout wrapper, a closed terminal) as an exit, so the worktree is removed.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="The command runs from the root of each tree; {out} is each side's output folder.")
    ap.add_argument("--baseline", default="HEAD", help="git revision to compare against (default HEAD)")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds (default 6)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--ignore", action="append", default=list(IGNORED),
                    help=f"file name left out of the output comparison (repeatable; always {', '.join(IGNORED)})")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "ab_compare"),
                    help="where the {out} folders and the logs go (default outputs/ab_compare in the repository)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to time, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to time after --, e.g. -- python experiments/bench_sim_scale.py --out {out}")
    if args.rounds < 1 or args.warmup < 0:
        ap.error(f"--rounds must be at least 1 and --warmup at least 0, got {args.rounds} and {args.warmup}")
    signal.signal(signal.SIGTERM, _terminate)
    result = compare(command, args.baseline, args.rounds, set(args.ignore), Path(args.out).resolve(),
                     warmup=args.warmup)
    print(result.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
