"""Time a command on this tree against the same command on a baseline git revision, interleaved.

This shared machine's speed drifts by tens of percent from one minute to the next, so two
series timed one after the other compare two machines. Here every round runs the baseline and
then this tree, back to back, and the figure that counts is the per-round ratio (this tree /
baseline): both sides of a pair saw the same minute.

    python experiments/ab_compare.py --baseline HEAD~1 -- python experiments/bench_sim_scale.py --out {out}
    python experiments/ab_compare.py --baseline main --rounds 8 -- python experiments/bench_throughput.py

The baseline is checked out into a temporary git worktree (removed afterwards) and run from
there with its own ``framework`` first on ``PYTHONPATH``; uncommitted changes count as this tree.
Both trees' packages are byte-compiled first, so neither pays for compiling at every start, and
one untimed round of each side runs first (``--warmup``). The time is the whole process's wall
time, from start to exit.

``{out}`` in the command becomes an output folder per side (``OUT/baseline`` and
``OUT/current``, emptied first). After the last round the files the two sides wrote there are
compared byte for byte, so a change meant to be faster is also checked to change nothing it
writes. summary.json and Hydra's hydra.yaml hold wall times and paths and are left out;
``--ignore NAME`` leaves out more.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import shutil
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
PACKAGES = ("framework", "policies", "backends", "models", "experiments")
#: Files that hold wall times or the output path, so they differ between any two runs.
IGNORED = ("summary.json", "hydra.yaml")


@dataclass
class Comparison:
    """Per-round wall times in seconds of each side, and the files compared after the last round."""
    seconds: dict[str, list[float]] = field(default_factory=lambda: {side: [] for side in SIDES})
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
        if self.identical or self.different or self.only_one_side:
            lines.append(f"files identical: {', '.join(self.identical) or 'none'}")
            if self.different:
                lines.append(f"files that differ: {', '.join(self.different)}")
            if self.only_one_side:
                lines.append(f"files written by one side only: {', '.join(self.only_one_side)}")
        return "\n".join(lines)


def _git(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()


def compare_outputs(base: Path, current: Path, ignore: set[str], result: Comparison) -> None:
    """Sort the files under the two output folders into identical, different and one-sided."""
    a, b = _files(base), _files(current)
    for name in sorted(a | b):
        if Path(name).name in ignore:
            continue
        if name not in a or name not in b:
            result.only_one_side.append(name)
        elif filecmp.cmp(base / name, current / name, shallow=False):
            result.identical.append(name)
        else:
            result.different.append(name)


def run_once(command: list[str], cwd: Path, out: Path, env: dict[str, str]) -> float:
    """Run ``command`` (``{out}`` filled in) in ``cwd``; its wall time in seconds. A failing
    command stops the comparison with its output."""
    argv = [arg.replace("{out}", str(out)) for arg in command]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed in {cwd} (exit {done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    return seconds


def side_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    return env


def byte_compile(tree: Path) -> None:
    """Compile both trees' packages first: with PYTHONDONTWRITEBYTECODE set (as on this machine) a
    tree without bytecode would pay for compiling at every start, and the other would not."""
    folders = [str(tree / name) for name in PACKAGES if (tree / name).is_dir()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *folders], check=True, capture_output=True)


def check_imports_from(tree: Path, env: dict[str, str]) -> None:
    """The baseline must import its own framework, not the installed one."""
    done = subprocess.run([sys.executable, "-c", "import framework; print(framework.__file__)"], cwd=tree, env=env,
                          capture_output=True, text=True)
    where = Path(done.stdout.strip() or "?").resolve()
    if done.returncode != 0 or tree.resolve() not in where.parents:
        raise SystemExit(f"the baseline tree {tree} imports framework from {where}, not from itself: "
                         f"{done.stderr.strip()[-500:]}")


def compare(command: list[str], baseline: str, rounds: int, ignore: set[str], out_root: Path,
            root: Path = ROOT, warmup: int = 1, echo: Callable[[str], None] = print) -> Comparison:
    """Run ``warmup`` untimed rounds, then ``rounds`` timed ones (``baseline`` checked out, then
    the working tree at ``root``), and compare the files the two sides wrote under ``out_root``."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{baseline}^{{commit}}"], cwd=root,
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--baseline {baseline!r} is not a commit of the repository at {root} "
                         f"(give a commit, branch or tag, e.g. HEAD~1 or main)")
    rev = found.stdout.strip()
    for side in SIDES:  # files left by an earlier comparison would be compared as this one's
        shutil.rmtree(out_root / side, ignore_errors=True)
    result = Comparison()
    with tempfile.TemporaryDirectory(prefix="ab_baseline_") as tmp:
        tree = Path(tmp) / "tree"
        _git("worktree", "add", "--detach", str(tree), rev, cwd=root)
        try:
            envs = {"baseline": side_env(tree), "current": side_env(root)}
            check_imports_from(tree, envs["baseline"])
            trees = {"baseline": tree, "current": root}
            for side_tree in trees.values():
                byte_compile(side_tree)
            echo(f"baseline {baseline} ({rev[:10]}) against this tree, {rounds} rounds: {' '.join(command)}")
            for _ in range(warmup):  # the first run of a fresh tree reads its files from disk
                for side in SIDES:
                    run_once(command, trees[side], out_root / side, envs[side])
            for i in range(1, rounds + 1):
                for side in SIDES:
                    result.seconds[side].append(run_once(command, trees[side], out_root / side, envs[side]))
                b, c = result.seconds["baseline"][-1], result.seconds["current"][-1]
                echo(f"round {i}: baseline {b:.3f} s, current {c:.3f} s ({c / b:.3f}x)")
        finally:
            _git("worktree", "remove", "--force", str(tree), cwd=root)
    if any("{out}" in arg for arg in command):
        compare_outputs(out_root / "baseline", out_root / "current", ignore, result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="HEAD", help="git revision to compare against (default HEAD)")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--ignore", action="append", default=list(IGNORED),
                    help=f"file name left out of the output comparison (repeatable; always {', '.join(IGNORED)})")
    ap.add_argument("--out", default="outputs/ab_compare", help="where {out} folders go (default outputs/ab_compare)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to time, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to time after --, e.g. -- python experiments/bench_sim_scale.py --out {out}")
    if args.rounds < 1 or args.warmup < 0:
        ap.error(f"--rounds must be at least 1 and --warmup at least 0, got {args.rounds} and {args.warmup}")
    out_root = Path(args.out).resolve()
    print(compare(command, args.baseline, args.rounds, set(args.ignore), out_root, warmup=args.warmup).report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
