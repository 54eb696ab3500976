"""Text out of token streams: what ``Engine.stream`` returns, and stop strings over incremental detokenizing."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .decode import DecodeStats
from .logprobs import TokenLogprob
from .tools import ToolCallParser


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    # "stop" (EOS or stop string), "length", "tool_calls" (the answer is tool calls), or "cancelled"
    finish_reason: str
    stats: DecodeStats
    # The answer's tool calls in OpenAI's form (``{"id", "type", "function": {"name", "arguments"}}``), where the
    # generation was given tools and the answer calls them; ``text`` is then the content before the calls.
    tool_calls: tuple[dict, ...] = ()

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """Each of ``token_ids``' log-probability (and its position's best tokens), where the request asked."""
        return self.stats.logprobs[: len(self.token_ids)]


class TextStream:
    """Iterator of text deltas; ``completion`` is set once it ends (exhausted, stopped or closed).

    ``close()`` may be called from any thread: a queued stream leaves the queue, and a running one
    stops after its current decode step and hands the engine to the next caller.
    """

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.stats = DecodeStats()  # filled in live while the generation runs
        self.completion: Completion | None = None
        self._cancel = threading.Event()
        self._deltas: Iterator[str] = iter(())

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except ValueError as exc:
            # close() from another thread raced this next(): the generator is being closed there.
            if self._cancel.is_set() and "already executing" in str(exc):
                raise StopIteration from None
            raise

    def attach(self, deltas: Iterator[str]) -> None:
        """The text deltas this stream yields (the engine's generation, which starts at the first ``next()``)."""
        self._deltas = deltas

    @property
    def cancel_flag(self) -> Callable[[], bool]:
        """What the scheduler asks before every step: whether the stream was closed."""
        return self._cancel.is_set

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def close(self) -> None:
        """Stop generating (e.g. the client went away); releases the engine for the next caller."""
        self._cancel.set()
        close = getattr(self._deltas, "close", None)
        try:
            if close is not None:
                close()
        except ValueError:  # running in another thread, which sees the flag after this step
            return
        if self.completion is None:  # closed before it ever started
            self.cancel_unstarted()

    def cancel_unstarted(self) -> None:
        """End a stream that never got to decode: cancelled, no text."""
        self.stats.finish_reason = "cancelled"
        self.completion = Completion("", (), "cancelled", self.stats)


def text_deltas(tokens: Iterator[int], detok, stops: Sequence[str], stream: TextStream,
                tools: ToolCallParser | None = None) -> Iterator[str]:
    """The text deltas of ``tokens`` (a generation running for ``stream``), decoded by ``detok`` (a
    :meth:`~.text.TextCodec.stream`). Text that might start a stop string is held back, and the first stop
    string ends the text before it. With ``tools``, text from where a tool call may start is held back too, and
    the end splits the text into content and calls. ``stream.completion`` is set when this ends: exhausted,
    stopped, cancelled, closed at a yield or failed; ``tokens`` is closed then, whatever the reason."""
    stats = stream.stats
    hold = max((len(s) for s in stops), default=1) - 1  # chars that might start a stop string
    emitted_len, ids, reason, end = 0, [], "", None
    final, calls = "", ()
    try:
        for tok in tokens:
            if stream.cancelled:
                reason = "cancelled"
                break
            ids.append(tok)
            detok.push([tok])
            text = detok.text
            hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if hit >= 0:
                end, reason = hit, "stop"
                break
            safe = len(text) - hold if stops else len(text)
            if tools is not None:
                safe = min(safe, tools.content_end(text))
            if safe > emitted_len:
                yield text[emitted_len:safe]
                emitted_len = safe
        else:
            reason = stats.finish_reason
        if reason in ("stop", "length"):  # the answer is whole: the rest of its content, and its calls
            final, calls = tools.parse(detok.text[:end]) if tools is not None else (detok.text[:end], ())
            if len(final) > emitted_len:
                yield final[emitted_len:]
            emitted_len = len(final)
            if calls and reason == "stop":
                reason = "tool_calls"
    finally:
        # Also runs when the stream is closed at a yield (GeneratorExit): the generation always ends here.
        tokens.close()
        if not reason:  # closed at a yield, or an error escaped the decoder
            reason = "cancelled" if stream.cancelled or not stats.finish_reason else stats.finish_reason
        stats.finish_reason = reason
        stream.completion = Completion(detok.text[:emitted_len] if not calls else final, tuple(ids),
                                       stats.finish_reason, stats, calls)
