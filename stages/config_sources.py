"""Where the config came from: the files (and lines) a Snakemake run's config was merged from, so
that a config mistake is reported at the line the user wrote, as `my.yaml:7: ...`, without a
traceback.

Snakemake merges, in order: the workflow's `configfile:` (config/config.yaml), every `--configfile`
on the command line, then `--config KEY=VALUE`; a later source overrides an earlier one, so the
line named is the one in the last source that sets the key (the value in force). Two moments:
- before Snakemake reads the `--configfile` files (it reports a YAML error in one without file or
  line, and a missing one, typically a target written after `--configfile`, with a 20-line
  traceback): `check_command_line`, run by the workflow profile;
- while the workflow is parsed: `config_errors_reported` turns an InputError (bad key, bad value,
  impossible combination, missing data) into one line naming the file and line of the key path
  its message names.
Torch-free and light: the profile imports it on every `snakemake` command.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from stages.errors import ConfigError, InputError

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
CONFIGFILE_OPTIONS = ("--configfile", "--configfiles")
# A key path in an error message: `experiments.x.finetune.lora.lora_rnak`, `...corpus[0]`,
# `sweeps.s.grid` (values such as `=3` or `: ...` end it).
_KEY_PATH = re.compile(r"[^\s'\"=:,()]+")


class ConfigSyntaxError(ConfigError):
    """A config file that is not valid YAML; the message starts with `file:line:column`."""


def yaml_error(path: str | Path, e: yaml.YAMLError) -> str:
    """`file:line:column: problem (context)` for a YAML error (PyYAML's marks count from 0)."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return f"{path}: {e}"
    mark = e.problem_mark or e.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    context = ""
    if e.context and e.context_mark and e.context_mark is not mark:
        context = f" ({e.context} at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
    return f"{where}: {e.problem or e.context}{context}"


# --- before Snakemake: the --configfile list of the command line ---------------------------------

def configfile_arguments(argv: Sequence[str]) -> list[str]:
    """The paths given to --configfile/--configfiles in `argv`, as Snakemake's argparse reads them:
    every word after the option up to the next option or `--`."""
    paths: list[str] = []
    taking = False
    for word in argv:
        option, _, value = word.partition("=")
        if option in CONFIGFILE_OPTIONS:
            taking = not value
            paths += [value] if value else []
        elif word.startswith("-"):
            taking = False
        elif taking:
            paths.append(word)
    return paths


def configfile_problem(path: str) -> str | None:
    """Why Snakemake cannot read `path` as a config file (one line), or None when it can: a target
    swallowed by --configfile (a path under results/, where the workflow's outputs live; a missing
    .json; a directory, a binary file, any other file not named like a config that is no config), a
    missing .yaml, a YAML syntax error (file:line:column), a file that is not a mapping. Only
    results/ is refused that Snakemake's loader (JSON first, then YAML) would read."""
    swallowed = (f"{path} was read as a config file (--configfile takes every word after it): put targets "
                 "before --configfile, or end its list with --")
    if Path(path).parts[:1] == ("results",):
        return swallowed
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:  # a missing .json is rather a target (quant_eval.json) than a config file
        yaml_named = Path(path).suffix in (".yaml", ".yml")
        return f"{path}: no such config file (given to --configfile)" if yaml_named else swallowed
    except (OSError, UnicodeDecodeError):  # a directory, a binary file
        return swallowed
    problem = _content_problem(path, text)
    return swallowed if problem and Path(path).suffix not in CONFIG_SUFFIXES else problem


def _content_problem(path: str, text: str) -> str | None:
    try:
        content = json.loads(text)
        kind = None if isinstance(content, dict) else type(content).__name__
    except ValueError:
        try:  # syntax only (no construction), so every YAML loader agrees, Snakemake's included
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as e:
            return yaml_error(path, e)
        kind = None if isinstance(node, yaml.MappingNode) else "empty" if node is None else node.tag.split(":")[-1]
    return f"{path}: a config file is a mapping of keys (experiments: ...), not {kind}" if kind else None


def check_command_line(argv: Sequence[str] | None = None) -> None:
    """Stop (exit status 1, one line on stderr) when a --configfile of `argv` (sys.argv) cannot be
    read: Snakemake would stop there too, but without naming the file's line or the swallowed
    target. Run from workflow/profiles/default/config.yaml, before Snakemake reads the files."""
    for path in configfile_arguments(sys.argv[1:] if argv is None else argv):
        problem = configfile_problem(path)
        if problem:
            print(problem, file=sys.stderr, flush=True)
            raise SystemExit(1)


# --- while the workflow is parsed: the key paths of the merged files -----------------------------

@dataclass
class KeyNode:
    """A key of the merged config: where each source that sets it does so ((merge order,
    `file:line`), so the last one is in force) and the keys below it."""

    where: list[tuple[int, str]] = field(default_factory=list)
    children: dict[str | int, KeyNode] = field(default_factory=dict)


@dataclass
class ConfigKeys:
    """Every key path the sources set (a tree), and every key in merge order (for a key path whose
    experiment no file names: a sweep's member)."""

    root: KeyNode = field(default_factory=KeyNode)
    flat: list[tuple[str, str]] = field(default_factory=list)

    def add_yaml(self, node: yaml.Node, name: str, into: KeyNode | None = None) -> None:
        into = into or self.root
        if isinstance(node, yaml.MappingNode):
            items = [(k.value, k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)]
        elif isinstance(node, yaml.SequenceNode):
            items = [(i, v, v) for i, v in enumerate(node.value)]
        else:
            return
        for key, key_node, value in items:
            where = f"{name}:{key_node.start_mark.line + 1}"
            self._set(into, key, where)
            self.add_yaml(value, name, into.children[key])

    def add_mapping(self, mapping: Any, name: str, into: KeyNode | None = None) -> None:
        into = into or self.root
        if isinstance(mapping, dict):
            for key, value in mapping.items():
                self._set(into, str(key), name)
                self.add_mapping(value, name, into.children[str(key)])

    def _set(self, parent: KeyNode, key: str | int, where: str) -> None:
        parent.children.setdefault(key, KeyNode()).where.append((len(self.flat), where))
        self.flat.append((str(key), where))

    def walk(self, text: str, node: KeyNode | None = None) -> tuple[int, KeyNode, str]:
        """(depth, node, the text left) for the longest key path `text` starts with, below `node`
        (the root); keys may hold dots themselves (a sweep's grid key `finetune.lora.lora_rank`)."""
        node, depth, rest = node or self.root, 0, text
        while rest:
            index = re.match(r"\[(\d+)\]", rest)
            if index and int(index.group(1)) in node.children:
                node, depth, rest = node.children[int(index.group(1))], depth + 1, rest[index.end():]
                continue
            keys = [k for k in node.children if isinstance(k, str) and rest.startswith(k)
                    and rest[len(k):len(k) + 1] in ("", ".", "[")]
            if not keys:
                break
            key = max(keys, key=len)
            node, depth, rest = node.children[key], depth + 1, rest[len(key):].removeprefix(".")
        return depth, node, rest

    def locate(self, message: str) -> str | None:
        """`file:line` of the key path `message` names, or None. The deepest path named wins (a
        prose word that is also a key counts only when nothing deeper is named). A section
        (`experiments.x.pretrain: warmup_steps=30 exceeds max_steps=5`): of the keys below it that
        the message names, the one set last (the user's file rather than config/config.yaml). A
        path no source reaches (a sweep member's key): the last place its last key is written (the
        sweep's grid)."""
        words = [m.group() for m in _KEY_PATH.finditer(message)]
        found = [self.walk(word) for word in words]
        depth, node, rest = max(found, key=lambda f: f[0], default=(0, self.root, ""))
        if depth == 0:
            return None
        if not rest:
            below = [n for d, n, r in (self.walk(word, node) for word in words) if d and not r]
            return max(below or [node], key=lambda n: n.where[-1][0]).where[-1][1]
        if depth >= 2:
            return node.where[-1][1]
        leaf = re.sub(r"\[\d+\]$", "", rest).rsplit(".", 1)[-1]
        written = [where for key, where in self.flat if key == leaf or key.endswith(f".{leaf}")]
        return written[-1] if written else None


def display_path(path: str | Path) -> str:
    """`path` relative to the working directory when it lies below it (as the user typed it in the
    usual case), else absolute."""
    path = Path(path).absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def config_keys(directive_files: Sequence[str | Path], command_line_files: Sequence[str | Path],
                command_line_config: dict[str, Any] | None) -> ConfigKeys:
    """The key paths of the sources in Snakemake's merge order: the workflow's configfile(s), the
    --configfile files, --config. A file that cannot be parsed adds nothing."""
    keys = ConfigKeys()
    for path in [*directive_files, *command_line_files]:
        try:
            node = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if node is not None:
            keys.add_yaml(node, display_path(path))
    keys.add_mapping(command_line_config, "--config")
    return keys


def workflow_config_keys(workflow: Any) -> ConfigKeys:
    """`config_keys` of a Snakemake Workflow (9.x): `workflow.configfiles` lists the command line's
    files first, then those its `configfile:` statements read; --replace-workflow-config drops the
    latter from the merge."""
    settings = workflow.config_settings
    command_line = list(settings.configfiles)
    directive = [] if settings.replace_workflow_config else list(workflow.configfiles)[len(command_line):]
    return config_keys(directive, command_line, dict(settings.config or {}))


def located(error: Exception, keys: ConfigKeys) -> str:
    """`error`'s message as one line, led by the `file:line` of the key path it names (a YAML
    syntax error names its file, line and column itself)."""
    where = None if isinstance(error, ConfigSyntaxError) else keys.locate(str(error))
    return f"{where}: {error}" if where else str(error)


def stop(message: str) -> NoReturn:
    """Print `message` through Snakemake's logger, as its own errors are printed, and exit with
    status 1. SystemExit, not an exception: Snakemake prints an exception raised while the
    workflow is parsed with the workflow's file and line and a traceback of our frames."""
    try:
        from snakemake.logging import logger

        logger.error(message)
    except ImportError:
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(1)


@contextlib.contextmanager
def config_errors_reported(workflow: Any) -> Iterator[None]:
    """Inside the block (the workflow's config checks), an InputError stops Snakemake with one
    line: `file:line: message`, the line where the key its message names is set (the last
    source that sets it), or the message alone where no file sets it. LLM_LIFECYCLE_TRACEBACK=1
    lets the exception through, traceback and all."""
    try:
        yield
    except InputError as e:
        if os.environ.get("LLM_LIFECYCLE_TRACEBACK") == "1":
            raise
        stop(located(e, workflow_config_keys(workflow)))
