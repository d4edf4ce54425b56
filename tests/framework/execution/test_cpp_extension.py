"""Where a C++ extension is built and cached: one folder per checkout, and no wait on a killed build's lock."""
from pathlib import Path
from types import ModuleType

import pytest
import torch.utils.cpp_extension

from framework.execution.cpp_extension import load_cpu_extension


@pytest.fixture
def loads(tmp_path, monkeypatch):
    """torch's ``load`` replaced by one that records (name, whether torch's lock file was there) and builds nothing."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    calls = []

    def load(name, sources, **kwargs):
        build_dir = Path(torch.utils.cpp_extension._get_build_directory(name, verbose=False))
        calls.append((name, (build_dir / "lock").exists()))
        return ModuleType(name)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    return calls


def source_in(folder: Path) -> Path:
    folder.mkdir()
    (folder / "kernel.cpp").write_text("int answer() { return 42; }\n")
    return folder / "kernel.cpp"


def test_two_checkouts_of_the_same_source_are_cached_apart(tmp_path, loads):
    # One folder for both would be rebuilt whenever they alternate (ninja rebuilds for a source at another
    # path): an A/A comparison of two checkouts timed their builds.
    build = load_cpu_extension.__wrapped__
    build("k", source_in(tmp_path / "a"), "a kernel")
    build("k", source_in(tmp_path / "b"), "a kernel")
    build("k", tmp_path / "a" / "kernel.cpp", "a kernel")
    (a, _), (b, _), (a_again, _) = loads
    assert a != b and a == a_again


def test_a_lock_left_by_a_killed_build_is_not_waited_on(tmp_path, loads):
    # torch waits for its lock file to go, for good when the build that made it was killed.
    build = load_cpu_extension.__wrapped__
    source = source_in(tmp_path / "a")
    build("k", source, "a kernel")
    name = loads[0][0]
    (Path(torch.utils.cpp_extension._get_build_directory(name, verbose=False)) / "lock").write_text("")
    build("k", source, "a kernel")
    assert loads[1] == (name, False)


def test_a_killed_builds_compilers_still_running_are_waited_for(tmp_path, loads, monkeypatch):
    # A build's process killed alone leaves its compilers writing into the folder: a second build there would
    # race them for the same object files.
    import shutil
    import subprocess

    from framework.execution import cpp_extension

    build = load_cpu_extension.__wrapped__
    source = source_in(tmp_path / "a")
    build("k", source, "a kernel")
    folder = Path(torch.utils.cpp_extension._get_build_directory(loads[0][0], verbose=False))
    (folder / "lock").write_text("")
    # A program named as the compiler is: a shell left in the folder is no build, and is not waited for.
    compiler = tmp_path / "cc1plus"
    compiler.symlink_to(shutil.which("sleep"))
    bystander = subprocess.Popen(["sleep", "60"], cwd=folder)
    orphan = subprocess.Popen([str(compiler), "60"], cwd=folder)
    waits = []

    def sleep(seconds):  # the orphan's build ends while the load waits
        waits.append(seconds)
        orphan.kill()
        orphan.wait()

    monkeypatch.setattr(cpp_extension.time, "sleep", sleep)
    try:
        build("k", source, "a kernel")
    finally:
        for process in (orphan, bystander):
            process.kill()
            process.wait()
    assert len(waits) == 1 and loads[1] == (loads[0][0], False)
