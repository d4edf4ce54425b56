"""Synthetic workloads: random prompts with chosen lengths, arrivals, shared prefixes and priorities."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from framework.common.config import check_positive_int, check_seed, is_finite_number, is_int
from framework.harness.workload import WORKLOADS, Workload, WorkloadContext, WorkloadRequest
from framework.harness.workloads.arrivals import arrival_times, check_rate
from framework.harness.workloads.lengths import LengthDist, check_bound


#: Requests whose prompt tokens are drawn in one call.
_DRAW_CHUNK = 4096


def _id_dtype(vocab_size: int) -> type[np.integer]:
    return np.int32 if vocab_size <= np.iinfo(np.int32).max else np.int64


@dataclass(frozen=True)
class SharedPrefix:
    """``fraction`` of the requests start with one of ``num_prefixes`` system prompts of
    ``prefix_len`` tokens (picked uniformly); their own ``prompt_len`` tokens follow it."""

    fraction: float
    num_prefixes: int
    prefix_len: int

    @classmethod
    def parse(cls, spec: dict[str, Any]) -> SharedPrefix:
        if not isinstance(spec, Mapping):  # set(True) is a TypeError; set("abc") three "keys"
            raise ValueError(f"shared_prefix must be a mapping {{fraction, num_prefixes, prefix_len}} or null, got {spec!r}")
        unknown = set(spec) - {"fraction", "num_prefixes", "prefix_len"}
        if unknown:
            raise ValueError(f"shared_prefix: unknown key(s) {sorted(unknown)}; valid: fraction, num_prefixes, prefix_len")
        fraction, num_prefixes, prefix_len = (spec.get("fraction", 1.0), spec.get("num_prefixes", 1),
                                              spec.get("prefix_len", 0))
        # Checked before any conversion: float("x") names no option, int(None) is a TypeError and
        # int(1.5) or int(True) would silently give a different count.
        if not (is_finite_number(fraction) and 0.0 <= fraction <= 1.0):
            raise ValueError(f"shared_prefix.fraction must be a number in [0, 1], got {fraction!r}")
        for name, value in (("num_prefixes", num_prefixes), ("prefix_len", prefix_len)):
            if not (is_int(value) and value >= 1):
                raise ValueError(f"shared_prefix.{name} must be an integer >= 1, got {value!r}")
        return cls(float(fraction), int(num_prefixes), int(prefix_len))


@dataclass(frozen=True)
class PriorityClass:
    """Requests of one priority. Its rate is ``rate`` when given, else ``share`` of the
    workload's rate (shares are normalised); its lengths default to the workload's."""

    priority: int
    rate: float | None
    share: float
    prompt_len: LengthDist
    output_len: LengthDist


@WORKLOADS.register("synthetic")
class SyntheticWorkload(Workload):
    """``num_requests`` requests with random token ids.

    Options: ``rate`` (requests/s, null = all at t=0), ``burstiness`` (gamma shape, 1 = Poisson),
    ``prompt_len`` / ``output_len`` (see ``framework/harness/workloads/lengths.py``), ``shared_prefix``
    (``{fraction, num_prefixes, prefix_len}``), ``priority_classes`` (a list of ``{priority,
    rate | share, prompt_len?, output_len?}``), ``seed``. Every aspect draws from its own
    random stream, so e.g. changing the rate leaves the prompts and lengths unchanged.
    """

    def __init__(self, num_requests: int = 32, rate: float | None = None, burstiness: float = 1.0,
                 prompt_len: Any = (16, 128), output_len: Any = (16, 64),
                 shared_prefix: dict[str, Any] | None = None,
                 priority_classes: list[dict[str, Any]] | None = None, seed: int = 0) -> None:
        check_seed("workload.seed", seed)
        check_positive_int("num_requests", num_requests)
        check_rate(rate, burstiness)
        self.num_requests = num_requests
        # An infinite rate is all at once, as null is: priority classes then mix as they do for null
        # (as streams at inf they would all tie at t=0, and the first class would take every request).
        self.rate = None if rate is not None and math.isinf(rate) else rate
        self.burstiness = burstiness
        self.prompt_len = LengthDist.parse(prompt_len, "prompt_len")
        self.output_len = LengthDist.parse(output_len, "output_len")
        self.shared_prefix = SharedPrefix.parse(shared_prefix) if shared_prefix else None
        self.classes = self._parse_classes(priority_classes) if priority_classes else None
        self.seed = seed

    def _parse_classes(self, specs: list[dict[str, Any]]) -> list[PriorityClass]:
        if not isinstance(specs, (list, tuple)):
            raise ValueError(f"priority_classes must be a list of {{priority, rate | share, ...}} mappings, got {specs!r}")
        classes = []
        for i, spec in enumerate(specs):
            what = f"priority_classes[{i}]"
            if not isinstance(spec, dict):
                raise ValueError(f"{what} must be a mapping with a 'priority' and a 'rate' or 'share', got {spec!r}")
            unknown = set(spec) - {"priority", "rate", "share", "prompt_len", "output_len"}
            if unknown:
                raise ValueError(f"{what}: unknown key(s) {sorted(unknown)}; valid: priority, rate, share, prompt_len, output_len")
            if "priority" not in spec:
                raise ValueError(f"{what}: needs a 'priority'")
            rate, share, priority = spec.get("rate"), spec.get("share", 1.0), spec["priority"]
            check_rate(rate, self.burstiness, f"{what}.rate")
            # A string would fail in a comparison naming nothing; int() would truncate 1.5.
            if not is_int(priority):
                raise ValueError(f"{what}.priority must be an integer (lower is more urgent), got {priority!r}")
            if not (is_finite_number(share) and share > 0):
                raise ValueError(f"{what}.share must be a finite number > 0, got {share!r}")
            classes.append(PriorityClass(
                int(priority), rate, float(share),
                LengthDist.parse(spec["prompt_len"], f"{what}.prompt_len") if "prompt_len" in spec else self.prompt_len,
                LengthDist.parse(spec["output_len"], f"{what}.output_len") if "output_len" in spec else self.output_len))
        explicit = [c.rate is not None for c in classes]
        if any(explicit) and not all(explicit):
            raise ValueError("priority_classes: give every class a rate, or none (then they share the workload's rate)")
        if all(explicit) and self.rate is not None:
            raise ValueError("priority_classes have their own rates: set the workload's rate to null")
        return classes

    def check_lengths(self, max_model_len: int) -> int:
        """Refuses a length distribution, or a prompt and output length together, that reaches past
        ``max_model_len`` (a request would stop short of its output length): by the bounds, before anything is
        drawn (a huge ``max`` would be costly to draw from), or, without a bound, by what is drawn. Returns the
        longest prompt (with the shared prefix) it may send."""
        prefix = self._prefix_len()
        if prefix >= max_model_len:
            raise ValueError(f"workload.shared_prefix.prefix_len={prefix} leaves no room within max_model_len="
                             f"{max_model_len} for a request's own tokens: lower it or raise engine.max_model_len")
        room = (f"{max_model_len - prefix}, what max_model_len={max_model_len} leaves after the shared prefix of "
                f"{prefix} tokens") if prefix else f"max_model_len={max_model_len}"
        limits = ((max_model_len - prefix, room),
                  (max_model_len - 1, f"{max_model_len - 1}, the most output max_model_len={max_model_len} leaves "
                                      f"after a 1-token prompt"))
        dists = self._named_dists()
        for pair in dists:
            for (what, dist), (limit, why) in zip(pair, limits):
                check_bound(what, dist, limit, why)
        longest = [pair[0][1].max for pair in dists]  # None for a prompt length without a bound
        # Each class's longest prompt and output together: by the bounds, else by what is drawn.
        totals = [None if p.max is None or o.max is None else p.max + o.max for (_, p), (_, o) in dists]
        if None in totals:
            _, class_of, prompt_lens, output_lens = self._lengths(self._streams())
            for c, pair in enumerate(dists):
                members = class_of == c
                if not members.any():
                    continue
                drawn = (int(prompt_lens[members].max()), int(output_lens[members].max()))
                for (what, dist), (limit, why), n in zip(pair, limits, drawn):
                    if dist.max is None:
                        check_bound(what, dist, limit, why, drawn=n)
                if longest[c] is None:
                    longest[c] = drawn[0]
                if totals[c] is None:
                    totals[c] = int((prompt_lens[members] + output_lens[members]).max())
        for ((prompt, _), (output, _)), total in zip(dists, totals):
            if total is not None and prefix + total > max_model_len:
                raise ValueError(
                    f"workload.{prompt} and workload.{output} reach {total} tokens together"
                    f"{f' after the shared prefix of {prefix}' if prefix else ''}, beyond max_model_len={max_model_len}: "
                    f"the longest requests would stop short of their output length; lower them or raise "
                    f"engine.max_model_len")
        return max((n for n in longest if n is not None), default=0) + prefix

    def _named_dists(self) -> list[list[tuple[str, LengthDist]]]:
        """Each class's ``[(name, prompt_len), (name, output_len)]``, named as the options that give them."""
        classes = self.classes or [PriorityClass(0, self.rate, 1.0, self.prompt_len, self.output_len)]
        return [[(key if getattr(cls, key) is getattr(self, key) else f"priority_classes[{i}].{key}", getattr(cls, key))
                 for key in ("prompt_len", "output_len")] for i, cls in enumerate(classes)]

    def _prefix_len(self) -> int:
        """The shared prefix's length when some request gets it, else 0."""
        sp = self.shared_prefix
        return sp.prefix_len if sp is not None and round(sp.fraction * self.num_requests) else 0

    def _streams(self) -> list[np.random.Generator]:
        """The random streams, in order: arrivals, (unused), prompt lengths, output lengths, tokens, prefixes."""
        # The second stream is unused but still spawned, so the streams after it (and so each
        # seed's requests) keep their values.
        return [np.random.default_rng(s) for s in np.random.SeedSequence(self.seed).spawn(6)]

    def _lengths(self, streams: list[np.random.Generator]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Arrival times, class indices, and prompt (without the shared prefix) and output lengths, drawn from
        ``_streams()``' own streams: drawn alone, they are ``generate``'s."""
        n = self.num_requests
        arrival_rng, _, prompt_rng, output_rng = streams[:4]
        times, class_of = self._arrivals(arrival_rng)
        classes = self.classes or [PriorityClass(0, self.rate, 1.0, self.prompt_len, self.output_len)]
        prompt_lens = np.zeros(n, dtype=np.int64)
        output_lens = np.zeros(n, dtype=np.int64)
        for c, cls in enumerate(classes):
            members = np.flatnonzero(class_of == c)
            prompt_lens[members] = cls.prompt_len.sample(prompt_rng, n)[: len(members)]
            output_lens[members] = cls.output_len.sample(output_rng, n)[: len(members)]
        return times, class_of, prompt_lens, output_lens

    def generate(self, ctx: WorkloadContext) -> list[WorkloadRequest]:
        n = self.num_requests
        streams = self._streams()
        token_rng, prefix_rng = streams[4:]
        times, class_of, prompt_lens, output_lens = self._lengths(streams)
        classes = self.classes or [PriorityClass(0, self.rate, 1.0, self.prompt_len, self.output_len)]
        prefixes = self._prefix_assignment(prefix_rng, ctx)
        low, high = ctx.first_token_id, ctx.vocab_size
        if not 0 <= low < high:
            raise ValueError(f"vocabulary of {high} tokens leaves no ids for random prompts (first id {low})")
        # Prompts are numpy arrays of 4-byte ids (a big simulated workload holds millions of
        # tokens; the engine validates an array in one vectorised pass and makes its own list).
        dtype = _id_dtype(high)
        priorities = [c.priority for c in classes]
        requests = []
        lengths, ends = prompt_lens.tolist(), np.cumsum(prompt_lens).tolist()
        for first in range(0, n, _DRAW_CHUNK):
            # One draw for a chunk of requests: the same stream as a draw per request.
            last = min(n, first + _DRAW_CHUNK)
            base = ends[first] - lengths[first]
            tokens = (token_rng.integers(0, high - low, size=ends[last - 1] - base) + low).astype(dtype)
            tokens.flags.writeable = False  # prompts are views into it: an edit in place would reach others
            for i in range(first, last):
                own = tokens[ends[i] - lengths[i] - base:ends[i] - base]
                prefix = prefixes[i]
                requests.append(WorkloadRequest(str(i), own if prefix is None else np.concatenate((prefix, own)),
                                                int(output_lens[i]), float(times[i]), priorities[class_of[i]]))
        return requests

    def _arrivals(self, arrival_rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Arrival times (sorted) and the class index of each request."""
        n = self.num_requests
        if not self.classes:
            return arrival_times(n, self.rate, self.burstiness, arrival_rng), np.zeros(n, dtype=np.int64)
        shares = np.array([c.share for c in self.classes])
        shares /= shares.sum()
        explicit = self.classes[0].rate is not None
        # All at once, the classes are ordered as the streams at unit total rate would order them,
        # as at any workload rate: a sweep over rate (null included) changes only the times.
        rates = [c.rate for c in self.classes] if explicit else [(self.rate or 1.0) * s for s in shares]
        # Superpose one arrival stream per class, each long enough alone, and keep the first n.
        streams = [arrival_times(n, r, self.burstiness, np.random.default_rng(s))
                   for r, s in zip(rates, arrival_rng.bit_generator.seed_seq.spawn(len(rates)))]
        times = np.concatenate(streams)
        labels = np.repeat(np.arange(len(streams)), n)
        order = np.argsort(times, kind="stable")[:n]
        if self.rate is None and not explicit:
            return np.zeros(n), labels[order]
        return times[order], labels[order]

    def _prefix_assignment(self, rng: np.random.Generator, ctx: WorkloadContext) -> list[np.ndarray | None]:
        n = self.num_requests
        sp = self.shared_prefix
        if sp is None:
            return [None] * n
        prompts = [rng.integers(ctx.first_token_id, ctx.vocab_size, size=sp.prefix_len).astype(_id_dtype(ctx.vocab_size))
                   for _ in range(sp.num_prefixes)]
        chosen = rng.permutation(n)[: round(sp.fraction * n)]
        which = rng.integers(0, sp.num_prefixes, size=len(chosen))
        out: list[np.ndarray | None] = [None] * n
        for i, k in zip(chosen, which):
            out[i] = prompts[k]
        return out
