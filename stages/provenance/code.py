"""The code a stage runs, found by reading its source, not by importing it.

Snakemake's `code` trigger sees only a `shell:` rule's text, never the Python that text calls. So
each rule carries the files of its stage module and of every `stages` module that module imports,
transitively (imports inside functions included), as params (workflow/rules/common.smk): editing
`stages/quant/gptq.py` reruns the jobs whose code reaches it and what depends on them, and editing
docs, tests or bench reruns nothing. The imports are read from the source text, so the workflow
computes this while it is parsed, in milliseconds and without importing torch.

The lazy packages (`stages.model`, `stages.quant`, `stages.adapters`) load a name's module on first
use from their `_HOMES` table: `from stages.quant import load_quantized` reaches `stages.quant.loader`
and no other module of the package. The package imports itself by absolute names only (`from stages.x
import y`); relative imports are not read. Not counted: what a module reads that is not Python (the
config schema reaches the jobs through their params, which are compared anyway)."""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

PACKAGE = "stages"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
ROOT = PACKAGE_DIR.parent


@lru_cache(maxsize=None)
def module_file(module: str) -> Path | None:
    """stages.a.b -> stages/a/b.py or stages/a/b/__init__.py; None for no such module."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = PACKAGE_DIR.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _parents(module: str) -> list[str]:
    """The packages Python imports before `module`: stages, stages.quant for stages.quant.gptq."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@lru_cache(maxsize=None)
def _lines(module: str) -> tuple[str, ...]:
    """The module's source lines, without those under `if TYPE_CHECKING:` (imports only a type
    checker runs)."""
    kept, skip_deeper_than = [], None
    for line in module_file(module).read_text().splitlines():
        indent = len(line) - len(line.lstrip())
        if skip_deeper_than is not None:
            if not line.strip() or indent > skip_deeper_than:
                continue
            skip_deeper_than = None
        if _TYPE_CHECKING.match(line):
            skip_deeper_than = indent
            continue
        kept.append(line)
    return tuple(kept)


_TYPE_CHECKING = re.compile(r"^\s*if\s+(typing\.)?TYPE_CHECKING\s*:")
# `from stages.x import a, b` (names possibly in parentheses over several lines) or `import stages.x`
_IMPORT = re.compile(rf"^[ \t]*(?:from[ \t]+({PACKAGE}(?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)"
                     rf"|import[ \t]+({PACKAGE}(?:\.\w+)*))", re.M)
# importlib.import_module("stages.x") or import_module(f"stages.x.{name}")
_IMPORT_MODULE = re.compile(r"import_module\(\s*(f?)[\"']([\w.]+)")
_HOMES_TABLE = re.compile(r"^_HOMES\s*=\s*(\{[^}]*\})", re.M)


@lru_cache(maxsize=None)
def lazy_homes(package: str) -> dict[str, str]:
    """A lazy package's `_HOMES` table: exported name -> the module that defines it."""
    path = module_file(package)
    if path is None or path.name != "__init__.py":
        return {}
    match = _HOMES_TABLE.search(path.read_text())
    if match is None:
        return {}
    return {name: f"{package}.{home}" for name, home in ast.literal_eval(match.group(1)).items()}


def _submodules(prefix: str) -> list[str]:
    """Every module whose name starts with `prefix` (an import_module(f"{prefix}...") we cannot read)."""
    package = prefix.rstrip(".")
    directory = module_file(package)
    if directory is None or directory.name != "__init__.py":
        return [package] if directory is not None else []
    return [PACKAGE + "." + ".".join(p.relative_to(PACKAGE_DIR).with_suffix("").parts).removesuffix(".__init__")
            for p in sorted(directory.parent.rglob("*.py"))]


def _names(imported: str) -> list[str]:
    """`a, b as c` or `(a,\n b,  # note\n)` -> ["a", "b"]."""
    text = re.sub(r"#[^\n]*", "", imported).strip("() \t\n\\")
    return [part.split()[0] for part in text.split(",") if part.strip()]


@lru_cache(maxsize=None)
def direct_imports(module: str) -> frozenset[str]:
    """The `stages` modules that running `module` may import directly (top level or inside functions).
    Read with regular expressions, not parsed: this runs while Snakemake parses the workflow, for
    every module of the package, and must take milliseconds."""
    source = "\n".join(_lines(module))
    found: set[str] = set()
    for match in _IMPORT.finditer(source):
        package, names, plain = match.groups()
        if plain:
            found.add(plain)
            continue
        found.add(package)
        homes = lazy_homes(package)
        for name in _names(names):
            if module_file(f"{package}.{name}") is not None:
                found.add(f"{package}.{name}")
            elif name in homes:
                found.add(homes[name])
    if not lazy_homes(module):  # a lazy package's own import_module serves the names above
        for is_fstring, name in _IMPORT_MODULE.findall(source):
            if name.split(".")[0] == PACKAGE:
                found.update(_submodules(name) if is_fstring else [name])
    found = {m for m in found if module_file(m) is not None}
    return frozenset(found | {p for m in found for p in _parents(m)} | set(_parents(module)))


def closure(roots: Iterable[str], exclude: Iterable[str] = ()) -> list[str]:
    """`roots` and every `stages` module they import, transitively, not entering `exclude`."""
    return list(_closure(tuple(roots), frozenset(exclude)))


@lru_cache(maxsize=None)
def _closure(roots: tuple[str, ...], excluded: frozenset[str]) -> tuple[str, ...]:
    seen: set[str] = set()
    todo = list(roots)
    for root in todo:
        if module_file(root) is None:
            raise ValueError(f"no module {root!r} under {PACKAGE_DIR}")
    while todo:
        module = todo.pop()
        if module in seen or module in excluded:
            continue
        seen.add(module)
        todo.extend(direct_imports(module))
    return tuple(sorted(seen))


@lru_cache(maxsize=None)
def file_digest(module: str) -> str:
    """The first 12 hex digits of the sha256 of the module's source file."""
    return hashlib.sha256(module_file(module).read_bytes()).hexdigest()[:12]


def source_path(module: str) -> str:
    """The module's file relative to the repository root, as a user edits it."""
    return module_file(module).relative_to(ROOT).as_posix()


def fingerprint(modules: Iterable[str]) -> str:
    """One digest of these modules' sources (16 hex digits): equal only if every file is."""
    lines = "".join(f"{source_path(m)} {file_digest(m)}\n" for m in sorted(set(modules)))
    return hashlib.sha256(lines.encode()).hexdigest()[:16]
