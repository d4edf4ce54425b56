"""The interleaved A/B timer: it runs a committed baseline and the working tree in turn, each
importing its own code, and sorts what they wrote into identical, different and one-sided."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "ab_compare", Path(__file__).resolve().parents[2] / "experiments" / "ab_compare.py")
ab_compare = importlib.util.module_from_spec(spec)
sys.modules["ab_compare"] = ab_compare  # its dataclass looks its module up while being defined
spec.loader.exec_module(ab_compare)

# Writes what its tree's framework says, a file both trees write alike, and a file only the
# working tree's version writes.
SCRIPT = r"""
import pathlib, sys, framework
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
(out / "value.txt").write_text(framework.VALUE)
(out / "same.txt").write_text("same")
with open(out / "runs.txt", "a") as f:
    f.write("run\n")
(out / "summary.json").write_text(str(id(out)))
if framework.VALUE == "new":
    (out / "extra.txt").write_text("only here")
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "framework").mkdir(parents=True)
    (root / "framework" / "__init__.py").write_text('VALUE = "old"\n')
    (root / "work.py").write_text(SCRIPT)
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "baseline")
    (root / "framework" / "__init__.py").write_text('VALUE = "new"\n')  # uncommitted: the current side
    return root


def test_each_side_runs_its_own_code_and_outputs_are_compared(repo: Path, tmp_path: Path):
    lines = []
    result = ab_compare.compare([sys.executable, "work.py", "{out}"], "HEAD", 2, {"summary.json"},
                                tmp_path / "out", root=repo, echo=lines.append)
    assert len(result.seconds["baseline"]) == len(result.seconds["current"]) == 2
    assert all(s > 0 for side in result.seconds.values() for s in side)
    assert len(result.ratios) == 2
    # The baseline side imported the committed framework, the current side the edited one.
    assert (tmp_path / "out" / "baseline" / "value.txt").read_text() == "old"
    assert (tmp_path / "out" / "current" / "value.txt").read_text() == "new"
    # One untimed round first, then the two timed ones, all into the same folder.
    assert (tmp_path / "out" / "current" / "runs.txt").read_text() == "run\n" * 3
    assert result.identical == ["runs.txt", "same.txt"]
    assert result.different == ["value.txt"]
    assert result.only_one_side == ["extra.txt"]
    assert [line.split(":")[0] for line in lines[1:]] == ["round 1", "round 2"]
    report = result.report()
    assert "files that differ: value.txt" in report and "written by one side only: extra.txt" in report
    # The temporary worktree is gone: only the repository itself is listed.
    assert len(git(repo, "worktree", "list").splitlines()) == 1


def test_an_earlier_comparisons_files_are_not_compared(repo: Path, tmp_path: Path):
    stale = tmp_path / "out" / "current" / "stale.txt"
    stale.parent.mkdir(parents=True)
    stale.write_text("from before")
    result = ab_compare.compare([sys.executable, "work.py", "{out}"], "HEAD", 1, {"summary.json"},
                                tmp_path / "out", root=repo, echo=lambda _: None)
    assert "stale.txt" not in result.only_one_side and not stale.exists()


def test_unknown_baseline_is_named(repo: Path, tmp_path: Path):
    with pytest.raises(SystemExit, match="'no-such-branch' is not a commit"):
        ab_compare.compare([sys.executable, "work.py", "{out}"], "no-such-branch", 1, set(), tmp_path / "out",
                           root=repo, echo=lambda _: None)


def test_a_failing_command_stops_with_its_output_and_removes_the_worktree(repo: Path, tmp_path: Path):
    with pytest.raises(SystemExit, match="(?s)failed in .*exit 3.*boom"):
        ab_compare.compare([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], "HEAD", 1, set(),
                           tmp_path / "out", root=repo, echo=lambda _: None)
    assert len(git(repo, "worktree", "list").splitlines()) == 1


def test_command_is_required():
    with pytest.raises(SystemExit):
        ab_compare.main(["--baseline", "HEAD"])
