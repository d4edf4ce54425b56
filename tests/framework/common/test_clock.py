import time

import pytest

from framework.common.clock import CPUClock, VirtualClock, WallClock


def test_cpu_clock_counts_this_process_and_jumps_over_waits():
    clock = CPUClock()
    t0 = clock.now()
    time.sleep(0.05)  # sleeping costs no CPU time
    assert clock.now() - t0 < 0.02
    clock.wait_until(t0 + 10.0)  # waiting jumps instead of sleeping
    assert 10.0 <= clock.now() - t0 < 10.5
    start = clock.now()
    x = 0
    while clock.now() - start < 0.01:  # busy work does count
        x += 1
    assert clock.now() >= start + 0.01


def test_virtual_clock_moves_only_when_told():
    clock = VirtualClock()
    clock.advance(1.5)
    clock.wait_until(1.0)
    assert clock.now() == 1.5
    clock.wait_until(4.0)
    assert clock.now() == 4.0


def test_wall_clock_counts_from_its_start():
    assert 0 <= WallClock().now() < 1.0


def test_virtual_clock_takes_steps_of_no_time_but_never_goes_back():
    clock = VirtualClock(2.0)
    clock.advance(0.0)
    assert clock.now() == 2.0
    with pytest.raises(ValueError):
        clock.advance(-0.5)
    assert clock.now() == 2.0


def test_cpu_clock_waits_add_up_and_a_past_time_leaves_it_where_it_is():
    clock = CPUClock()
    clock.wait_until(5.0)
    clock.wait_until(10.0)
    assert 10.0 <= clock.now() < 10.5
    before = clock.now()
    clock.wait_until(1.0)
    assert clock.now() >= before
