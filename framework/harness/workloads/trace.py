"""Trace replay: requests read from a JSON or JSONL file.

Each entry is an object with ``output_len`` (required; null generates up to the engine's
``max_model_len``, as ``max_tokens=None``), one of ``prompt_token_ids`` (a list of
ids), ``prompt`` (text, tokenised with the checkpoint's tokenizer) or ``prompt_len`` (random
ids of that length, drawn from the workload's seed), and optionally ``arrival_time`` (seconds,
default 0), ``priority`` (default 0), ``request_id`` (a string or an integer;
default: the entry's position) and the request's own sampling keys ``temperature``, ``top_p``,
``top_k``, ``min_p``, the three penalties and ``ignore_eos`` (``SAMPLING_KEYS``; they win over
the workload's, which apply to the entries without them). A ``prompt_len`` or ``output_len`` the
engine's ``max_model_len`` can never hold is refused before anything is drawn; a longer prompt given
as ids or text is replayed as given, and the engine refuses it (``ignored``, counted in the summary).

A ``.jsonl`` file holds one object per line (blank lines and lines starting with ``#`` are
skipped); any other file is one JSON array of objects (or ``{"requests": [...]}``). Files are
UTF-8, as JSON is. Every run saves the requests it sent as ``workload.jsonl`` in this format
(token ids, not a text prompt's text), so any workload can be replayed exactly.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from framework.common.config import check_positive_int, check_seed, is_finite_number, is_int
from framework.harness.workload import (SAMPLING_KEYS, WORKLOADS, Workload, WorkloadContext, WorkloadRequest,
                                non_default_sampling)
from framework.harness.workloads.arrivals import check_rate
from framework.harness.workloads.text import tokenize

logger = logging.getLogger(__name__)

_KEYS = {"arrival_time", "prompt_len", "prompt_token_ids", "prompt", "output_len", "priority", "request_id",
         *SAMPLING_KEYS}
#: Where relative paths are also looked for: the project root (the folder holding conf/).
PROJECT_ROOT = Path(__file__).resolve().parents[3]


class TraceError(ValueError):
    """A malformed trace entry; the message names the file and the line (or entry)."""


def resolve_path(path: str | Path) -> Path:
    """``path`` as given if it exists, else relative to the project root; an error names both."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        if not p.exists():
            raise ValueError(f"workload file {str(p)!r} does not exist")
        return _a_file(p)
    alt = PROJECT_ROOT / p
    if alt.exists():
        return _a_file(alt)
    places = " and ".join(dict.fromkeys(map(str, (Path.cwd(), PROJECT_ROOT))))  # once when they are the same
    raise ValueError(f"workload file {str(path)!r} not found (looked in {places})")


def _a_file(path: Path) -> Path:
    if path.is_dir():  # found when the workload is configured, not by open() once an engine is built
        raise ValueError(f"workload file {str(path)!r} is a directory")
    return path


def read_text(path: Path) -> str:
    """A workload file's text, decoded as UTF-8 (JSON's encoding, whatever the locale; a byte-order
    mark is skipped). A file that cannot be read, or is not text, is a ValueError naming it."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
                         "a compressed file must be decompressed first") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def read_entries(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, entry)`` pairs, ``where`` naming the line (JSONL) or entry (JSON) for errors."""
    text = read_text(path)
    if path.suffix == ".jsonl":
        entries = []
        # Lines end at "\n" alone (a "\r" before it is whitespace to JSON): splitlines() would also
        # split at U+2028, U+0085 and the like, which JSON strings may hold unescaped (orjson and
        # json.dumps(ensure_ascii=False) write them as they are).
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                entries.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        return entries
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("requests"), list):
        data = data["requests"]
    if not isinstance(data, list):
        raise TraceError(f"{path}: expected a JSON array of requests (or {{\"requests\": [...]}})")
    return [(f"{path}: entry {i}", entry) for i, entry in enumerate(data)]


def parse_entry(where: str, entry: Any, index: int, ctx: WorkloadContext,
                rng: np.random.Generator) -> WorkloadRequest:
    if not isinstance(entry, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(entry).__name__}")
    unknown = set(entry) - _KEYS
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {sorted(unknown)}; valid: {', '.join(sorted(_KEYS))}")
    given = [k for k in ("prompt_token_ids", "prompt", "prompt_len") if k in entry]
    if len(given) != 1:
        raise TraceError(f"{where}: give exactly one of prompt_token_ids, prompt, prompt_len (got {given or 'none'})")
    output_len = entry.get("output_len")
    if "output_len" not in entry or output_len is not None and (not is_int(output_len) or output_len < 1):
        raise TraceError(f"{where}: output_len must be an integer >= 1 or null (up to max_model_len), "
                         f"got {output_len!r}")
    arrival = entry.get("arrival_time", 0.0)
    if not is_finite_number(arrival) or arrival < 0:  # NaN would never arrive
        raise TraceError(f"{where}: arrival_time must be a number >= 0 (seconds), got {arrival!r}")
    priority = entry.get("priority", 0)
    if not is_int(priority):
        raise TraceError(f"{where}: priority must be an integer, got {priority!r}")
    text = None
    if "prompt_token_ids" in entry:
        ids = entry["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(is_int(t) and 0 <= t < ctx.vocab_size for t in ids):
            raise TraceError(f"{where}: prompt_token_ids must be a non-empty list of ids in [0, {ctx.vocab_size})")
    elif "prompt" in entry:
        text = entry["prompt"]
        if not isinstance(text, str) or not text:
            raise TraceError(f"{where}: prompt must be non-empty text")
        ids = tokenize(text, ctx)
        if not ids:
            raise TraceError(f"{where}: prompt tokenises to nothing")
    else:
        n = entry["prompt_len"]
        if not is_int(n) or n < 1:
            raise TraceError(f"{where}: prompt_len must be an integer >= 1, got {n!r}")
        ids = rng.integers(ctx.first_token_id, ctx.vocab_size, size=n).tolist()
    rid = entry.get("request_id", index)
    # str() would turn null into "None" and a list into "[1, 2]", silently.
    if not (isinstance(rid, str) and rid or is_int(rid)):
        raise TraceError(f"{where}: request_id must be a non-empty string or an integer, got {rid!r}")
    rid = str(rid)
    sampling = {k: entry[k] for k in SAMPLING_KEYS if k in entry} or None
    if sampling:
        try:  # here, naming the line, not when the request is sent
            non_default_sampling(sampling)
        except ValueError as exc:
            raise TraceError(f"{where}: {str(exc).replace('SamplingParams.', '', 1)}") from None
    output_len = None if output_len is None else int(output_len)
    return WorkloadRequest(rid, [int(t) for t in ids], output_len, float(arrival), int(priority), text, sampling)


def load_trace(path: str | Path, ctx: WorkloadContext, seed: int = 0,
               entries: list[tuple[str, Any]] | None = None) -> list[WorkloadRequest]:
    """Every request of a trace file, sorted by arrival time (ties keep file order); ``entries``: the file's
    ``read_entries``, when read already."""
    path = resolve_path(path)
    entries = read_entries(path) if entries is None else entries
    if not entries:
        raise TraceError(f"{path}: the trace holds no requests")
    if ctx.tokenizer is None and any(isinstance(e, dict) and "prompt" in e for _, e in entries):
        logger.warning("%s has text prompts but the model has no tokenizer: using one id per word", path)
    rng = np.random.default_rng(seed)
    requests = [parse_entry(where, e, i, ctx, rng) for i, (where, e) in enumerate(entries)]
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        counts = Counter(ids)  # not ids.count per id: quadratic, minutes for a big trace
        dup = next(i for i in ids if counts[i] > 1)
        raise TraceError(f"{path}: request_id {dup!r} appears more than once")
    return sorted(requests, key=lambda r: r.arrival_time)


def save_trace(path: str | Path, requests: list[WorkloadRequest], sampling: dict[str, Any] | None = None) -> None:
    """Write ``requests`` as JSONL that ``load_trace`` reads back as the same requests, less text
    prompts' text. Each entry holds its non-default sampling keys (``sampling`` under the request's
    own), so a replay samples as the run did. orjson: json writes millions of token ids 5x slower."""
    shared = non_default_sampling(sampling or {})
    with open(path, "wb") as f:
        for r in requests:
            keys = non_default_sampling({**(sampling or {}), **r.sampling}) if r.sampling else shared
            f.write(orjson.dumps({"request_id": r.request_id, "arrival_time": r.arrival_time, "priority": r.priority,
                                  "output_len": r.output_len, **keys, "prompt_token_ids": r.prompt_token_ids},
                                 option=orjson.OPT_SERIALIZE_NUMPY, default=_as_list) + b"\n")


def _as_list(value: Any) -> Any:
    """What orjson cannot write natively: a strided numpy array (a slice with a step)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to a trace")


@WORKLOADS.register("trace")
class TraceWorkload(Workload):
    """Replay ``path``. ``rate`` null keeps the recorded times; a rate rescales them so the
    trace's mean rate (requests / last arrival) is ``rate``. ``max_requests`` keeps the first
    ones by arrival (only they are drawn); ``seed`` draws the ids of ``prompt_len`` entries."""

    def __init__(self, path: str, rate: float | None = None, max_requests: int | None = None, seed: int = 0) -> None:
        check_rate(rate)
        check_seed("workload.seed", seed)
        check_positive_int("max_requests", max_requests, optional=True)
        resolve_path(path)  # a missing file fails with the configuration, before an engine is built
        self.path, self.rate, self.max_requests, self.seed = path, rate, max_requests, seed
        self._entries: list[tuple[str, Any]] | None = None  # read by check_lengths, for generate

    def check_lengths(self, max_model_len: int) -> int | None:
        """Refuses, naming its line, a ``prompt_len`` or ``output_len`` of a request sent beyond what ``max_model_len``
        holds, alone or together (a prompt given as ids by its length), before any prompt is drawn; a longer prompt
        given as ids or text is sent, and the engine refuses it. Returns the longest prompt within the limit, or
        None when text prompts are sent (tokenised later)."""
        self._entries = read_entries(resolve_path(self.path))
        longest, text = 0, False
        for where, entry in self._sent(self._entries):
            prompt_len, output_len = entry.get("prompt_len"), entry.get("output_len")
            if is_finite_number(prompt_len) and prompt_len > max_model_len:
                raise TraceError(f"{where}: prompt_len {prompt_len!r} is beyond max_model_len={max_model_len}: "
                                 f"lower it or raise engine.max_model_len")
            if is_finite_number(output_len) and output_len > max_model_len - 1:
                raise TraceError(f"{where}: output_len {output_len!r} is beyond {max_model_len - 1}, the most output "
                                 f"max_model_len={max_model_len} leaves after a 1-token prompt: lower it or raise "
                                 f"engine.max_model_len")
            ids = entry.get("prompt_token_ids")
            n = len(ids) if isinstance(ids, list) else prompt_len if is_int(prompt_len) else 0
            if n > max_model_len:
                continue  # sent as given: the engine refuses it, and the run counts it
            longest = max(longest, n)
            if is_int(output_len) and n + output_len > max_model_len:
                raise TraceError(f"{where}: a prompt of {n} tokens and output_len {output_len} reach "
                                 f"{n + output_len}, beyond max_model_len={max_model_len}: the request would stop "
                                 f"short of its output length; lower them or raise engine.max_model_len")
            text = text or "prompt" in entry
        return None if text else longest

    def _sent(self, entries: list[tuple[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        """The entries (objects only; ``parse_entry`` reports others) that ``generate`` sends: the first
        ``max_requests`` by arrival time, as it orders them."""
        objects = [(where, e) for where, e in entries if isinstance(e, dict)]
        if self.max_requests is None:
            return objects
        arrival = [e.get("arrival_time", 0.0) for _, e in objects]
        order = sorted(range(len(objects)), key=lambda i: arrival[i] if is_finite_number(arrival[i]) else 0.0)
        return [objects[i] for i in order[: self.max_requests]]

    def generate(self, ctx: WorkloadContext) -> list[WorkloadRequest]:
        entries, self._entries = self._entries, None
        if entries is None:
            entries = read_entries(resolve_path(self.path))
        if self.max_requests is not None:
            # Only the requests sent are drawn: prompts past max_requests would cost memory and time for nothing.
            sent = {id(e) for _, e in self._sent(entries)}
            entries = [(where, e) for where, e in entries if not isinstance(e, dict) or id(e) in sent]
        requests = load_trace(self.path, ctx, self.seed, entries)[: self.max_requests]
        if self.rate is not None:
            rescale_to_rate(requests, self.rate, str(self.path))
        return requests


def rescale_to_rate(requests: list[WorkloadRequest], rate: float, what: str) -> None:
    """Scale arrival times in place so that ``len(requests) / last_arrival == rate``."""
    last = max(r.arrival_time for r in requests)
    if last <= 0:
        raise ValueError(f"{what}: every request arrives at t=0, so there is no rate to rescale; set rate to null")
    factor = len(requests) / rate / last
    for r in requests:
        r.arrival_time *= factor
