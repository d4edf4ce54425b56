"""Per-step records of a run, column by column: one row per engine step, ``StepStats`` fields.

Attach with ``engine.step_callbacks.append(log)``. It also takes whole decode runs
(``on_decode_run``), so it does not stop a simulated engine from fast-forwarding; the rows of a
run are exactly the ones stepping one by one would have recorded.
"""
from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import fields
from itertools import islice, repeat
from typing import TextIO

from framework.engine import StepStats
from framework.fast_forward import DecodeRun
from framework.scheduler import SchedulerOutput

COLUMNS = [f.name for f in fields(StepStats)]
_FLOATS = {"start_time", "duration", "kv_usage"}


class StepLog:
    def __init__(self) -> None:
        self.columns: dict[str, array] = {name: array("d" if name in _FLOATS else "q") for name in COLUMNS}

    def __len__(self) -> int:
        return len(self.columns["step"])

    def __call__(self, stats: StepStats, out: SchedulerOutput) -> None:
        for name, column in self.columns.items():
            column.append(getattr(stats, name))

    def on_decode_run(self, run: DecodeRun) -> None:
        num, m, c = len(run.end_times), run.num_seqs, self.columns
        starts = [run.start_time] + run.end_times[:-1]
        c["step"].extend(range(run.first_step, run.first_step + num))
        c["start_time"].extend(starts)
        c["duration"].extend([end - start for start, end in zip(starts, run.end_times)])
        for name in ("num_scheduled_reqs", "num_scheduled_tokens", "num_decode_tokens", "num_running"):
            c[name].extend(repeat(m, num))
        c["num_running"][-1] = m - len(run.finished)
        for name in ("num_prefill_tokens", "num_waiting", "num_swapped", "num_preempted",
                     "num_swapped_out_blocks", "num_swapped_in_blocks", "num_finished"):
            c[name].extend(repeat(0, num))
        c["num_finished"][-num] += run.num_finished_first
        c["num_finished"][-1] += run.num_finished_last
        c["kv_blocks_used"].extend(run.kv_blocks_used)
        c["kv_usage"].extend([u / run.num_usable_blocks for u in run.kv_blocks_used])

    def rows(self) -> Iterator[tuple]:
        return zip(*self.columns.values())

    def write_csv(self, f: TextIO, extra: dict[str, object] | None = None, header: bool = True) -> None:
        """Write the rows to the open text file ``f``; ``extra`` adds constant leading columns
        (e.g. ``{"replica": 0}``). Rows are formatted in one pass per row (a simulated run can
        have a million steps): integers as such, floats with 17 significant digits (exact)."""
        extra = extra or {}
        if header:
            f.write(",".join([*extra, *self.columns]) + "\n")
        prefix = "".join(f"{value}," for value in extra.values()).replace("%", "%%")
        fmt = prefix + ",".join("%.17g" if c.typecode == "d" else "%d" for c in self.columns.values()) + "\n"
        rows = self.rows()
        while chunk := [fmt % row for row in islice(rows, 1 << 16)]:
            f.write("".join(chunk))
