"""experiments/compare_policies.py: bad arguments are usage errors, before anything is served."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "compare_policies", Path(__file__).resolve().parents[2] / "experiments" / "compare_policies.py")
compare_policies = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_policies)


@pytest.mark.parametrize("argv, match", [
    # --chats 0 and --long 0 used to fail after serving, in np.percentile of no latencies;
    # --rate 0 in random.expovariate (ZeroDivisionError).
    (["--chats", "0"], "--chats must be at least 1, got 0"),
    (["--long", "0"], "--long must be at least 1, got 0"),
    (["--blocks", "-3"], "--blocks must be at least 1"),
    (["--budget", "0"], "--budget must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--rate", "0"], "--rate must be a positive number"),
    (["--rate", "inf"], "--rate must be a positive number"),
    (["--rate", "nan"], "--rate must be a positive number"),
    # A traceback naming num_gpu_blocks_override, which the script has no option for.
    (["--blocks", "20"], "--blocks must hold one request of 896 tokens: at least 57 blocks of 16, got 20"),
    (["--budget", "8"], "--budget must be at least 32 tokens, one per running request, got 8"),
])
def test_bad_arguments_are_usage_errors(argv, match, capsys, monkeypatch):
    monkeypatch.setattr(compare_policies, "run", lambda *a, **k: pytest.fail("served despite a bad argument"))
    with pytest.raises(SystemExit) as exit_info:
        compare_policies.main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err
