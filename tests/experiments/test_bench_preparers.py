"""The preparer benchmark's turns: every preparer gets exactly ``repeats`` timed steps."""
from unittest import mock

import pytest

import experiments.bench_preparers as bench


@pytest.mark.parametrize("repeats,turn", [(5, 1), (5, 2), (6, 3), (4, 10)])
def test_measure_takes_turns_of_the_given_length(repeats, turn):
    order = []

    def fake_time_step(prep, steps):
        order.append(prep)
        return 1e-3

    steps = bench.make_steps(8)
    with mock.patch.object(bench, "time_step", fake_time_step):
        samples = bench.measure(steps, repeats, turn=turn)
    assert {k: len(v) for k, v in samples.items()} == {"v0": repeats, "v1": repeats}
    timed = order[2:]  # after one warm-up step each
    runs = [timed[0]]
    lengths = [1]
    for prep in timed[1:]:
        if prep is runs[-1]:
            lengths[-1] += 1
        else:
            runs.append(prep)
            lengths.append(1)
    assert all(n == min(turn, repeats) for n in lengths[:-2])  # the last turn of each may be short
    assert len(set(map(id, runs))) == 2


@pytest.mark.parametrize("argv, match", [(["--repeats", "0"], "--repeats must be at least 1, got 0"),
                                         (["--turn", "0"], "--turn must be at least 1, got 0"),
                                         (["--turn", "-2"], "--turn must be at least 1")])
def test_bad_arguments_are_usage_errors(argv, match, capsys):
    with mock.patch.object(bench, "make_steps", side_effect=AssertionError("measured despite a bad argument")), \
            pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err
