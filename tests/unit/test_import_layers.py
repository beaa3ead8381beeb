"""The layers of `stages` (docs/layout.md), checked on every module's imports, read with `ast`:

    verbs        stages/<verb>.py: entry points (python -m stages.<verb>), imported by no module, a verb included
    nouns        stages/<package>/: the libraries, their packages importing each other without a cycle
    settings     sections.py < settings.py, sweeps.py, config.py: torch-free
    facts        the torch-free facts the config check reads (a family's config, quant variants, ...)
    foundation   errors.py, stage_logs.py, config_sources.py, schema.py (the schema and its defaults),
                 provenance/

A module imports only from its own layer or those below; no import cycle, at any level; the
settings and facts layers import no torch (nor numpy, transformers, ...), so that parsing the workflow
stays fast. An import inside a function (a lazy import) must keep something heavy out of the
importer: the target loads at import time a heavy package the importer does not (the reason, which
a failure names); anything else is imported at module level.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from stages.provenance.code import PACKAGE_DIR, lazy_homes, module_file

# third-party packages whose import costs a parse of the workflow (torch alone is ~1 s)
HEAVY = frozenset({"torch", "transformers", "peft", "deepspeed", "onnxruntime", "onnxruntime_genai", "onnx",
                   "numpy", "pandas", "matplotlib", "datasets", "safetensors", "tokenizers", "sacrebleu",
                   "rouge_score", "gguf", "scipy"})
FOUNDATION = {"stages", "stages.errors", "stages.stage_logs", "stages.config_sources", "stages.schema"}
SETTINGS = {"stages.sections", "stages.settings", "stages.sweeps", "stages.config"}
LAYERS = ("foundation", "facts", "settings", "nouns", "verbs")


def _module_name(path: Path) -> str:
    return ".".join(("stages", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)).removesuffix(".__init__")


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


@functools.lru_cache(maxsize=None)
def imports(module: str) -> tuple[tuple[str, bool, int], ...]:
    """(imported module, inside a function?, line) for every import of `module` outside `if
    TYPE_CHECKING:`; `from stages.pkg import name` resolves to the module `name` or, for a lazy
    package, to the module its `_HOMES` table names."""
    found: list[tuple[str, bool, int]] = []

    def walk(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, inner, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{module}:{child.lineno}: relative import (the package imports by absolute names)"
                homes = lazy_homes(child.module) if child.module.split(".")[0] == "stages" else {}
                for alias in child.names:
                    name = f"{child.module}.{alias.name}"
                    target = name if module_file(name) else homes.get(alias.name, child.module)
                    found.append((target, inner, child.lineno))
            walk(child, inner)

    walk(ast.parse(MODULES[module].read_text()), False)
    return tuple(found)


def stages_imports(module: str, lazy: bool | None = None) -> set[str]:
    return {t for t, inner, _ in imports(module) if t in MODULES and t != module and (lazy is None or inner == lazy)}


@functools.lru_cache(maxsize=None)
def heavy(module: str) -> frozenset[str]:
    """The heavy packages that importing `module` loads: its module-level imports, transitively,
    and the packages Python imports before it."""
    loaded: set[str] = set()
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(p for p in (".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)) if p in MODULES)
        for target, inner, _ in imports(m):
            if inner:
                continue
            if target.split(".")[0] in HEAVY:
                loaded.add(target.split(".")[0])
            elif target in MODULES:
                todo.append(target)
    return frozenset(loaded)


def facts() -> set[str]:
    """The modules below the settings layer that it imports, transitively."""
    todo = [t for m in SETTINGS for t in stages_imports(m)]
    seen: set[str] = set()
    while todo:
        m = todo.pop()
        if m in seen or m in FOUNDATION or m in SETTINGS or m.startswith("stages.provenance"):
            continue
        seen.add(m)
        todo.extend(stages_imports(m))
    return seen


FACTS = facts()


def layer(module: str) -> str:
    if module in FOUNDATION or module.startswith("stages.provenance"):
        return "foundation"
    if module in FACTS:
        return "facts"
    if module in SETTINGS:
        return "settings"
    return "verbs" if module.count(".") == 1 and MODULES[module].name != "__init__.py" else "nouns"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (its nodes in order), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_a_layer_above_its_own_nor_a_verb():
    wrong = [f"{m} ({layer(m)}) imports {t} ({layer(t)})" for m in MODULES for t in sorted(stages_imports(m))
             if LAYERS.index(layer(t)) > LAYERS.index(layer(m)) or layer(t) == "verbs"]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules_nor_between_packages():
    graph = {m: stages_imports(m) for m in MODULES}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    package = {m: m.split(".")[1] if m.count(".") >= 2 else None for m in MODULES}
    packages: dict[str, set[str]] = {}
    for m, targets in graph.items():
        if package[m]:
            packages.setdefault(package[m], set()).update(package[t] for t in targets
                                                          if package[t] and package[t] != package[m])
    assert _cycle(packages) is None, "packages: " + " -> ".join(_cycle(packages))


@pytest.mark.parametrize("low", ["foundation", "facts", "settings"])
def test_the_layers_under_the_nouns_import_no_heavy_package(low):
    loaded = {m: sorted(heavy(m)) for m in MODULES if layer(m) == low and heavy(m)}
    assert not loaded, loaded


def test_an_import_inside_a_function_keeps_a_heavy_package_out():
    """A lazy `stages` import is there to keep the importer light: the target loads a heavy package
    that the importer itself does not, or a `# lazy:` comment names another reason. Anything else is
    imported at module level (a lazy import to dodge a cycle hides a layering fault, which the tests
    above would then name)."""
    needless = [f"{m}:{line} imports {t} inside a function; {t} loads "
                f"{sorted(heavy(t)) or 'nothing heavy'}, which {m} loads already or nothing: import it at the top"
                for m in MODULES for t, inner, line in imports(m)
                if inner and t in MODULES and not heavy(t) - heavy(m) and not _says_lazy(m, line)]


def _says_lazy(module: str, line: int) -> bool:
    """A lazy import kept for another reason says so: `# lazy: <reason>` on its line or just above."""
    return any("# lazy:" in text for text in MODULES[module].read_text().splitlines()[max(0, line - 4):line])
    assert not needless, "\n".join(needless)


def test_an_import_inside_a_function_says_why():
    """Each lazy `stages` import carries its reason: a comment on its line or just above it."""
    silent = []
    for m in MODULES:
        lines = MODULES[m].read_text().splitlines()
        for target, inner, line in imports(m):
            if inner and target in MODULES and not any("#" in text for text in lines[max(0, line - 4):line]):
                silent.append(f"{m}:{line} imports {target} inside a function without a comment saying why "
                              f"(it keeps {sorted(heavy(target) - heavy(m))} out)")
    assert not silent, "\n".join(silent)


def test_the_layers_are_populated_as_documented():
    """Guards the test itself: each layer holds what docs/layout.md says."""
    assert {"stages.model.config", "stages.quant.variants", "stages.checkpoint.source"} <= FACTS
    assert {"stages.evaluate", "stages.pretrain", "stages.serve"} <= {m for m in MODULES if layer(m) == "verbs"}
    assert "torch" in heavy("stages.training.engine") and not heavy("stages.config")
