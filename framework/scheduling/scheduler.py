"""The ``Scheduler``: queues, budgets, allocation, preemption and swap, driven by a ``SchedulerPolicy``.

Each step the policy fills a ``Step`` through the scheduler's operations; the scheduler then
hands the runner a plain ``SchedulerOutput`` and, after the forward pass, folds the sampled
tokens back into the requests.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from framework.common.request import Request, RequestStatus
from framework.kv.block_allocator import BlockAllocator, PrefixHit
from framework.scheduling.invariants import check_books, check_invariants
from framework.scheduling.output import SchedulerOutput, Step
from framework.scheduling.policy import RECOMPUTE, SWAP, SchedulerPolicy

if TYPE_CHECKING:
    from framework.common.clock import Clock
    from framework.common.config import EngineConfig


class Scheduler:
    """Queues (waiting, running, swapped), the token and sequence budgets, and the operations a
    policy composes. Not thread-safe: the engine calls it from one thread."""

    def __init__(self, config: EngineConfig, policy: SchedulerPolicy, allocator: BlockAllocator,
                 clock: Clock) -> None:
        self.config = config
        self.policy = policy
        self.allocator = allocator
        self.clock = clock
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len: int = config.max_model_len or 0
        self.block_size = config.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._num_received = 0  # requests received so far: the last one's arrival_order
        self._dropped_rows: set[str] = set()
        self._finished_outside_step: list[Request] = []
        self._forked: list[Request] = []
        self._forks_waiting: list[Request] = []  # forked in this step to wait, the policy not told yet
        self._rebuilt: list[Request] = []  # rows to rebuild after a step the executor failed on
        # Async scheduling: requests whose token in flight is their last (length), off the running queue
        # but holding their blocks and their seat until update_from_output gives it.
        self._finishing: list[Request] = []
        self._num_entered = 0  # entries to the running queue so far: the last one's run_order
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_steps = 0

    # -- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        reason = self._never_fits(request)
        if reason is not None:
            request.status = RequestStatus.FINISHED_IGNORED
            request.status_message = reason
            request.finished_time = self._ignored_time(request)
            self._finished_outside_step.append(request)
            return
        self._receive(request)
        self.waiting.append(request)
        self.policy.on_waiting(request)

    def _receive(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._num_received += 1
        request.arrival_order = self._num_received

    def _never_fits(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        if self.max_model_len and n >= self.max_model_len:  # one of max_model_len: refused by vLLM 0.32 too
            how = "is longer than" if n > self.max_model_len else "leaves no room for an output token within"
            return f"prompt of {n} tokens {how} max_model_len={self.max_model_len}"
        if self.allocator.blocks_needed(n) > self.allocator.num_usable_blocks:
            return (f"prompt of {n} tokens needs {self.allocator.blocks_needed(n)} KV blocks but the "
                    f"cache has {self.allocator.num_usable_blocks}")
        if not self.policy.chunks_prefills and n > self.max_num_batched_tokens:
            return (f"prompt of {n} tokens exceeds max_num_batched_tokens={self.max_num_batched_tokens} "
                    f"and policy {self.policy.name!r} does not chunk prefills")
        return None

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._leave_queue(request)
        self.allocator.free(request)
        request.drop_placeholder()  # its output ends at the tokens known
        request.status = RequestStatus.FINISHED_ABORTED
        request.finished_time = self.clock.now()
        self._dropped_rows.add(request_id)
        self._finished_outside_step.append(request)
        if self.config.check_invariants:  # a run's last abort has no schedule() after it to check its freed blocks
            check_books(self)
        return request

    def take_finished_outside_step(self) -> list[Request]:
        """Requests finished outside a step's progress since the last call: ignored (by ``add_request``,
        or by a policy through ``ignore``) or aborted (``abort_request``)."""
        done, self._finished_outside_step = self._finished_outside_step, []
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _enter_running(self, request: Request) -> None:
        self.running.append(request)
        self._num_entered += 1
        request.run_order = self._num_entered

    def preemptable(self, step: Step, requester: Request | None = None) -> list[Request]:
        """The requests ``step`` may preempt for ``requester`` (never itself), oldest entry to the running queue
        first: running ones not scheduled or swapped in this step and, with async scheduling, those whose last
        token is in flight (the token still finishes them). vLLM keeps these in its running queue, whose newest it
        preempts first, the requester included: one that entered before a running requester comes after it."""
        pool = self.running
        if self._finishing:
            running = requester is not None and requester.status == RequestStatus.RUNNING
            after = requester.run_order if running else 0
            finishing = [r for r in self._finishing if r.run_order > after]
            if finishing:
                pool = sorted(self.running + finishing, key=lambda r: r.run_order)
        return [r for r in pool if r is not requester and not step.is_scheduled(r) and not step.was_swapped_in(r)]

    @property
    def seats_taken(self) -> int:
        """Requests holding one of the ``max_num_seqs`` seats: those running, and (async scheduling) those whose
        token in flight is their last, off ``running`` until it is known, as vLLM counts them."""
        return len(self.running) + len(self._finishing)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._tell_forks_waiting()  # forked without an update_from_output since (it tells them)
        step = Step(self.max_num_batched_tokens, self.block_size)
        self.policy.schedule(self, step)
        out = step.out
        out.blocks_to_copy.extend(self.allocator.take_copies())
        # An output with nothing to run never reaches the runner (the engine skips it), so rows
        # to build for forks and rows to drop (say, of a request aborted or finished before an
        # idle step) wait for the next output that runs, or the runner's batch would miss them.
        runs = out.runs
        if self._forked and runs:
            self._announce_forks(out)
        if self._rebuilt and runs:
            self._announce_rebuilt(out)
        for req in out.preempted + out.swapped_out:
            self._dropped_rows.add(req.request_id)
        if runs:
            # A request preempted and re-admitted in the same step keeps its (rebuilt) row.
            out.finished_req_ids = self._dropped_rows - set(out.num_scheduled_tokens)
            self._dropped_rows = set()
        self.num_steps += 1
        if self.config.check_invariants:
            check_invariants(self, out)
        return out

    def step_failed(self, out: SchedulerOutput) -> None:
        """Recover from the executor failing on committed ``out`` (an exception, Ctrl-C): the blocks it was
        to fill leave the prefix cache; its scheduled and swapped-out requests, and any counting such a block
        as computed, wait to be recomputed; the next output that runs redoes its row drops and row builds."""
        bs = self.block_size
        written = [dst for _, dst in out.blocks_to_swap_in + out.blocks_to_copy] + out.blocks_to_fill
        unwritten = set(written)
        broken = out.scheduled + out.swapped_out + [
            r for r in self.running if unwritten.intersection(r.block_ids[:-(-r.num_computed_tokens // bs)])]
        self.allocator.uncache(written)
        self._dropped_rows |= out.finished_req_ids
        self._rebuilt.extend(out.new_requests + out.resumed_requests)
        # Each goes to the front of the waiting queue: the last one first, so that they wait in
        # the order they ran (oldest first), not reversed.
        for req in reversed(dict.fromkeys(broken)):
            self._recompute_after_failure(req)

    def _recompute_after_failure(self, request: Request) -> None:
        # Not counted as a preemption: the policy did not choose it.
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            return  # finished or aborted since: nothing of it is left to read
        self._wait_to_recompute(request)
        self._dropped_rows.add(request.request_id)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           now: float | None = None) -> list[Request]:
        """Advance every scheduled request by its tokens and append its sampled token (if it
        reached the end of its known tokens), timed ``now`` (default: the clock's now). Returns
        the requests that got a token."""
        self._tell_forks_waiting()
        now = self.clock.now() if now is None else now
        progressed: list[Request] = []
        any_finished = False
        for req in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue  # aborted since it was scheduled
            req.num_computed_tokens += out.num_scheduled_tokens[req.request_id]
            token = sampled.get(req.request_id)
            if token is None:
                if req.num_computed_tokens >= req.num_tokens:
                    raise RuntimeError(f"{req.request_id} finished its tokens but no token was sampled")
                continue
            if req.num_computed_tokens < req.num_tokens:
                raise RuntimeError(f"{req.request_id} got a sampled token mid-prompt "
                                   f"({req.num_computed_tokens} of {req.num_tokens} tokens computed)")
            req.append_output_token(token, now)
            progressed.append(req)
            status = req.check_stop()
            if status is not None:
                self._finish(req, status, now)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
            if self.config.check_invariants:  # as in abort_request: a run's last finishes have no schedule() after
                check_books(self)
        return progressed

    # -- async scheduling ------------------------------------------------------------------------
    def commit(self, out: SchedulerOutput) -> None:
        """Async scheduling: advance ``out``'s running requests as if its step had run, before its tokens are
        known, so the next ``schedule`` can run while it does: a request that samples gets a placeholder
        (``Request.append_placeholder``); one whose placeholder is its last token stops being scheduled."""
        capped = False
        for req in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue  # finished or aborted since it was scheduled
            req.num_computed_tokens += out.num_scheduled_tokens[req.request_id]
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prompt chunk: it samples nothing
            req.append_placeholder()
            if req.num_output_tokens >= req.max_tokens or (
                    req.max_model_len is not None and req.num_tokens >= req.max_model_len):
                # Whatever the token, it is the last: the request leaves the batch, keeping its blocks
                # (a failed step recomputes it) until update_from_output finishes it.
                self._finishing.append(req)
                self._dropped_rows.add(req.request_id)
                capped = True
        if capped:
            self.running = [r for r in self.running if r not in self._finishing]

    def uncommit(self, out: SchedulerOutput) -> None:
        """Undo ``commit(out)`` for a step that failed (then ``step_failed(out)``): its requests back at their
        state when it was scheduled."""
        for req in out.scheduled:
            if req.is_finished:
                continue
            req.drop_placeholder()
            if req.status != RequestStatus.RUNNING:
                continue  # taken off the device since (by a failed later step, say): its computed tokens are 0
            req.num_computed_tokens -= out.num_scheduled_tokens[req.request_id]
            if req in self._finishing:
                self._finishing.remove(req)
                self.running.append(req)
                self._dropped_rows.discard(req.request_id)

    def update_from_committed(self, out: SchedulerOutput, sampled: dict[str, int],
                              now: float | None = None) -> list[Request]:
        """Async scheduling's ``update_from_output``: the sampled tokens of committed ``out`` replace its
        requests' placeholders (wherever the requests are now: running, preempted, swapped or finishing),
        timed ``now``. Returns the requests that got a token."""
        now = self.clock.now() if now is None else now
        progressed: list[Request] = []
        any_finished = freed = False  # a running request finished; any request finished (its blocks freed)
        for req in out.scheduled:
            token = sampled.get(req.request_id)
            if token is None or not req.num_placeholders:
                continue  # a prompt chunk, or aborted since
            req.resolve_placeholder(token, now)
            progressed.append(req)
            status = req.check_stop()
            if status is None:
                continue
            any_finished |= self._leave_queue(req, leave_running=False)
            self._finish(req, status, now)
            freed = True
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        if freed and self.config.check_invariants:  # as in abort_request
            check_books(self)
        return progressed

    def _leave_queue(self, request: Request, leave_running: bool = True) -> bool:
        """Take ``request`` off its queue (waiting, finishing, running or swapped); with ``leave_running=False``
        a running one stays, for the caller to filter out with others. Whether it was running."""
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request in self._finishing:
            self._finishing.remove(request)
        elif request.status == RequestStatus.RUNNING:
            if leave_running:
                self.running.remove(request)
            return True
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        return False

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        request.status = status
        request.finished_time = now
        self.allocator.free(request)
        self.requests.pop(request.request_id, None)
        self._dropped_rows.add(request.request_id)

    # -- operations for policies -----------------------------------------------------------------
    def find_prefix(self, request: Request) -> PrefixHit:
        """Cached blocks the request could start from; an empty hit for a request with blocks or computed
        tokens, or that does not read the cache (``Request.reads_prefix_cache``)."""
        if (request.num_computed_tokens or request.block_ids or not request.reads_prefix_cache
                or request.num_placeholders):
            return PrefixHit()
        return self.allocator.find_prefix(request)

    def schedule_request(self, step: Step, request: Request, num_tokens: int,
                         prefix: PrefixHit | None = None) -> bool:
        """Schedule ``num_tokens`` of ``request`` (admitting it if waiting). False, with nothing
        changed, when the KV blocks or the sequence limit do not allow it."""
        prefix_tokens = prefix.num_tokens if prefix else 0
        self._check_num_tokens(step, request, num_tokens, prefix_tokens)
        waiting = request.status == RequestStatus.WAITING
        # A request preempted with a token in flight is prefilled once that token is known (next step).
        if waiting and (self.seats_taken >= self.max_num_seqs or request.num_placeholders):
            return False
        if not waiting and request.status != RequestStatus.RUNNING:
            raise ValueError(f"{request.request_id} is {request.status.name}; only waiting or running requests run")
        if not self.allocator.allocate_slots(request, num_tokens, prefix):
            return False
        if waiting:
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens += prefix_tokens
            self._enter_running(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock.now()
                request.num_cached_tokens = prefix_tokens
                step.out.new_requests.append(request)
            else:
                step.out.resumed_requests.append(request)
        step._add(request, num_tokens)
        return True

    @staticmethod
    def _check_num_tokens(step: Step, request: Request, num_tokens: int, prefix_tokens: int = 0) -> None:
        if step.is_scheduled(request):
            raise ValueError(f"{request.request_id} is already scheduled in this step")
        left = request.num_tokens - request.num_computed_tokens - prefix_tokens
        if not 0 < num_tokens <= min(left, step.token_budget):
            raise ValueError(
                f"{request.request_id}: cannot schedule {num_tokens} tokens ({left} left to compute, "
                f"{step.token_budget} left in the step budget)")

    def schedule_or_preempt(self, step: Step, request: Request, num_tokens: int,
                            prefix: PrefixHit | None = None) -> bool:
        """Schedule ``request`` (running, or waiting with an optional ``prefix``), preempting victims
        chosen by the policy while blocks or sequence slots are short. If no victim is left, a
        running ``request`` is itself preempted and False returned; a waiting one stays waiting."""
        if request.status == RequestStatus.WAITING and request.num_placeholders:
            # Preempted with a token in flight: it waits for that token, not for blocks or a seat.
            self._check_num_tokens(step, request, num_tokens, prefix.num_tokens if prefix else 0)
            return False
        while not self.schedule_request(step, request, num_tokens, prefix):
            victim = self.policy.select_victim(self.preemptable(step, request), request)
            if victim is None:
                if request.status == RequestStatus.RUNNING:
                    self.preempt(step, request)
                return False
            self.preempt(step, victim)
        return True

    def preempt(self, step: Step, request: Request, mode: str | None = None) -> str:
        """Take a running request off the device: swap its blocks out (if ``mode`` is swap and the
        swap space has room) or free them for recompute. Returns the mode used."""
        if step.is_scheduled(request):
            raise ValueError(f"{request.request_id} is scheduled in this step and cannot be preempted")
        if step.was_swapped_in(request):
            # Its swap-in copy is still pending: the blocks it would give back are not filled yet.
            raise ValueError(f"{request.request_id} was swapped in during this step and cannot be preempted")
        if request.status != RequestStatus.RUNNING:
            raise ValueError(f"{request.request_id} is {request.status.name}, not running")
        mode = mode or self.policy.preemption_mode_for(request)
        if mode not in (RECOMPUTE, SWAP):  # a typo ("Swap") would otherwise recompute, silently
            raise ValueError(f"{request.request_id}: preemption mode must be {RECOMPUTE!r} or {SWAP!r}, got {mode!r} "
                             f"(policy {self.policy.name!r})")
        if request in self._finishing:  # its token in flight still finishes it (update_from_committed)
            self._finishing.remove(request)
        else:
            self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        if mode == SWAP:
            mapping = self.allocator.swap_out(request)
            if mapping is not None:
                request.status = RequestStatus.SWAPPED
                request.num_swaps += 1
                self.num_swap_outs += 1
                self.swapped.append(request)
                step.out.swapped_out.append(request)
                step.out.blocks_to_swap_out.extend(mapping)
                return SWAP
        self._wait_to_recompute(request)
        step.out.preempted.append(request)
        return RECOMPUTE

    def _wait_to_recompute(self, request: Request) -> None:
        """``request``, off the running or swapped queue, back at the front of the waiting queue
        with no blocks, to be computed again from its first token."""
        self.allocator.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.policy.on_waiting(request)

    def swap_in(self, step: Step, request: Request, num_tokens: int = 0) -> bool:
        """Bring a swapped request back to the device; with ``num_tokens``, only if the free blocks also hold
        that many new tokens, which are then scheduled (else it is still to be scheduled). False, with
        nothing changed, when the blocks or ``max_num_seqs`` do not allow it."""
        if request.status != RequestStatus.SWAPPED:
            raise ValueError(f"{request.request_id} is {request.status.name}, not swapped")
        if step.was_preempted(request):
            raise ValueError(f"{request.request_id} was swapped out during this step; swap it in from the next one")
        if num_tokens:
            self._check_num_tokens(step, request, num_tokens)
            if self.allocator.num_free_blocks < self.allocator.blocks_needed(request.num_computed_tokens + num_tokens):
                return False
        if self.seats_taken >= self.max_num_seqs:
            return False
        mapping = self.allocator.swap_in(request)
        if mapping is None:
            return False
        self.swapped.remove(request)
        request.status = RequestStatus.RUNNING
        self._enter_running(request)
        step.out.swapped_in.append(request)
        step.out.resumed_requests.append(request)
        step.out.blocks_to_swap_in.extend(mapping)
        if num_tokens:
            self.schedule_request(step, request, num_tokens)
        return True

    def ignore(self, step: Step, request: Request, reason: str) -> None:
        """Finish a waiting request that can never run, with ``reason``."""
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"only waiting requests can be ignored; {request.request_id} is {request.status.name}")
        self.waiting.remove(request)
        self.allocator.free(request)
        self.requests.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED_IGNORED
        request.status_message = reason
        request.finished_time = self._ignored_time(request)
        step.out.ignored.append(request)
        self._finished_outside_step.append(request)

    def _ignored_time(self, request: Request) -> float:
        """When an ignored request finished: now (as vLLM), but not before it arrived; a request
        added ahead of its arrival time would otherwise get a negative end-to-end latency."""
        return max(self.clock.now(), request.arrival_time)

    # -- parallel sampling (vLLM v0) -------------------------------------------------------------
    def fork(self, parent: Request, child: Request, first_token: int, now: float | None = None) -> None:
        """vLLM v0's fork: ``child`` (new to the scheduler, with ``parent``'s prompt) sampled ``first_token``
        in the step that completed ``parent``'s prompt. Call it after the executor ran that step, before
        ``update_from_output`` (so ``parent`` still holds its blocks), with that call's ``now``.

        The child shares ``parent``'s device blocks (copy-on-write through ``blocks_to_copy``) and is in the
        next output's ``new_requests``; with ``max_num_seqs`` running it waits instead, at the queue's front
        after this step's earlier waiting forks, to be prefilled on its own. A child finished by its first
        token never runs."""
        if parent.status != RequestStatus.RUNNING or parent.num_output_tokens:
            raise ValueError(f"cannot fork from {parent.request_id}: it must be running and still at its prompt")
        if (child.request_id in self.requests or child.status != RequestStatus.WAITING
                or child.token_ids != parent.token_ids):
            raise ValueError(f"{child.request_id} cannot be forked from {parent.request_id}: it must be a new "
                             f"request with the same prompt")
        now = self.clock.now() if now is None else now
        child.first_scheduled_time = parent.first_scheduled_time
        child.num_cached_tokens = parent.num_cached_tokens
        child.append_output_token(first_token, now)
        status = child.check_stop()
        if status is not None:
            child.status = status
            child.finished_time = now
            return
        self._receive(child)
        if self.seats_taken >= self.max_num_seqs:
            # At the front, behind the samples forked to wait before it in this step: putting
            # each first would queue them last forked first (a later request's ahead of an
            # earlier one's). The policy hears of them in update_from_output.
            self.waiting.insert(len(self._forks_waiting), child)
            self._forks_waiting.append(child)
            return
        self.allocator.fork(parent, child)
        child.num_computed_tokens = parent.num_prompt_tokens
        child.status = RequestStatus.RUNNING
        self._enter_running(child)
        self._forked.append(child)

    def _tell_forks_waiting(self) -> None:
        if not self._forks_waiting:  # called twice a step, nearly always with nothing to tell
            return
        # Last forked first, as if each had gone to the front of the queue in turn: a policy
        # keeping its own index of the queue (ChunkedPolicy's heap) then orders them as it does.
        for child in reversed(self._forks_waiting):
            if child.status == RequestStatus.WAITING:
                self.policy.on_waiting(child)
        self._forks_waiting = []

    def _announce_forks(self, out: SchedulerOutput) -> None:
        # Forked requests enter the batch without passing through admission: list them as new
        # so input preparers build their rows (unless preempted, or re-admitted, in this step).
        for req in self._forked:
            if req.status == RequestStatus.RUNNING and req not in out.resumed_requests:
                out.new_requests.append(req)
        self._forked = []

    def _announce_rebuilt(self, out: SchedulerOutput) -> None:
        # After a failed step: its requests still running get their rows rebuilt, as resumed
        # ones do (unless this output already lists them as new or resumed).
        listed = {r.request_id for r in out.new_requests + out.resumed_requests}
        for req in self._rebuilt:
            if req.status == RequestStatus.RUNNING and req.request_id not in listed:
                listed.add(req.request_id)
                out.resumed_requests.append(req)
        self._rebuilt = []
