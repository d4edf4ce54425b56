"""The code in docs/writing-a-policy.md runs as written, and its policies keep the invariants."""
import random
import re
from pathlib import Path

from framework import POLICIES, SamplingParams
from framework.testing import Arrival
from framework.testing.properties import run_workload
from framework.testing.registries import forget_registrations

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-policy.md"


def fixed_workload(n=16, seed=0):
    rng = random.Random(seed)
    return [Arrival(str(i), rng.randrange(10), [rng.randrange(3, 40) for _ in range(rng.randrange(1, 60))],
                    SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True), rng.randrange(3))
            for i in range(n)]


def test_the_walkthrough_code_runs(monkeypatch, tmp_path):
    forget_registrations(monkeypatch, POLICIES)  # its registrations stay here
    monkeypatch.chdir(tmp_path)  # the notebook's run writes into runs/
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 8
    namespace = {}
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), namespace)  # defines, registers, generates
    assert len(namespace["outs"][0].outputs[0].token_ids) == 8
    summary = namespace["summary"]
    assert (summary["policy"], summary["completed"]) == ("srpt", 8) and (tmp_path / "runs/srpt/steps.csv").exists()
    namespace["test_srpt_keeps_every_invariant"]()  # the property test the doc proposes
    setup = dict(num_blocks=20, num_cpu_blocks=6, max_num_seqs=4, max_num_batched_tokens=16, threshold=0,
                 prefix_caching=True)
    for name in ("SwapOnlyLong", "OneAdmissionPerStep"):
        POLICIES.register(name.lower())(namespace[name])
        run = run_workload(name.lower(), setup, fixed_workload())
        assert run.engine.scheduler.num_preemptions > 0
    admissions = [len(out.new_requests) for out in run.steps]
    assert max(admissions) == 1 and sum(admissions) == 16
