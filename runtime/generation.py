"""What one generation is to the decode loop (:mod:`.decode`): its sampling and config, its stats, and its state
between steps (tokens, cache columns, drafter, acceptance record)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .drafters.base import Drafter
from .drafters.prompt_lookup import ChainAcceptance
from .errors import PromptError
from .kvcache import KVCache
from .logprobs import MAX_TOP, TokenLogprob
from .tree import DraftTree
from .verify import TypicalRule

if TYPE_CHECKING:
    from .grammar import CompiledGrammar

@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. ``typical`` switches to Medusa's typical acceptance: LOSSY, opt-in."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    typical: bool = False
    typical_rule: TypicalRule = field(default_factory=TypicalRule)

    def __post_init__(self) -> None:
        if self.temperature < 0 or not np.isfinite(self.temperature):
            raise PromptError("temperature must be a finite number >= 0.")
        if not (0.0 < self.top_p <= 1.0):
            raise PromptError("top_p must be in (0, 1].")
        if self.top_k < 0:
            raise PromptError("top_k must be >= 0.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    logprobs: int | None = None  # None: none; k: each emitted token's log-probability and its row's k best
    grammar: CompiledGrammar | None = None  # what the output must match (runtime/grammar.py)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise PromptError("max_new_tokens must be at least 1.")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP:
            raise PromptError(f"top_logprobs must be between 0 and {MAX_TOP}.")
        if self.grammar is not None and self.sampling.typical and not self.sampling.greedy:
            raise PromptError("Typical acceptance (lossy) does not run under a constraint; sample exactly instead.")


@dataclass
class DecodeStats:
    """Filled in while a generation runs; read it after the iterator is exhausted."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target forward passes after prefill
    prefill_s: float = 0.0
    decode_s: float = 0.0
    backend_s: float = 0.0  # time inside backend.step during decode
    accepted: list[int] = field(default_factory=list)  # tokens emitted per decode step
    tree_sizes: list[int] = field(default_factory=list)
    finish_reason: str = ""
    lossy: bool = False
    gate_parallel: int = 0  # steps the drafter's gate sent to draft + tree verify
    gate_ar: int = 0  # steps the gate ran as plain T=1 decoding (no draft cost)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per emitted token, where the config asks

    @property
    def mean_accepted(self) -> float:
        """tau: tokens emitted per target forward pass (the prefill's first token counts for the prefill)."""
        return float(np.mean(self.accepted)) if self.accepted else 1.0

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.new_tokens - 1  # the first token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0

    @property
    def loop_overhead(self) -> float:
        """Fraction of decode time spent in the Python loop outside the backend."""
        return 1.0 - self.backend_s / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class DecodeState:
    """A prefilled sequence, passed explicitly between the stages (:meth:`Decoder.prefill`, ``verify``)."""

    cache: KVCache
    tokens: list[int]  # prompt + emitted; tokens[-1] is the root, whose K/V is not in the cache yet
    hidden: np.ndarray  # [A, H] base hidden states of the last accepted nodes
    root_logits: np.ndarray  # [V] logits that produced the root
    layers: np.ndarray | None = None  # [A, taps*H] their tapped layer states (graphs with feature_layers)


class Generation:
    """One sequence in the decode loop: its tokens, where its K/V lie, its sampling, its drafter and its stats.

    ``generate`` runs one; the batch scheduler runs many through the same :meth:`Decoder.step`."""

    def __init__(self, ids: list[int], config: GenerationConfig, stats: DecodeStats, drafter: Drafter | None):
        self.tokens = list(ids)  # prompt + emitted
        self.prompt_len = len(ids)
        self.committed = 0  # tokens whose K/V is in columns 0.. of its cache row; tokens[-1] is the root, fed next
        self.sampling, self.stats, self.drafter = config.sampling, stats, drafter
        self.top_logprobs = config.logprobs  # None: no log-probabilities
        self.constraint = None if config.grammar is None else config.grammar.start()  # its place in its grammar
        self.rng = np.random.default_rng(config.sampling.seed)
        self.remaining = config.max_new_tokens  # tokens it may still emit
        self.t_decode = 0.0  # when its decoding started (its decode_s counts from here)
        self.hidden: np.ndarray | None = None  # [A, H] of the nodes accepted last step
        self.root_logits: np.ndarray | None = None  # [V] that produced the root
        self.layers: np.ndarray | None = None  # [A, taps*H] the same nodes' tapped layer states (trained drafts)
        # Its drafts' acceptance per source (``Drafter.source``), as the rows rule of a batch weighs them: an answer
        # the suffix cache has met before is drafted near-certainly, an n-gram's guess at its odds.
        self.acceptances: dict[str, ChainAcceptance] = {}
        self.source = ""  # the source of this step's draft
        self.tree = DraftTree.root(0)  # this step's rows
        self.whole = True  # this step verifies its drafter's whole proposal (a batch may trim it)
        self.cut = False  # a batch's rows rule cut its drafter's proposal this step (Drafter.observed)
        self.emitted: list[int] = []  # what its last step (or its prefill) emitted
        self.asked = True  # its drafter was asked for this step's draft
        self.proposer: Drafter | None = drafter  # who proposed this step's draft: its drafter, its recall, or no one
        self.certain = 0  # this step's leading draft tokens that its grammar forces (certain to be accepted)
        self.unseen: list[tuple[np.ndarray, np.ndarray | None]] = []  # states of steps its drafter was not asked
        self.held = False  # it sat the last step out (another ran alone): its draft stands for the next
        self.waited = 0  # steps in a row it has sat out

    def expected(self, drafted: int) -> float:
        """Expected tokens of a step verifying ``drafted`` of its draft tokens (the forced ones certain): by the
        chances its drafter gave its chain's nodes where it gave them, else by its source's earned acceptance."""
        sure = min(drafted, self.certain)
        rest = drafted - sure
        if not rest:
            return sure + 1.0
        chances = self.tree.chances
        if chances is not None and self.whole:
            return sure + 1.0 + float(chances[1 + sure : 1 + drafted].sum())
        return sure + self.acceptance.expected_up_to(rest)[rest]

    @property
    def acceptance(self) -> ChainAcceptance:
        """The earned acceptance of this step's draft source."""
        found = self.acceptances.get(self.source)
        if found is None:
            found = self.acceptances[self.source] = ChainAcceptance()
        return found
