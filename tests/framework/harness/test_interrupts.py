"""Signals held back while a run is between consistent points act when the hold ends, whatever ends it."""
import os
import signal

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
