"""forget_registrations leaves every registry as it found it, in a process that has loaded none of its parts yet."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import pytest
    from framework import EXECUTORS, POLICIES
    from framework.testing.registries import forget_registrations

    patch = pytest.MonkeyPatch()
    forget_registrations(patch, POLICIES, EXECUTORS)
    from policies.fcfs import FCFSPolicy  # the built-ins' first import, and the sim executor's, inside the test
    EXECUTORS.get("sim")
    POLICIES.register("mine")(type("Mine", (FCFSPolicy,), {}))
    assert "mine" in POLICIES.list()
    patch.undo()
    assert "mine" not in POLICIES.list()
    print(POLICIES.get("chunked").__name__, EXECUTORS.get("model").__name__, EXECUTORS.get("sim").__name__)
""")


def test_the_built_in_and_lazy_parts_outlive_the_test():
    # Copying a registry whose built-ins were not loaded yet emptied it for the rest of the process: a test file that
    # did so made a later file's policies unknown ("registered policies: (none)").
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ChunkedPolicy", "ModelExecutor", "SimExecutor"]
