"""The drafter interface: propose a candidate tree from the context and the base model's features."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..bundle import BundleManifest
from ..tree import DraftTree


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may look at when proposing the next tree."""

    tokens: np.ndarray  # [L] int64: prompt + generated so far; tokens[-1] is the root (not yet in the cache)
    hidden: np.ndarray  # [A, H] base hidden states of the nodes accepted last step (prefill: the prompt)
    root_logits: np.ndarray | None  # [V] base logits that produced the root (None for prompt lookup)
    max_nodes: int  # node budget including the root
    layers: np.ndarray | None = None  # [A, taps*H] the same nodes' tapped layer states (feature_layers graphs)
    sequences: int = 1  # the sequences whose rows share this step (a batch's): a draft call delays each of them


class Drafter(ABC):
    """Proposes a :class:`DraftTree` whose node 0 is the root token; may keep its own state."""

    kind: str = "drafter"
    feature_layers: tuple[int, ...] = ()  # base layers whose states it reads (DraftContext.layers); () none

    def check(self, manifest: BundleManifest) -> None:
        """Raise DraftMismatchError if this drafter does not fit the bundle's base model."""

    def reset(self) -> None:
        """Forget per-sequence state before a new prompt."""

    def spawn(self) -> Drafter | None:
        """A drafter like this one for another sequence, sharing what it loaded (its graphs) and what it learned,
        with a fresh state of its own; None where it cannot, and the caller makes one anew."""
        return None

    def recall(self) -> Drafter | None:
        """Its source of text met before (the suffix cache), which a batch still asks in the steps its load gate
        runs plain: about 15 us a call, so it keeps learning at any load, and an answer met before, drafted
        near-certainly, gets rows by the rows rule where they pay. None where it has none (lookup, n-grams, a
        trained draft: their calls cost more than a step of many sequences can spare)."""
        return None

    def observed(self, emitted: Sequence[int]) -> None:
        """Its last proposal was cut before verification (a batch's rows rule verified a prefix of it, or none):
        ``emitted``, the tokens the step emitted, judge its main path as far as they reach. :meth:`accepted` is
        not called for such a step."""

    @property
    def source(self) -> str:
        """Which of its sources drafted its last proposal (a drafter of several: ``auto``'s lookup, suffix or
        model); the decode loop keeps each source's earned acceptance apart."""
        return self.kind

    @property
    def needs_cost_curve(self) -> bool:
        """True for a drafter that sizes its drafts by the backend's measured step cost (see
        :meth:`use_cost_curve`); the engine then measures the curve once at load."""
        return False

    def use_cost_curve(self, cost_curve) -> None:
        """Cost of a T-token step relative to a 1-token step, as measured on the backend in use."""

    def profile(self) -> dict:
        """What this drafter's work has cost on this machine so far (running means), for reports."""
        return {}

    def wants_draft(self, ctx: DraftContext) -> bool:
        """Asked before every step; False runs the step as plain decoding (T=1, no draft cost)."""
        return True

    @abstractmethod
    def propose(self, ctx: DraftContext) -> DraftTree:
        """Return a tree with ``tree.tokens[0] == ctx.tokens[-1]`` and at most ``ctx.max_nodes`` nodes."""

    def accepted(self, nodes: np.ndarray, tree: DraftTree) -> None:
        """Told which nodes of the last proposal were accepted (for drafters with their own KV)."""

    def finished(self, tokens: Sequence[int], prompt_len: int) -> None:
        """Told a generation's whole sequence (prompt, then output) when it ends, however it ends
        (drafters that learn across requests)."""
