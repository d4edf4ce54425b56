import csv
import io

import pytest

from framework import EngineConfig, LLMEngine, SamplingParams
from framework.step_log import COLUMNS, StepLog


def test_rows_match_step_stats_and_round_trip_through_csv():
    engine = LLMEngine(EngineConfig(model="llama-3-8b", executor="sim"))
    log, stats = StepLog(), []
    engine.step_callbacks += [log, lambda s, out: stats.append(s)]
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert [tuple(getattr(s, c) for c in COLUMNS) for s in stats] == list(log.rows())
    f = io.StringIO()
    log.write_csv(f, {"replica": 3})
    rows = list(csv.DictReader(io.StringIO(f.getvalue())))
    assert len(rows) == len(stats) == 4 and rows[0]["replica"] == "3"
    assert [float(r["start_time"]) for r in rows] == pytest.approx([s.start_time for s in stats], rel=1e-11)
    assert [int(r["num_prefill_tokens"]) for r in rows] == [37, 0, 0, 0] and rows[-1]["num_finished"] == "1"
