"""A sequence's output text decoded token by token in O(length), for stop strings and DELTA outputs, as vLLM's."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Prompt tokens decoded before the output as its context, as vLLM's incremental detokenizer does
#: (``framework.engine.output_processor.decode_continuation`` uses the same tail).
DETOKENIZE_CONTEXT = 5


class IncrementalDetokenizer:
    """Output text of one sequence, fed its sampled tokens by ``Request.check_stop`` (never the EOS or
    stop token that ended it: its text is not shown). Decoding skips special tokens and starts after the
    prompt's last tokens, as full-text decoding does, so a SentencePiece word keeps its leading space."""

    __slots__ = ("tokenizer", "stop", "include_stop_str_in_output", "holdback", "_keep", "_ids", "_read",
                 "_shown", "_pieces", "_length", "_tail", "_in_prompt")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        #: Text before new text that a stop string ending in the new text may start in.
        self._keep = max(map(len, stop), default=1) - 1
        #: Characters a streamed (unfinished) output holds back: they may begin a stop string
        #: whose end is still to come, which would cut them; 0 when the stop string is kept.
        self.holdback = 0 if include_stop_str_in_output else self._keep
        #: Tokens still to decode: a context of shown tokens (``_ids[:_read]``), then new ones.
        self._ids = list(prompt_token_ids[-DETOKENIZE_CONTEXT:])
        self._read = len(self._ids)
        #: Whether the context is still the prompt's tail (no output text settled yet).
        self._in_prompt = True
        #: Characters of the pending tokens' (``_ids[_read:]``) text already taken into the text.
        self._shown = 0
        # The text as pieces (a str grown by += is copied whole each time), its length, and its
        # last ``_keep`` characters.
        self._pieces: list[str] = []
        self._length = 0
        self._tail = ""

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def output_text(self, finished: bool, start: int = 0) -> str:
        """The text to show from character ``start`` on: all of it once finished, else less the last
        ``holdback`` characters, which a stop string may yet cut (as vLLM's streaming). A delta
        (``start`` > 0) joins only the pieces it covers, so streaming costs O(length) in all."""
        if finished and self._read < len(self._ids):
            # Bytes still pending (an incomplete or invalid character at the end) show as the
            # full decode shows them: U+FFFD. A sequence that ended on a stop string has none.
            new = self._decode_next(final=True)
            self._pieces.append(new)
            self._length += len(new)
        end = self._length if finished else max(self._length - self.holdback, 0)
        if not start:
            return self.text[:end]
        pos, covering = self._length, []  # the last pieces, back to ``start``
        for piece in reversed(self._pieces):
            if pos <= start:
                break
            covering.append(piece)
            pos -= len(piece)
        return "".join(reversed(covering))[start - pos:end - pos]

    def append(self, token_id: int, final: bool = False) -> str | None:
        """Decode ``token_id``; return the stop string its text completes (of several, the earliest: vLLM
        takes the first listed), cutting the text before it (after it with ``include_stop_str_in_output``),
        else None. ``final``: no token follows, so bytes pending as an incomplete character decode now."""
        self._ids.append(token_id)
        new = self._decode_next(final)
        if not new:
            return None
        # Every stop string ending before ``new`` was found on an earlier token, so one found
        # here ends in ``new``: searching the tail plus ``new`` finds it.
        window = self._tail + new
        start = self._length - len(self._tail)  # where the window starts in the text
        self._pieces.append(new)
        self._length += len(new)
        found, at = None, len(window)
        for stop in self.stop:  # the earliest match wins; on a tie, the stop string listed first
            i = window.find(stop)
            if i != -1 and i < at:
                found, at = stop, i
        if found is None:
            self._tail = window[max(len(window) - self._keep, 0):]
            return None
        cut = start + at + (len(found) if self.include_stop_str_in_output else 0)
        self._pieces = [self.text[:cut]]
        self._length = cut
        self._read, self._shown = len(self._ids), 0  # nothing after the stop string is shown
        return found

    def _decode_next(self, final: bool = False) -> str:
        """The text the pending tokens add: the context decoded with them less without them, as vLLM's.
        Text ending in U+FFFD (an incomplete character) keeps them pending and yields only what precedes
        the U+FFFD run, so a stop string in it ends the sequence now; ``final`` yields all."""
        ids = self._ids
        decode = self.tokenizer.decode
        prefix = decode(ids[:self._read], skip_special_tokens=True)
        whole = decode(ids, skip_special_tokens=True)
        if self._in_prompt and (final or not whole.endswith("\ufffd")):
            self._in_prompt = False
            if not whole.startswith(prefix):
                # A character split across the prompt's end: decoded after the prompt's text,
                # the output's would lose characters. As ``decode_continuation`` (the text of a
                # request without stop strings), the output is decoded alone.
                del ids[:self._read]
                self._read = 0
                prefix, whole = "", decode(ids, skip_special_tokens=True)
        if len(whole) <= len(prefix):
            return ""
        done = final or not whole.endswith("\ufffd")
        if not done:
            whole = whole.rstrip("\ufffd")
        new = whole[len(prefix) + self._shown:]
        if done:
            del ids[:self._read]  # the new tokens are the next token's context
            self._read, self._shown = len(ids), 0
        else:
            self._shown += len(new)
        return new
