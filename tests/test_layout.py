"""The package's shape: its import graph (every import, lazy ones included) and the size of its files."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("exporter", "runtime", "graphs")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["specdeploy", *parts])


def modules() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module (of ours, or third-party top-level name) that `path` imports, wherever the import sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule when one exists.
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            found.update(subs or [mod])
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        deps = set()
        for dep in imports_of(name, path, known):
            # An import of a.b.c also runs a and a.b; count the deepest module of ours it names.
            while dep and dep not in known and dep.startswith("specdeploy."):
                dep = dep.rpartition(".")[0]
            if dep and dep != name:
                deps.add(dep)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among our modules, ignoring a package's imports of its own submodules (re-exports)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def edges(node):
        return [d for d in graph.get(node, ()) if d in graph and not d.startswith(node + ".")]

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in edges(node):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_import_directions():
    """runtime/ imports neither graphs/ nor exporter/ (nor torch/transformers); graphs/ imports neither."""
    rules = {"specdeploy.runtime": ("specdeploy.graphs", "specdeploy.exporter", "torch", "transformers"),
             "specdeploy.graphs": ("specdeploy.runtime", "specdeploy.exporter")}
    bad = []
    for name, path in modules().items():
        for folder, banned in rules.items():
            if name == folder or name.startswith(folder + "."):
                raw = imports_of(name, path, set(modules()))
                bad += [f"{name}: {dep}" for dep in sorted(raw) if dep.split(".")[0] in banned
                        or dep.startswith(banned)]
    assert not bad, bad


def test_the_graph_reader_sees_lazy_and_relative_imports(tmp_path):
    """The checks above cannot pass by reading nothing: the reader finds a known lazy import and cycle."""
    graph = import_graph()
    assert "specdeploy.runtime.errors" in graph["specdeploy.runtime.engine"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for folder in (*FOLDERS, "tests")
            for p in (ROOT / folder).rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_tests_live_in_their_folders():
    """runtime/, exporter/ and integration/ (real model, emulated CPU, GPU), each with its own conftest; only the
    repository-wide layout test and shared helper modules stay at the top."""
    tests = ROOT / "tests"
    for folder in ("runtime", "exporter", "integration"):
        assert (tests / folder / "conftest.py").is_file(), folder
        assert not (tests / folder / "__init__.py").exists()  # test modules import as top-level names
    assert sorted(p.name for p in tests.glob("test_*.py")) == ["test_layout.py"]
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test modules share a name"
    real = {"real_bundle", "real_quant_bundle"}
    for path in (tests / "runtime").glob("test_*.py"), (tests / "exporter").glob("test_*.py"):
        for p in path:
            used = {a.arg for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.FunctionDef)
                    for a in node.args.args}
            assert not used & real, f"{p.name} uses the real bundles: it belongs in tests/integration/"


def test_every_package_is_installed():
    """pyproject's explicit package list names every folder of code (a new room is not forgotten)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(p) for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


def test_runtime_drafter_modules_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, specdeploy.runtime.drafters.heads as h, specdeploy.runtime.drafters as d; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_heads_kinds_the_graphs_build_are_the_runtime_kinds():
    """graphs/ cannot import the runtime's list of kinds, so the two are checked here."""
    from specdeploy.graphs import kinds as graph_kinds
    from specdeploy.graphs.build import HEADS_BUILDERS
    from specdeploy.runtime.drafters.kinds import HEADS_KINDS, TRAINED_KINDS

    assert tuple(HEADS_BUILDERS) == HEADS_KINDS
    assert {graph_kinds.CHIMERA, graph_kinds.MEDUSA, graph_kinds.CERBERUS} == set(TRAINED_KINDS)


# The modules that may spell a draft kind's name: the descriptions themselves, and graphs/kinds.py, the names of
# the kinds graphs/ builds (graphs/ cannot import the runtime; the test above ties them to the descriptions).
KIND_NAME_HOMES = {"runtime/drafters/kinds.py", "graphs/kinds.py"}
KIND_NAME_ELSEWHERE = {  # (module, string): a string equal to a kind's name that does not mean the kind
    ("runtime/server_schema.py", "suffix"),  # the OpenAI completions request's `suffix` field, not the draft kind
}


def kind_name_literals(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, string) of every string constant in ``path`` equal to one of ``names``; docstrings do not count."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and node.value in names and id(node) not in docs]


def test_only_the_descriptions_spell_a_draft_kind():
    """Every module asks the draft-kind descriptions (runtime/drafters/kinds.py) rather than spelling a kind's name
    (``"chimera"``, ``"cerberus-nogate"``, ...) in a string. ``"auto"`` is left out: it is also a value of
    --device, --resume, --tree and --precision, and a string cannot tell which it means."""
    from specdeploy.runtime.drafters.kinds import AUTO, KINDS

    names = {k.name for k in KINDS} - {AUTO}
    assert {"chimera", "medusa", "cerberus", "cerberus-nogate", "ngram", "prompt-lookup", "suffix", "hybrid"} <= names
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel not in KIND_NAME_HOMES:
                found += [f"{rel}:{line}: {value!r}" for line, value in kind_name_literals(path, names)
                          if (rel, value) not in KIND_NAME_ELSEWHERE]
    assert not found, found
    assert kind_name_literals(ROOT / "runtime/drafters/kinds.py", names)  # the reader finds the names where they are


def test_each_draft_kind_names_code_that_resolves():
    """A description's lazily named code (``"module:function"``) imports and is callable; a trained kind names all
    of it, and every kind has a maker (its runtime drafter) and a bench variant."""
    from specdeploy.exporter.bench.variants import OWN_VARIANTS
    from specdeploy.runtime.drafters.kinds import KINDS, TRAINED_KINDS, resolve

    code = ("maker", "model", "builder", "trainer", "calibrator", "reference", "validate", "torch_maker")
    variants = {v.name for v in OWN_VARIANTS}
    for kind in KINDS:
        for field in code:
            dotted = getattr(kind, field)
            assert dotted is None or callable(resolve(dotted)), f"{kind.name}.{field} = {dotted}"
        if kind.name in TRAINED_KINDS:
            assert all(getattr(kind, field) for field in code), kind.name
        assert kind.maker and kind.bench_variant in variants, kind.name


def _calls(path: Path) -> set[str]:
    """The names of every function or method this file calls."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def test_one_decode_loop_owns_acceptance_and_the_stop_cut():
    # Acceptance (greedy, typical, seeded, rejection sampling) is decided in one place, decode.accept_step, and
    # the end-of-sequence and budget cut in decode.cut_at_stop, both called by the one decode step, and nothing else
    # in the runtime re-implements either.
    rules = {"greedy_accept", "sample_accept", "seeded_accept", "typical_accept"}
    owners = {"runtime/decode.py", "runtime/verify.py"}
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel not in owners:
            assert not (_calls(path) & rules), f"{rel} accepts drafts itself; call decode.accept_step"
        text = path.read_text()
        if rel != "runtime/decode.py":
            assert "in self.eos:\n" not in text.replace("tokens[-1] in self.eos:\n", ""), f"{rel} cuts at EOS itself"
    assert {"accept_step", "cut_at_stop"} <= _calls(ROOT / "runtime/decode.py")


def test_one_decode_step_for_one_sequence_and_many():
    # The decode loop's step (Decoder.step) is the only place that verifies drafts: ``generate`` runs it for one
    # generation and the batch scheduler for many, so the batch module steps the backend, accepts, cuts and
    # proposes nothing itself (it admits, evicts and cancels).
    calls = _calls(ROOT / "runtime/batch.py")
    assert not calls & {"accept_step", "cut_at_stop", "propose", "step_inputs", "rows_per_sequence"}, calls
    assert "step" in calls  # self.decoder.step
    body = (ROOT / "runtime/batch.py").read_text()
    assert "backend.step(" not in body and "DraftContext" not in body
    decode = (ROOT / "runtime/decode.py").read_text()
    generate = decode[decode.index("    def generate("):decode.index("def accept_step(")]
    assert "self.step([gen]" in generate and "backend.step(" not in generate


def test_no_private_name_crosses_a_module():
    # A name with a leading underscore is its module's own: no other module of the package imports it, and no
    # module reaches into another object's private attributes (``self``/``cls`` aside).
    for path in sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("specdeploy")):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not private, f"{path.relative_to(ROOT)} imports {private} from {node.module}"
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and target.attr.startswith("_") and not \
                            target.attr.startswith("__") and not (isinstance(target.value, ast.Name) and
                                                                target.value.id in ("self", "cls")):
                        raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} sets another object's "
                                             f"{target.attr}")
