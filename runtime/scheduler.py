"""How an engine's generations share its backend: one interface, a serial and a batching implementation.

:class:`Scheduler` is what the :class:`~.engine.Engine` asks for: ``submit`` queues a generation and gives
its token iterator (or None when the caller gave up, or the engine closed, before it started), and the
queue's state for ``Engine.stats()``. :class:`SerialScheduler` is the single decode slot: one generation
at a time, callers served in arrival order, each generation decoded start to finish by the engine's
:class:`~.decode.Decoder`. :class:`~.batch.BatchScheduler` runs up to ``max_batch`` generations as rows of
every step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

from .decode import Decoder, DecodeStats, GenerationConfig

_POLL_S = 0.05  # how often a queued caller looks at its cancel flag


class Scheduler(Protocol):
    decoder: Decoder
    max_batch: int
    busy_s: float  # seconds the backend spent on generations

    @property
    def waiting(self) -> int: ...  # callers queued now

    @property
    def active(self) -> int: ...  # generations decoding now

    def submit(self, ids: list[int], config: GenerationConfig, stats: DecodeStats,
               cancelled: Callable[[], bool] | None = None, namespace: str = "") -> Iterator[int] | None:
        """Queue a generation; its tokens as they are made, or None if ``cancelled()`` turned true or the
        scheduler closed before it started. ``namespace``: the part of a cross-request draft cache it uses."""
        ...

    def close(self) -> None:
        """Turn away queued and new callers and wait for the running step; running iterators then end."""
        ...


class _Ticket:
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.granted = False


class _Slot:
    """The single decode slot: held by one caller at a time and handed over in arrival order.

    A plain ``threading.Lock`` is not FIFO, so under load a caller could wait indefinitely; here a
    release hands the slot straight to the oldest waiter.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._idle = threading.Condition(self._mutex)
        self._waiters: deque[_Ticket] = deque()
        self._busy = False
        self._closed = False

    @property
    def depth(self) -> int:
        return len(self._waiters)

    @property
    def busy(self) -> bool:
        return self._busy

    def acquire(self, cancelled: Callable[[], bool] | None = None) -> bool:
        """Wait for the slot; False if ``cancelled()`` turns true or the slot closes first."""
        with self._mutex:
            if self._closed:
                return False
            if not self._busy and not self._waiters:
                self._busy = True
                return True
            ticket = _Ticket()
            self._waiters.append(ticket)
        while True:
            ticket.event.wait(_POLL_S if cancelled is not None else None)
            with self._mutex:
                if ticket.granted:
                    if cancelled is not None and cancelled():
                        self._release_locked()
                        return False
                    return True
                if ticket.event.is_set():  # woken by close()
                    return False
                if cancelled is not None and cancelled():
                    self._waiters.remove(ticket)
                    return False

    def release(self) -> None:
        with self._mutex:
            self._release_locked()

    def _release_locked(self) -> None:
        if self._waiters:
            ticket = self._waiters.popleft()
            ticket.granted = True
            ticket.event.set()
        else:
            self._busy = False
            self._idle.notify_all()

    def close(self) -> None:
        """Turn away every waiter and new caller, then wait until the current holder releases."""
        with self._mutex:
            self._closed = True
            for ticket in self._waiters:
                ticket.event.set()
            self._waiters.clear()
            while self._busy:
                self._idle.wait()


class SerialScheduler:
    """One generation at a time on ``decoder``: callers queue for the slot, each generation runs to its
    end (or its caller's cancel) on its own, never interleaved with another."""

    max_batch = 1

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.busy_s = 0.0  # time the slot was held by a generation
        self._slot = _Slot()

    @property
    def waiting(self) -> int:
        return self._slot.depth

    @property
    def active(self) -> int:
        return int(self._slot.busy)

    def submit(self, ids: list[int], config: GenerationConfig, stats: DecodeStats,
               cancelled: Callable[[], bool] | None = None, namespace: str = "") -> Iterator[int] | None:
        if not self._slot.acquire(cancelled):
            return None
        if hasattr(self.decoder.drafter, "namespace"):  # set while this generation holds the slot
            self.decoder.drafter.namespace = namespace
        return _Held(self, self.decoder.generate(ids, config, stats))

    def release(self) -> None:
        """Hand the slot to the next caller (a generation's tokens do it when they end)."""
        self._slot.release()

    def close(self) -> None:
        self._slot.close()


class _Held:
    """A generation's tokens while it holds the slot: released once, when they end, fail or are closed
    (also if closed before the first token was asked for)."""

    def __init__(self, scheduler: SerialScheduler, gen: Iterator[int]):
        self._scheduler, self._gen, self._t0 = scheduler, gen, time.perf_counter()
        self._held = True

    def __iter__(self) -> _Held:
        return self

    def __next__(self) -> int:
        try:
            return next(self._gen)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if not self._held:
            return
        self._held = False
        try:
            self._gen.close()
        finally:
            self._scheduler.busy_s += time.perf_counter() - self._t0
            self._scheduler.release()
