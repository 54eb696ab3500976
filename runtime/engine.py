"""The embedding API: ``engine = load(bundle)``; ``engine.generate(...)`` and ``engine.stream(...)``.

    from specdeploy.runtime import load
    with load("bundle", draft="prompt-lookup") as engine:
        out = engine.generate("Write a haiku about CPUs.", max_new_tokens=64)
        print(out.text, out.stats.tokens_per_s)

One engine owns one backend session and is safe to share between threads: concurrent callers are
queued on a lock (the CPU backend runs batch 1), never interleaved.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from .backends import make_backend
from .bundle import BundleManifest, read_manifest
from .decode import DecodeStats, Decoder, GenerationConfig, SamplingParams
from .drafters import make_drafter
from .errors import PromptError, SpecDeployError
from .text import TextCodec


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: DecodeStats


@dataclass
class TextStream:
    """Iterator of text deltas; ``completion`` is set once it is exhausted."""

    _deltas: Iterator[str]
    completion: Completion | None = None
    _closed: bool = field(default=False, repr=False)

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        """Stop generating (e.g. the client went away); releases the engine for the next caller."""
        close = getattr(self._deltas, "close", None)
        if close is not None:
            close()


class Engine:
    def __init__(self, bundle: str | Path, backend: str = "ort-cpu", draft: str | None = None,
                 threads: int | None = None, tree: str | None = None, max_tree: int | None = None):
        self.bundle_dir = Path(bundle)
        self.manifest: BundleManifest = read_manifest(self.bundle_dir)
        self.codec = TextCodec(self.bundle_dir, self.manifest.tokenizer)
        self.backend = make_backend(backend, self.bundle_dir, self.manifest, threads=threads)
        self.draft_name = draft or "none"
        drafter = make_drafter(self.draft_name, self.bundle_dir, self.manifest, tree=tree, threads=threads)
        self.decoder = Decoder(self.backend, self.manifest, drafter, max_tree=max_tree)
        self._lock = threading.Lock()
        self._closed = False

    # --- prompts ----------------------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
               chat: bool = False) -> list[int]:
        if (prompt is None) == (messages is None):
            raise PromptError("Give either a prompt or a messages list, not both.")
        if messages is not None:
            return self.codec.encode_chat(messages)
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError("The prompt is empty.")
        if chat:
            return self.codec.encode_chat([{"role": "user", "content": prompt}])
        return self.codec.encode(prompt)

    # --- generation -------------------------------------------------------------------------
    def stream(self, prompt: str | None = None, messages: Sequence[dict] | None = None, *,
               max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               stop: Sequence[str] = (), seed: int | None = None, chat: bool = False,
               typical: bool = False) -> TextStream:
        """Stream text deltas. Validation happens here, before the first ``next()``."""
        if self._closed:
            raise SpecDeployError("This engine is closed.")
        ids = self.encode(prompt, messages, chat)
        config = GenerationConfig(max_new_tokens, SamplingParams(temperature, top_p, top_k, seed, typical))
        self.decoder.check_prompt(ids, config)
        stops = tuple(s for s in stop if s)
        stream = TextStream(iter(()))
        stream._deltas = self._run(ids, config, stops, stream)
        return stream

    def _run(self, ids: list[int], config: GenerationConfig, stops: tuple[str, ...],
             stream: TextStream) -> Iterator[str]:
        stats = DecodeStats()
        detok = self.codec.stream()
        hold = max((len(s) for s in stops), default=1) - 1  # chars that might start a stop string
        emitted_len, tokens, reason = 0, [], ""
        with self._lock:
            gen = self.decoder.generate(ids, config, stats)
            try:
                for tok in gen:
                    tokens.append(tok)
                    detok.push([tok])
                    text = detok.text
                    hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                    if hit >= 0:
                        if hit > emitted_len:
                            yield text[emitted_len:hit]
                        emitted_len, reason = hit, "stop"
                        break
                    safe = len(text) - hold if stops else len(text)
                    if safe > emitted_len:
                        yield text[emitted_len:safe]
                        emitted_len = safe
                else:
                    reason = stats.finish_reason
                    if len(detok.text) > emitted_len:
                        yield detok.text[emitted_len:]
                        emitted_len = len(detok.text)
            finally:
                gen.close()
        stats.finish_reason = reason or stats.finish_reason
        stream.completion = Completion(detok.text[:emitted_len], tuple(tokens), stats.finish_reason, stats)

    def generate(self, prompt: str | None = None, messages: Sequence[dict] | None = None, **kwargs) -> Completion:
        """Generate to completion; returns text, token ids, finish reason and stats."""
        stream = self.stream(prompt, messages, **kwargs)
        for _ in stream:
            pass
        assert stream.completion is not None
        return stream.completion

    def generate_ids(self, ids: list[int], config: GenerationConfig, stats: DecodeStats | None = None) -> list[int]:
        """Token-level generation (no text handling), used by the bench."""
        with self._lock:
            return list(self.decoder.generate(ids, config, stats))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.backend.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(bundle: str | Path, backend: str = "ort-cpu", draft: str | None = None, threads: int | None = None,
         tree: str | None = None, max_tree: int | None = None) -> Engine:
    """Open a bundle for decoding. ``draft``: None, "prompt-lookup", or a draft kind stored in the bundle."""
    return Engine(bundle, backend=backend, draft=draft, threads=threads, tree=tree, max_tree=max_tree)
