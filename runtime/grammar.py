"""Constrained decoding: a grammar (a JSON schema, any JSON object, a regular expression or a Lark grammar) masks
every row a step verifies, so speculative output under a constraint is what plain constrained decoding gives.

The grammar engine is llguidance (MIT; a Rust core with no Python dependencies, so the lean runtime stays free of
torch): it computes a token mask in tens of microseconds for a 49k vocabulary here, rolls back, and tells which
tokens the grammar forces. Candidates weighed (docs/how-it-works.md, "Structured output"): xgrammar needs torch at
import, which the runtime does not take; outlines-core compiles a JSON schema to a regex index up front, which is
slow for large schemas and covers less of JSON Schema.

How a step stays exact (:meth:`~.decode.Decoder.step`): a constrained generation drafts a chain
(:meth:`Constraint.chain`). Its draft is cut at the first token the grammar refuses, or replaced by the tokens the
grammar forces where those reach further (a draft that costs nothing), or extended by the tokens the grammar forces
after its end. Row ``j`` of the chain is masked with the grammar's state after the chain's first ``j``
drafted tokens (computed forward, then rolled back: a rejected branch leaves nothing behind), and acceptance runs
on the masked rows: greedy takes the masked argmax, sampling draws from the masked distribution, exactly as a plain
constrained step would. The accepted tokens then advance the state.

llguidance is imported only when a grammar is asked for.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import PromptError, SpecDeployError
from .tree import DraftTree

KINDS = ("json_schema", "json_object", "regex", "lark")
_CACHED = 64  # compiled grammars a compiler keeps


class GrammarError(PromptError):
    """A constraint that cannot be compiled: an invalid schema, an unsupported feature, a bad regex or grammar."""


@dataclass(frozen=True)
class Grammar:
    """What a generation's output must match: ``kind`` (one of :data:`KINDS`) and its ``source`` (a JSON schema as
    a dict or JSON text, a regular expression, or a Lark grammar; nothing for ``json_object``)."""

    kind: str
    source: Any = None

    @classmethod
    def from_response_format(cls, response_format: dict | None) -> Grammar | None:
        """The grammar of an OpenAI ``response_format`` (``text``: none)."""
        if not response_format or response_format.get("type") in (None, "text"):
            return None
        kind = response_format.get("type")
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            if not isinstance(spec, dict) or "schema" not in spec:
                raise GrammarError("A json_schema response_format needs json_schema.schema.")
            return cls("json_schema", spec["schema"])
        raise GrammarError(f"response_format type '{kind}' is not one of text, json_object, json_schema.")


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # the bitmask helpers
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise SpecDeployError(f"Constrained decoding needs llguidance ({exc}): pip install llguidance.") from None
    return llguidance


class GrammarCompiler:
    """Compiles grammars against one bundle's tokenizer (built once, about 0.3 s for a 49k vocabulary)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Sequence[int]):
        llg = _llguidance()
        self.vocab_size = vocab_size
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.tokenizer = llg.LLTokenizer(Path(tokenizer_json).read_text(encoding="utf-8"), n_vocab=vocab_size,
                                         eos_token=sorted(self.eos))
        self._cache: dict[tuple, CompiledGrammar] = {}
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """The grammar checked and ready for generations, or one sentence (:class:`GrammarError`). The last
        :data:`_CACHED` distinct grammars are kept: a request's ``n`` choices, or a service's one schema, compile
        once."""
        key = (grammar.kind, grammar.source if isinstance(grammar.source, str | None)
               else json.dumps(grammar.source, sort_keys=True))
        with self._lock:
            found = self._cache.pop(key, None)
            if found is not None:
                self._cache[key] = found  # most recently used last
                return found
        compiled = self._compile(grammar)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHED:
                self._cache.pop(next(iter(self._cache)))
        return compiled

    def _compile(self, grammar: Grammar) -> CompiledGrammar:
        llg = _llguidance()
        matcher = llg.LLMatcher
        try:
            if grammar.kind in ("json_schema", "json_object"):
                schema = {"type": "object"} if grammar.kind == "json_object" else grammar.source
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise GrammarError("The JSON schema must be a JSON object.")
                text = matcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            elif grammar.kind == "regex":
                text = matcher.grammar_from_regex(str(grammar.source))
            elif grammar.kind == "lark":
                text = matcher.grammar_from_lark(str(grammar.source))
            else:
                raise GrammarError(f"The constraint kind '{grammar.kind}' is not one of {', '.join(KINDS)}.")
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"The {grammar.kind.replace('_', ' ')} is not valid: {_sentence(exc)}") from None
        error = matcher.validate_grammar(text, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"The {grammar.kind.replace('_', ' ')} cannot be used: {_sentence(error)}")
        return CompiledGrammar(self, text)


def _sentence(what: object) -> str:
    """An error's first line, as the end of one sentence."""
    line = str(what).strip().splitlines()[0] if str(what).strip() else "unknown error"
    return line if line.endswith(".") else line + "."


@dataclass(frozen=True)
class CompiledGrammar:
    compiler: GrammarCompiler
    text: str

    def start(self) -> Constraint:
        """A fresh state of the grammar for one generation."""
        return Constraint(self.compiler, self.text)


class Constraint:
    """One generation's place in its grammar."""

    def __init__(self, compiler: GrammarCompiler, grammar: str):
        llg = _llguidance()
        self._np = llg.numpy
        self._matcher = llg.LLMatcher(compiler.tokenizer, grammar, log_level=0)
        self._tokenizer = compiler.tokenizer
        self.vocab_size = compiler.vocab_size
        self._bitmask = self._np.allocate_token_bitmask(1, compiler.vocab_size)
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"The constraint failed: {_sentence(self._matcher.get_error())}")

    def allowed(self) -> np.ndarray:
        """``[V]`` bool: the tokens the grammar allows next (only end-of-sequence once it is complete)."""
        self._np.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def masks(self, chain: Sequence[int]) -> np.ndarray:
        """``[n, V]``: row ``j``'s allowed tokens after the chain's drafted tokens ``chain[1..j]`` (``chain[0]``, the
        root, is already consumed); the state is rolled back after."""
        n = len(chain)
        out = np.empty((n, self.vocab_size), dtype=bool)
        consumed = 0
        for j in range(n):
            out[j] = self.allowed()
            if j < n - 1 and not self._matcher.is_stopped():  # past its end only end-of-sequence may follow
                if not self._matcher.consume_token(int(chain[j + 1])):
                    raise GrammarError("A draft token the grammar refuses reached verification.")  # drafts are cut
                consumed += 1
        if consumed:
            self._matcher.rollback(consumed)
        return out

    def _take(self, tokens: Sequence[int]) -> int:
        """Consume ``tokens`` (a path the grammar was checked to take) up to the grammar's end, which takes only
        end-of-sequence after it; how many it consumed (to roll back)."""
        consumed = 0
        for t in tokens:
            if self._matcher.is_stopped():
                break
            if not self._matcher.consume_token(int(t)):
                raise GrammarError("A draft token the grammar refuses reached verification.")  # drafts are cut first
            consumed += 1
        return consumed

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar takes from here, in order."""
        return int(self._matcher.validate_tokens([int(t) for t in tokens])) if len(tokens) else 0

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (a free draft, certain to be accepted)."""
        return [int(t) for t in self._matcher.compute_ff_tokens()]

    def ahead(self, after: Sequence[int] = ()) -> tuple[list[int], int]:
        """A free draft from here, or after ``after`` (tokens the grammar takes; the state is rolled back after):
        the tokens of every byte the grammar forces, and how many of them lead as the tokens it forces. Those are
        certain; the rest are the bytes' greedy tokenization, which the model writes most often (at a point where
        the forced bytes may end inside a longer token, llguidance forces only the tokens before it: after a key,
        ``":"`` is forced text, but not yet a forced token)."""
        consumed = self._take(after)
        out: tuple[list[int], int] = ([], 0)
        if not self._matcher.is_stopped():  # past its end nothing is forced, and asking would leave it in error
            forced = self.forced()
            raw = self._matcher.compute_ff_bytes()
            greedy = [int(t) for t in self._tokenizer.tokenize_bytes(raw)] if raw else []
            if len(greedy) > len(forced) and greedy[: len(forced)] == forced \
                    and self.valid_prefix(greedy) == len(greedy):
                out = (greedy, len(forced))
            else:
                out = (forced, len(forced))
        if consumed:
            self._matcher.rollback(consumed)
        return out

    def chain(self, draft: Sequence[int], budget: int) -> tuple[list[int], int]:
        """The draft tokens to verify after the root, at most ``budget - 1``, and how many of them lead as tokens
        the grammar forces (certain to be accepted). The drafter's ``draft`` is cut at the first token the grammar
        refuses; where the grammar's own draft from the root (:meth:`ahead`) reaches further, it replaces it;
        otherwise the grammar's draft after the draft's end is appended (a draft that stops where a key or a
        bracket follows gets them). Either way the grammar's tokens cost nothing to propose."""
        room = budget - 1
        if room < 1:
            return [], 0
        own, sure = self.ahead()
        keep = list(draft[: self.valid_prefix(draft)])[:room]
        if len(keep) <= len(own):
            return own[:room], min(sure, room)
        tail = self.ahead(keep)[0][: room - len(keep)] if len(keep) < room else []
        lead = next((i for i, (a, b) in enumerate(zip(keep, own[:sure])) if a != b), min(sure, len(keep)))
        return keep + tail, lead

    def draft(self, tree: DraftTree, budget: int) -> tuple[DraftTree, int]:
        """A drafter's ``tree`` as this step verifies it under the grammar, and how many of its draft tokens lead
        as tokens the grammar forces: a tree pruned to the paths the grammar takes where it forces nothing next
        (``tree`` itself where it takes them all), else a chain with the grammar's own tokens (:meth:`chain`),
        which are drafted whatever the drafter or the load gate said and, certain, weighed at their value by a
        batch's rows rule."""
        if not tree.is_chain and not self.forced():
            keep = np.flatnonzero(self.tree_valid(tree.tokens, tree.parents))
            if keep.size == tree.num_nodes:
                return tree, 0
            where = np.full(tree.num_nodes, -1, dtype=np.int64)
            where[keep] = np.arange(keep.size)
            parents = np.where(tree.parents[keep] >= 0, where[np.maximum(tree.parents[keep], 0)], -1)
            return DraftTree(tree.tokens[keep], parents), 0
        path = tree.main_path().tokens
        draft, certain = self.chain(path[1:].tolist(), budget)
        if draft == path[1:].tolist() and tree.is_chain:
            return tree, certain
        return DraftTree.chain([int(path[0]), *draft]), certain

    def mask(self, tokens: Sequence[int], logits: np.ndarray, parents: Sequence[int] | None = None) -> np.ndarray:
        """The rows of a chain (``tokens``: its root, then its drafts) or of a tree (``parents`` given) as
        acceptance sees them under the grammar: node ``i``'s row masked with the grammar's state after the drafted
        tokens on its path."""
        allowed = self.masks(tokens) if parents is None else self._walk(tokens, parents, rows=True)[1]
        return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def tree_valid(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """``[N]`` bool: the tree's nodes whose drafted path the grammar takes (the root always)."""
        return self._walk(tokens, parents, rows=False)[0]

    def _walk(self, tokens: Sequence[int], parents: Sequence[int], rows: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Each node's path consumed in turn (rolled back to the common prefix between nodes, and wholly after):
        whether the grammar takes it, and with ``rows`` the tokens it allows after it."""
        n = len(tokens)
        ok = np.zeros(n, dtype=bool)
        ok[0] = True
        out = np.empty((n, self.vocab_size), dtype=bool) if rows else None
        paths: list[tuple[int, ...]] = [()] * n
        stack: list[int] = []  # the nodes whose tokens the matcher holds now, root first
        for i in range(n):
            if i:
                p = int(parents[i])
                if not ok[p]:
                    continue
                paths[i] = (*paths[p], i)
            path = paths[i][:-1] if not rows else paths[i]  # validity: the parent's state, then the token
            common = next((k for k, (a, b) in enumerate(zip(stack, path)) if a != b), min(len(stack), len(path)))
            if len(stack) > common:
                self._matcher.rollback(len(stack) - common)
                del stack[common:]
            stack += path[common:][: self._take([tokens[node] for node in path[common:]])]
            if i and not rows:
                ok[i] = not self._matcher.is_stopped() and self.valid_prefix([int(tokens[i])]) == 1
            elif i:
                ok[i] = True
            if rows:
                out[i] = self.allowed()
        if stack:
            self._matcher.rollback(len(stack))
        return ok, out

    def advance(self, tokens: Sequence[int]) -> None:
        """The generation emitted ``tokens``."""
        for t in tokens:
            if self._matcher.is_stopped():  # complete: what follows is end-of-sequence, which ends the generation
                break
            self._matcher.consume_token(int(t))
        self._check()
