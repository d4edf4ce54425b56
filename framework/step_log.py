"""Per-step records of a run, column by column: one row per engine step, ``StepStats`` fields.

Attach with ``engine.step_callbacks.append(log)``. It also takes whole decode runs
(``on_decode_run``), so it does not stop a simulated engine from fast-forwarding; the rows of a
run are exactly the ones stepping one by one would have recorded.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields
from itertools import islice, repeat
from operator import attrgetter
from typing import TextIO

from framework.engine import StepStats
from framework.fast_forward import DecodeRun
from framework.scheduler import SchedulerOutput

COLUMNS = [f.name for f in fields(StepStats)]
_FLOATS = {"start_time", "duration", "kv_usage"}
_values = attrgetter(*COLUMNS)


class StepLog:
    def __init__(self) -> None:
        # Plain lists: appending and writing then move existing objects (step times are the very
        # floats the requests' token times hold) instead of converting every value.
        self.columns: dict[str, list] = {name: [] for name in COLUMNS}

    def __len__(self) -> int:
        return len(self.columns["step"])

    def __call__(self, stats: StepStats, out: SchedulerOutput) -> None:
        for column, value in zip(self.columns.values(), _values(stats)):
            column.append(value)

    def on_decode_run(self, run: DecodeRun) -> None:
        num, c = len(run.end_times), self.columns
        starts = [run.start_time] + run.end_times[:-1]
        c["step"].extend(range(run.first_step, run.first_step + num))
        c["start_time"].extend(starts)
        c["duration"].extend([end - start for start, end in zip(starts, run.end_times)])
        for name in ("num_scheduled_reqs", "num_scheduled_tokens", "num_decode_tokens"):
            c[name].extend(run.batch_sizes)
        finished = [0] * num
        running = list(run.batch_sizes)
        for step, group in run.finished:
            running[step - 1] -= len(group)
        for step, count in run.outputs_finished.items():
            finished[step - 1] = count
        c["num_running"].extend(running)
        c["num_finished"].extend(finished)
        for name in ("num_prefill_tokens", "num_waiting", "num_swapped", "num_preempted",
                     "num_swapped_out_blocks", "num_swapped_in_blocks"):
            c[name].extend(repeat(0, num))
        c["kv_blocks_used"].extend(run.kv_blocks_used)
        c["kv_usage"].extend([u / run.num_usable_blocks for u in run.kv_blocks_used])

    def rows(self) -> Iterator[tuple]:
        return zip(*self.columns.values())

    def write_csv(self, f: TextIO, extra: dict[str, object] | None = None, header: bool = True) -> None:
        """Write the rows to the open text file ``f``; ``extra`` adds constant leading columns
        (e.g. ``{"replica": 0}``). Rows are formatted in one pass per row (a simulated run can
        have a million steps): integers as such, floats with 12 significant digits."""
        extra = extra or {}
        if header:
            f.write(",".join([*extra, *self.columns]) + "\n")
        prefix = "".join(f"{value}," for value in extra.values()).replace("%", "%%")
        fmt = prefix + ",".join("%.12g" if name in _FLOATS else "%d" for name in self.columns) + "\n"
        rows = self.rows()
        while chunk := [fmt % row for row in islice(rows, 1 << 16)]:
            f.write("".join(chunk))
