"""Signals held back while a run is between consistent points act when the hold ends, whatever ends it."""
import os
import signal
import subprocess
import sys
import threading

import pytest

from framework.harness.interrupts import Hold, interrupts_held


def test_a_held_ctrl_c_acts_when_released():
    with Hold() as hold:
        hold.held = True
        os.kill(os.getpid(), signal.SIGINT)
        assert True  # still here: held
        with pytest.raises(KeyboardInterrupt):
            hold.release()


def test_a_ctrl_c_held_when_an_error_leaves_the_hold_acts_then():
    # Dropped with the handlers' restore, the interrupt was lost: the run was recorded as failed and went on.
    with pytest.raises(KeyboardInterrupt) as raised:
        with Hold() as hold:
            hold.held = True
            os.kill(os.getpid(), signal.SIGINT)
            raise RuntimeError("a callback's bug")
    assert isinstance(raised.value.__context__, RuntimeError)


def test_interrupts_held_acts_after_the_block_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the block ran to its end")
    assert done and signal.getsignal(signal.SIGINT) is before


def test_of_two_held_signals_the_first_acts_when_released():
    acted = []
    previous = {s: signal.signal(s, lambda signum, frame: acted.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Hold() as hold:
            hold.held = True
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            hold.release()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert acted == [signal.SIGTERM]


def test_a_hold_off_the_main_thread_holds_nothing_and_lets_the_block_run():
    outcome = []

    def job():
        try:
            with interrupts_held():
                outcome.append("ran")
        except Exception as exc:
            outcome.append(repr(exc))

    thread = threading.Thread(target=job)
    thread.start()
    thread.join()
    assert outcome == ["ran"]


def test_a_sigterm_not_held_takes_its_default_action_under_a_hold():
    code = ("import os, signal\n"
            "from framework.harness.interrupts import Hold\n"
            "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
            "with Hold():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('still running')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM and done.stdout == "" and done.stderr == ""
