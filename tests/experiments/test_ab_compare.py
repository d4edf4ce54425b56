"""The interleaved A/B timer: it runs a committed baseline and the working tree in turn, each
importing its own code, and sorts what they wrote into identical, different and one-sided."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "ab_compare", Path(__file__).resolve().parents[2] / "experiments" / "ab_compare.py")
ab_compare = importlib.util.module_from_spec(spec)
sys.modules["ab_compare"] = ab_compare  # its dataclass looks its module up while being defined
spec.loader.exec_module(ab_compare)

# In experiments/, like the real benchmarks: its tree is on the path only through PYTHONPATH.
# Writes what its tree's framework says, files both trees write alike (a summary with a wall
# time), and a file only the working tree's version writes.
SCRIPT = r"""
import json, pathlib, sys, time, framework
out = pathlib.Path(sys.argv[1])
(out / "value.txt").write_text(framework.VALUE)
(out / "same.txt").write_text("same")
(out / "summary.json").write_text(json.dumps({"completed": 3, "wall_time_s": time.perf_counter()}))
with open(out / "runs.txt", "a") as f:
    f.write("run\n")
if framework.VALUE == "new":
    (out / "extra.txt").write_text("only here")
print("value", framework.VALUE)
"""
COMMAND = [sys.executable, "experiments/work.py", "{out}"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false",
                           "-c", "core.hooksPath=/dev/null", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "framework").mkdir(parents=True)
    (root / "experiments").mkdir()
    (root / "framework" / "__init__.py").write_text('VALUE = "old"\n')
    (root / "experiments" / "work.py").write_text(SCRIPT)
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "baseline")
    (root / "framework" / "__init__.py").write_text('VALUE = "new"\n')  # uncommitted: the current side
    return root


def worktrees(repo: Path) -> int:
    return len(git(repo, "worktree", "list").splitlines())


def test_each_side_runs_its_own_code_and_outputs_are_compared(repo: Path, tmp_path: Path):
    lines = []
    out = tmp_path / "out"
    result = ab_compare.compare(COMMAND, "HEAD", 2, {"hydra.yaml"}, out, root=repo, echo=lines.append)
    b, c = result.seconds["baseline"], result.seconds["current"]
    assert len(b) == len(c) == 2 and min(b + c) > 0
    assert result.ratios == [c[0] / b[0], c[1] / b[1]]
    # The baseline side imported the committed framework, the current side the edited one.
    assert (out / "baseline" / "value.txt").read_text() == "old"
    assert (out / "current" / "value.txt").read_text() == "new"
    assert (out / "baseline.log").read_text() == "value old\n"
    # One untimed round first, then the two timed ones, all into the same folder.
    assert (out / "current" / "runs.txt").read_text() == "run\n" * 3
    # summary.json differs in its wall time only, which is left out.
    assert json.loads((out / "baseline" / "summary.json").read_text()) != \
        json.loads((out / "current" / "summary.json").read_text())
    assert result.identical == ["runs.txt", "same.txt", "summary.json"]
    assert result.different == ["value.txt"]
    assert result.only_one_side == ["extra.txt"]
    # The order alternates: baseline first in odd rounds, current first in even ones.
    assert [line.split(":")[0] for line in lines[1:]] == ["round 1 (baseline first)", "round 2 (current first)"]
    report = result.report()
    assert f"faster in {sum(r < 1 for r in result.ratios)} of 2" in report
    assert "files that differ: value.txt" in report and "written by one side only: extra.txt" in report
    assert worktrees(repo) == 1  # the temporary worktree is gone


def test_a_tree_that_would_import_another_copy_is_refused(repo: Path, tmp_path: Path, monkeypatch):
    # Without its tree on PYTHONPATH, a side finds framework elsewhere (the installed project)
    # or not at all: either way the comparison must not start.
    monkeypatch.setattr(ab_compare, "side_env", lambda tree: {k: v for k, v in __import__("os").environ.items()
                                                              if k != "PYTHONPATH"})
    with pytest.raises(SystemExit, match="imports framework from|cannot find framework"):
        ab_compare.compare(COMMAND, "HEAD", 1, set(), tmp_path / "out", root=repo, echo=lambda _: None)
    assert worktrees(repo) == 1


def test_an_earlier_comparisons_files_are_not_compared(repo: Path, tmp_path: Path):
    stale = tmp_path / "out" / "current" / "stale.txt"
    stale.parent.mkdir(parents=True)
    stale.write_text("from before")
    result = ab_compare.compare(COMMAND, "HEAD", 1, set(), tmp_path / "out", root=repo, echo=lambda _: None)
    assert "stale.txt" not in result.only_one_side and not stale.exists()


def test_a_command_without_out_says_nothing_was_compared(repo: Path, tmp_path: Path):
    result = ab_compare.compare([sys.executable, "-c", "pass"], "HEAD", 1, set(), tmp_path / "out", root=repo,
                                echo=lambda _: None)
    assert not result.compared and "outputs not compared: the command has no {out}" in result.report()


def test_unknown_baseline_is_named(repo: Path, tmp_path: Path):
    with pytest.raises(SystemExit, match="'no-such-branch' is not a commit"):
        ab_compare.compare(COMMAND, "no-such-branch", 1, set(), tmp_path / "out", root=repo, echo=lambda _: None)


def test_a_failing_command_stops_with_its_output_and_removes_the_worktree(repo: Path, tmp_path: Path):
    with pytest.raises(SystemExit, match="(?s)failed in .*exit 3.*boom"):
        ab_compare.compare([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], "HEAD", 1, set(),
                           tmp_path / "out", root=repo, echo=lambda _: None)
    assert worktrees(repo) == 1


def test_ctrl_c_removes_the_worktree(repo: Path, tmp_path: Path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ab_compare, "run_once", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ab_compare.compare(COMMAND, "HEAD", 1, set(), tmp_path / "out", root=repo, echo=lambda _: None)
    assert worktrees(repo) == 1


def test_command_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ab_compare.main(["--baseline", "HEAD"])
    assert exit_info.value.code == 2
    assert "give the command to time after --" in capsys.readouterr().err


def test_files_naming_their_own_output_folder_compare_equal(repo: Path, tmp_path: Path):
    # A sweep's comparison.md/.csv list each run's folder, and Hydra's multirun.yaml holds the
    # tree's path: an A/A run of `framework.run -m ... hydra.sweep.dir={out}` reported all three
    # as differing although both sides wrote the same.
    script = ("import pathlib, sys\nout = pathlib.Path(sys.argv[1])\n"
              "(out / 'comparison.csv').write_text(f'rate,run_dir\\n4,{out / \"0\"}\\n')\n"
              "(out / 'multirun.yaml').write_text(f'cwd: {pathlib.Path.cwd()}\\n')\n"
              "(out / 'value.txt').write_text(f'{out}: ' + __import__('framework').VALUE)\n")
    result = ab_compare.compare([sys.executable, "-c", script, "{out}"], "HEAD", 1, set(ab_compare.IGNORED),
                                tmp_path / "out", root=repo, echo=lambda _: None)
    assert result.identical == ["comparison.csv"]
    assert result.different == ["value.txt"]  # what differs besides the path still does
    assert "multirun.yaml" not in result.identical + result.different + result.only_one_side


def test_a_command_that_cannot_start_is_a_one_line_error(repo: Path, tmp_path: Path):
    # A mistyped program name used to end in a FileNotFoundError traceback from subprocess.
    with pytest.raises(SystemExit, match="cannot run 'no-such-program-xyz' in .*: No such file or directory"):
        ab_compare.compare(["no-such-program-xyz", "{out}"], "HEAD", 1, set(), tmp_path / "out", root=repo,
                           echo=lambda _: None)
    assert worktrees(repo) == 1
