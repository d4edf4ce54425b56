"""Shared by the simulator's tests: a policy that exercises swapping both ways."""
from framework.scheduler import POLICIES
from policies.fcfs import FCFSPolicy


@POLICIES.register("test_fcfs_swap_in")
class SwapInFCFS(FCFSPolicy):
    """FCFS that first brings swapped requests back (plain FCFS never swaps in). With nothing
    waiting or swapped it is FCFS, so it keeps FCFS's steady-decode promise."""

    steady_decode = True

    def schedule(self, scheduler, step):
        for req in list(scheduler.swapped):
            if not scheduler.swap_in(step, req):
                break
        super().schedule(scheduler, step)
