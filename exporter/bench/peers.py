"""Peers for ``specdeploy bench``: onnxruntime-genai (fp32 and int4) and llama.cpp, on the same model.

They run in the same bench as our variants, on the same prompt token ids, greedily:

``ort-genai-fp32`` / ``ort-genai-int4``
    onnxruntime-genai's model builder converts the bundle's source model from its fp32 safetensors
    folder (:func:`specdeploy.exporter.source.cached_hf_folder`: the dequantized cache of a GGUF, or the
    HF folder itself; the builder rejects GGUF Q4_1 input). The build runs once, offline
    (``HF_HUB_OFFLINE=1``: the builder reads the local folder and must not reach a hub), into
    ``<specdeploy cache>/peers/<weights sha>/ort-genai-<precision>-<version>/``, shared by every bundle
    of that model. The builder's own CPU defaults apply (int4: blocks of 32, ``accuracy_level`` 4).
    Structured prompts decode under genai's own guidance (llguidance) with the schema llama.cpp gets below
    (:func:`constraint_schema`), its JSON written compactly as ours is; an onnxruntime-genai without
    ``GeneratorParams.set_guidance`` is skipped on structured prompt sets.
``llama.cpp``
    llama-cpp-python on the GGUF the bundle was exported from (``manifest.source.path``), so the
    weights are the shipped quantized ones (SmolLM2: Q4_1). A bundle exported from a HF folder has no
    GGUF: the variant is skipped with a note. Structured prompts decode under ``LlamaGrammar.from_json_schema``
    of :func:`constraint_schema`.

All peers take the bench's ``--threads``. Their numerics differ from ours (other kernels, other
quantization), so ``identical_to_ar`` is reported as measured: differences are expected, not hidden.
A missing package skips the variant with a note (``pip install 'specdeploy[peers]'``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from specdeploy.exporter.bench.spec import (
    Runner,
    RunResult,
    Score,
    StructuredPrompt,
    VariantSpec,
    score_logits,
)
from specdeploy.exporter.bench.structured import Constraint, tool_call_schema
from specdeploy.runtime.bundle import BundleManifest
from specdeploy.runtime.errors import SpecDeployError

PEERS_INSTALL = "pip install 'specdeploy[peers]'"
GENAI_BUILD_TIMEOUT_S = 1800


class PeerError(SpecDeployError):
    """A peer could not be prepared (model build failed, missing source file)."""


def _gguf_source(manifest: BundleManifest) -> Path | None:
    """The GGUF the bundle was exported from, or None when its source is a HF folder."""
    if manifest.source.format != "gguf":
        return None
    path = Path(manifest.source.path)
    if not path.is_file():
        from specdeploy.exporter.source import resolve_model_path

        try:  # the embedded default model is recorded by path; resolve it again if it moved
            path = resolve_model_path(None)
        except SpecDeployError:
            return None
    return path


def constraint_schema(constraint: Constraint) -> dict:
    """The JSON schema a peer decodes a structured prompt under: the response format's schema (``{"type": "object"}``
    for ``json_object``); for tools, one call written as JSON ``{"name": ..., "arguments": {...}}`` of one of them
    (:func:`tool_call_schema`: the peers have no tool calling of their own at the token level)."""
    if constraint.tools is not None:
        return tool_call_schema(constraint.tools)
    schema = constraint.schema
    return {"type": "object"} if schema is None else schema


# --- onnxruntime-genai -----------------------------------------------------------------------------
# genai's guidance is llguidance, as our runtime's: JSON written compactly as ours is (runtime/grammar.py), not
# llguidance's default free whitespace, which spends tokens on indentation that our answers do not have.
GENAI_JSON_STYLE = {"x-guidance": {"whitespace_flexible": False}}


def genai_model_dir(manifest: BundleManifest, precision: str) -> Path:
    """Where the genai build of the bundle's source model at ``precision`` is cached."""
    from specdeploy.exporter.source import cache_root

    version = importlib.metadata.version("onnxruntime-genai")
    return cache_root() / "peers" / manifest.source.weight_sha[:16] / f"ort-genai-{precision}-{version}"


def build_genai_model(manifest: BundleManifest, precision: str, threads: int) -> Path:
    """Run onnxruntime-genai's model builder once (offline) and return the model folder."""
    from specdeploy.exporter.source import cached_hf_folder

    dest = genai_model_dir(manifest, precision)
    if (dest / "genai_config.json").is_file():
        return dest
    src = cached_hf_folder(manifest.source.path)  # fp32 safetensors + config.json with `architectures`
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(tmp / "model"),
           "-p", precision, "-e", "cpu", "-c", str(tmp / "cache")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads))
    print(f"[ort-genai] building the {precision} model once into {dest} ...", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=GENAI_BUILD_TIMEOUT_S)
        if proc.returncode != 0 or not (tmp / "model" / "genai_config.json").is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise PeerError(f"onnxruntime-genai's model builder failed on '{src}' (exit {proc.returncode}):\n{tail}")
        os.replace(tmp / "model", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


class _GenaiHasGuidance:
    """``OrtGenaiRunner.constrains``, which the parent bench reads on structured prompt sets: whether the installed
    onnxruntime-genai has guidance (``GeneratorParams.set_guidance``). Without it the variant is skipped there,
    rather than timed on unconstrained answers."""

    def __get__(self, obj: object, owner: type | None = None) -> bool:
        import onnxruntime_genai as og

        return hasattr(og.GeneratorParams, "set_guidance")


class OrtGenaiRunner(Runner):
    """onnxruntime-genai greedy decoding of the builder's model (``options``: precision); a structured prompt decodes
    under genai's guidance of :func:`constraint_schema` (``json_schema``)."""

    constrains = _GenaiHasGuidance()

    @classmethod
    def unavailable(cls, spec: VariantSpec, manifest: BundleManifest) -> str | None:
        if genai_model_dir(manifest, dict(spec.options).get("precision", "int4")).joinpath("genai_config.json").is_file():
            return None
        if not Path(manifest.source.path).exists() and _gguf_source(manifest) is None:
            return (f"skipped: the bundle's source model '{manifest.source.path}' is not on this machine; "
                    "onnxruntime-genai's model builder needs it.")
        return None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        import onnxruntime_genai as og

        self.og = og
        precision = dict(self.spec.options).get("precision", "int4")
        model_dir = build_genai_model(self.manifest, precision, self.threads)
        config = og.Config(str(model_dir))
        config.clear_providers()  # the CPU provider
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": self.threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)
        self.eos = {int(e) for e in self.manifest.model.eos_token_ids}
        self.speculative = dict(dict(self.spec.options).get("speculative", ()))  # genai's own n-gram mode, if set

    def generate(self, ids: list[int], max_new_tokens: int, structured: StructuredPrompt | None = None) -> RunResult:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens, batch_size=1)
        speculative = self.speculative
        if speculative:
            params.set_speculative_options(**speculative)
        if structured is not None:
            # enable_ff_tokens stays False: forced tokens are then decoded one per call like the rest, so
            # get_next_tokens() hands out every token (with it on, it leaves the forced ones out).
            schema = constraint_schema(structured.constraint) | GENAI_JSON_STYLE
            params.set_guidance("json_schema", json.dumps(schema))
        gen = og.Generator(self.model, params)  # compiles the grammar: before the clock starts, as for llama.cpp
        t0 = time.perf_counter()
        gen.append_tokens(ids)  # the prefill runs here
        tokens: list[int] = []
        t_first = None
        while not gen.is_done() and len(tokens) < max_new_tokens:
            gen.generate_next_token()  # speculating, it verifies drafts inside and hands out one token per call
            tokens.append(int(gen.get_next_tokens()[0]))
            if t_first is None:
                t_first = time.perf_counter()
            if tokens[-1] in self.eos:
                break
        t1 = time.perf_counter()
        stats = gen.get_speculative_stats() if speculative else None
        del gen
        finish = "stop" if tokens and tokens[-1] in self.eos else "length"
        # Speculating, genai emits verified tokens one per call, so per-step counts come from its own telemetry.
        profile = ({k: stats.get(k) for k in ("rounds", "draft_tokens_proposed", "draft_tokens_accepted",
                                              "acceptance_rate", "effective_k", "standard_fallback_steps",
                                              "target_forward_passes")} if stats else None)
        return RunResult(tokens, t1 - t0, 1, t1 - (t_first or t1),
                         None if speculative else [1] * max(0, len(tokens) - 1), None, finish, profile=profile)

    def score(self, ids: list[int]) -> Score:
        """Teacher-forced logits, one appended token at a time (the generator keeps the last position's)."""
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + 1, batch_size=1)
        gen = og.Generator(self.model, params)
        rows = []
        for t in ids:
            gen.append_tokens([t])
            rows.append(np.asarray(gen.get_logits(), dtype=np.float32).reshape(-1))
        del gen
        return score_logits(np.stack(rows), ids)


# --- llama.cpp -------------------------------------------------------------------------------------
# Runs in a fresh interpreter: load the GGUF and greedily decode two tokens. argv: gguf path, mode.
_LLAMA_PROBE = """
import sys
import llama_cpp
from llama_cpp import llama as _llama
if sys.argv[2] == "plain":
    _default = llama_cpp.llama_model_default_params
    def _params():
        p = _default()
        p.use_extra_bufts = False
        return p
    _llama.llama_cpp.llama_model_default_params = _params
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False)
ids = llm.tokenize(b"Hello, my name is")
for n, _ in enumerate(llm.generate(ids, top_k=1, temp=0.0)):
    if n >= 1:
        break
"""
# llama.cpp-lookup's draft length: the shortest, since longer drafts lost more on these CPUs (10 tokens ran 0.55x
# its plain decoding, 3 tokens 0.77x; AMD EPYC, AVX-512, 16 prompts x 128 tokens).
LLAMA_LOOKUP_TOKENS = 2
LLAMA_MODES = ("extra", "plain")  # extra: llama.cpp's extra CPU buffer types (AMX, repacked weights)


def llama_cpp_mode(gguf: Path) -> str | None:
    """How llama.cpp runs ``gguf`` on this machine: "extra", "plain", or None (it crashes either way).

    A build with ``-march=native`` can compile in AMX kernels that a sandboxed or virtualized CPU then
    refuses (SIGILL, seen here): without the extra buffer types llama.cpp uses its plain CPU kernels.
    Each mode is tried once in a subprocess; the answer is cached per llama-cpp-python version and GGUF.
    """
    from specdeploy.exporter.source import cache_root

    version = importlib.metadata.version("llama_cpp_python")
    key = f"{version}:{gguf.resolve()}:{gguf.stat().st_size}"
    cache = cache_root() / "peers" / "llama_cpp_modes.json"
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    if key in known:
        return known[key]
    mode = None
    for candidate in LLAMA_MODES:
        try:
            proc = subprocess.run([sys.executable, "-c", _LLAMA_PROBE, str(gguf), candidate], check=False,
                                  capture_output=True, timeout=300)
        except subprocess.TimeoutExpired:
            continue
        if proc.returncode == 0:
            mode = candidate
            break
    known[key] = mode
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, cache)
    return mode


class LlamaCppRunner(Runner):
    """llama-cpp-python greedy decoding of the bundle's source GGUF; a structured prompt's JSON schema (or its tools'
    calls as JSON) becomes a ``LlamaGrammar`` passed as ``grammar=``."""

    constrains = True

    @classmethod
    def unavailable(cls, spec: VariantSpec, manifest: BundleManifest) -> str | None:
        gguf = _gguf_source(manifest)
        if gguf is None:
            return (f"skipped: the bundle was exported from '{manifest.source.path}', not a GGUF file; "
                    "llama.cpp needs the GGUF.")
        if llama_cpp_mode(gguf) is None:
            return (f"skipped: llama-cpp-python crashes decoding '{gguf.name}' on this machine, with and without "
                    "its extra CPU buffer types; rebuild it for this CPU (CMAKE_ARGS='-DGGML_NATIVE=OFF').")
        return None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        import llama_cpp

        gguf = _gguf_source(self.manifest)
        mode = llama_cpp_mode(gguf) if gguf is not None else None
        if gguf is None or mode is None:
            raise PeerError(self.unavailable(self.spec, self.manifest) or "llama.cpp cannot run here")
        if mode == "plain":  # see llama_cpp_mode: no AMX / repacked buffers on this CPU
            default = llama_cpp.llama_model_default_params

            def params():
                p = default()
                p.use_extra_bufts = False
                return p

            llama_cpp.llama.llama_cpp.llama_model_default_params = params
        self.mode = mode
        lookup = int(dict(self.spec.options).get("lookup_tokens", 0))
        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        self.gguf, self.llama_cpp = gguf, llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=self.manifest.limits.max_context, n_batch=512,
                                   n_threads=self.threads, n_threads_batch=self.threads, verbose=False,
                                   draft_model=draft, logits_all=draft is not None)  # its draft verify reads them all
        self.eos = {int(e) for e in self.manifest.model.eos_token_ids} | {int(self.llm.token_eos())}
        how = f"prompt lookup, {lookup} tokens" if lookup else "plain"
        print(f"[llama.cpp] {gguf.name}, mode {mode}, {how}, {self.threads} threads", file=sys.stderr, flush=True)

    def generate(self, ids: list[int], max_new_tokens: int, structured: StructuredPrompt | None = None) -> RunResult:
        grammar = self._grammar(structured) if structured is not None else None  # built before the clock starts
        self.llm.reset()  # no KV prefix reuse from the previous prompt: every prompt pays its prefill
        tokens: list[int] = []
        t_first = None
        t0 = time.perf_counter()
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True,
                                     grammar=grammar):
            tokens.append(int(tok))
            if t_first is None:
                t_first = time.perf_counter()
            if tokens[-1] in self.eos or len(tokens) >= max_new_tokens:
                break
        t1 = time.perf_counter()
        finish = "stop" if tokens and tokens[-1] in self.eos else "length"
        # llama-cpp-python reports no per-step counts for its draft model: no tau for the lookup variant
        accepted = None if self.llm.draft_model is not None else [1] * max(0, len(tokens) - 1)
        return RunResult(tokens, t1 - t0, 1, t1 - (t_first or t1), accepted, None, finish)

    def _grammar(self, structured: StructuredPrompt) -> Any:
        """llama.cpp's grammar for the prompt's JSON schema; for tools, one call written as JSON ``{"name": ...,
        "arguments": {...}}`` of one of them (llama.cpp has no tool calling of its own at the token level)."""
        schema = constraint_schema(structured.constraint)
        return self.llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)

    def score(self, ids: list[int]) -> Score:
        """The GGUF's logits at every position (a second context that keeps them all)."""
        if getattr(self, "_scorer", None) is None:
            self._scorer = self.llama_cpp.Llama(model_path=str(self.gguf), n_ctx=512, n_batch=512, logits_all=True,
                                                n_threads=self.threads, n_threads_batch=self.threads,
                                                verbose=False)
        self._scorer.reset()
        self._scorer.eval(ids)
        return score_logits(self._scorer.scores[:len(ids)], ids)


# onnxruntime-genai's n-gram speculation on its adaptive setting: drafts of up to 5 tokens from 3-grams of the
# context, the draft length adapted between min_adaptive_k and 5 by its own throughput estimate.
GENAI_NGRAM = (("ngram_size", 3), ("max_draft_tokens", 5), ("min_adaptive_k", 1))
_NUMERICS = "; other numerics than ours, so outputs may differ from ar"
_GUIDED = "; structured sets decode under genai's guidance (llguidance, the prompts' JSON schema)"
PEER_VARIANTS = (
    VariantSpec("ort-genai-fp32", "ort-genai", "onnxruntime-genai fp32 (model builder on the fp32 source)"
                + _GUIDED + _NUMERICS,
                options=(("precision", "fp32"),), requires=("onnxruntime_genai", "transformers", "torch"),
                install=PEERS_INSTALL),
    VariantSpec("ort-genai-int4", "ort-genai", "onnxruntime-genai int4 (model builder, CPU defaults)"
                + _GUIDED + _NUMERICS,
                options=(("precision", "int4"),), requires=("onnxruntime_genai", "transformers", "torch"),
                install=PEERS_INSTALL),
    VariantSpec("ort-genai-fp32-ngram", "ort-genai", "onnxruntime-genai fp32 with its n-gram speculative decoding "
                "(adaptive draft length)" + _GUIDED + _NUMERICS,
                options=(("precision", "fp32"), ("speculative", GENAI_NGRAM)), plain="ort-genai-fp32",
                requires=("onnxruntime_genai", "transformers", "torch"), install=PEERS_INSTALL),
    VariantSpec("ort-genai-int4-ngram", "ort-genai", "onnxruntime-genai int4 with its n-gram speculative decoding "
                "(adaptive draft length)" + _GUIDED + _NUMERICS,
                options=(("precision", "int4"), ("speculative", GENAI_NGRAM)), plain="ort-genai-int4",
                requires=("onnxruntime_genai", "transformers", "torch"), install=PEERS_INSTALL),
    VariantSpec("llama.cpp", "llama.cpp", "llama.cpp (llama-cpp-python) greedy on the source GGUF" + _NUMERICS,
                requires=("llama_cpp",), install=PEERS_INSTALL),
    VariantSpec("llama.cpp-lookup", "llama.cpp", f"llama.cpp (llama-cpp-python) with its prompt-lookup decoding "
                f"(LlamaPromptLookupDecoding, {LLAMA_LOOKUP_TOKENS} tokens)" + _NUMERICS,
                options=(("lookup_tokens", LLAMA_LOOKUP_TOKENS),), requires=("llama_cpp",), install=PEERS_INSTALL,
                plain="llama.cpp"),
)
PEER_RUNNERS: dict[str, type[Runner]] = {"ort-genai": OrtGenaiRunner, "llama.cpp": LlamaCppRunner}
