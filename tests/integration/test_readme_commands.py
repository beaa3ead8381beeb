"""Every shell command README.md and docs/*.md print works as printed.

The convention, in README.md and the pages of docs/:
- fenced ```bash / ```sh / ```console blocks hold commands, one a line (a trailing `\\` continues a
  line, `#` starts a comment, in ```console only lines with a `$ ` prompt are commands);
- an HTML comment on the line just before a block changes how it is run, with the reason:
  `<!-- readme-test: skip "<command prefix>" because <reason> -->`: commands of the block that start
  with the prefix are not run (keep these few: each must match a command);
  `<!-- readme-test: slow because <reason> -->`: the block runs only with the `slow` tests;
- a ```yaml block whose first line is `# <file name>` is a file the guide tells users to write: the
  test writes it before running anything (one name, one content, wherever it is printed).

How a command runs, in a temporary copy of the workflow (workflow/, config/):
- `snakemake ...`: as printed plus `-n` (a dry run: the DAG is built, every parse-time check runs);
- `make <target>`: `make -n <target>` in the repository (the target exists; nothing is executed);
- `python -m stages.<verb> ...`: as printed; with a placeholder no file can fill (`<fp>`), its
  `--help`, which must list every flag the README passes.
Placeholders: `<name>` is the README's own example experiment, `small-debug`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "console"}
PLACEHOLDERS = {"<name>": "small-debug"}
SKIP = re.compile(r'<!-- readme-test: skip "(?P<prefix>[^"]+)" because (?P<reason>.+?) -->')
SLOW = re.compile(r"<!-- readme-test: slow because (?P<reason>.+?) -->")


@dataclass
class Block:
    page: str  # README.md or docs/<name>.md
    line: int  # of the opening fence, 1-based
    lang: str
    lines: list[str]
    skips: dict[str, str] = field(default_factory=dict)  # command prefix -> reason
    slow: str | None = None

    def commands(self) -> list[str]:
        text = "\n".join(self.lines).replace("\\\n", " ")
        found = []
        for line in text.splitlines():
            if self.lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(" ".join(shlex.split(line, comments=True)))
        return found

    def skipped(self, command: str) -> str | None:
        return next((reason for prefix, reason in self.skips.items() if command.startswith(prefix)), None)


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        block = Block(page, start + 1, m.group(1), body)
        marker = lines[start - 1] if start else ""
        if s := SKIP.match(marker):
            block.skips[s.group("prefix")] = s.group("reason")
        if s := SLOW.match(marker):
            block.slow = s.group("reason")
        blocks.append(block)
        i += 1
    return blocks


BLOCKS = [b for page in PAGES for b in readme_blocks(page.read_text(), str(page.relative_to(ROOT)))]
SHELL_BLOCKS = [b for b in BLOCKS if b.lang in SHELL_LANGS]
# a block printed again on another page (the README's summary of a docs page) runs once
DISTINCT_BLOCKS = [b for i, b in enumerate(SHELL_BLOCKS)
                   if all(b.commands() != earlier.commands() for earlier in SHELL_BLOCKS[:i])]


def _param(block: Block):
    marks = [pytest.mark.slow] if block.slow else []
    page = "" if block.page == "README.md" else f"{Path(block.page).stem}-"
    return pytest.param(block, marks=marks, id=f"{page}L{block.line}-{block.commands()[0].split(' -')[0][:40]}")


def write_readme_files(workdir: Path) -> list[str]:
    """The files README's yaml blocks name in their first line, plus the data `my.yaml` points at
    (a corpus text file and an SFT directory: the README leaves their content to the user)."""
    written: dict[str, str] = {}
    for block in BLOCKS:
        if block.lang == "yaml" and block.lines and (m := re.match(r"^#\s*(\S+\.ya?ml)\s*$", block.lines[0])):
            content = "\n".join(block.lines) + "\n"
            assert written.get(m.group(1), content) == content, f"{block.page}:{block.line}: a second {m.group(1)}"
            (workdir / m.group(1)).parent.mkdir(parents=True, exist_ok=True)  # my_tasks/colours.yaml
            (workdir / m.group(1)).write_text(content)
            written[m.group(1)] = content
    (workdir / "corpora").mkdir()
    (workdir / "corpora" / "notes.txt").write_text("A small corpus file for the dry run.\n" * 20)
    (workdir / "my_sft_data").mkdir()
    for split in ("train", "dev"):
        (workdir / "my_sft_data" / f"{split}.json").write_text('{"src": "colour: red", "tgt": "It is red."}\n' * 4)
    return list(written)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("readme")
    for name in ("workflow", "config"):
        shutil.copytree(ROOT / name, work / name)
    assert "my.yaml" in write_readme_files(work)
    return work


def run(argv: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_command(command: str, workdir: Path) -> None:
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    argv = shlex.split(command)
    tool, args = argv[0], argv[1:]
    if tool == "snakemake":
        dry = args if {"-n", "--dry-run"} & set(args) else ["-n", *args]
        proc = run([sys.executable, "-m", "snakemake", *dry], workdir)
        assert proc.returncode == 0 and "This was a dry-run" in proc.stdout, \
            f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    elif tool == "make":
        proc = run(["make", "-n", *args], ROOT, timeout=60)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    elif tool == "python" and args[:1] == ["-m"] and args[1].startswith("stages."):
        if re.search(r"<\w+>", command):  # a path only a real run has (a fingerprint): check the flags
            proc = run([sys.executable, "-m", args[1], "--help"], workdir, timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
            flags = [a for a in args if a.startswith("--")]
            assert all(f in proc.stdout for f in flags), f"{command}: {args[1]} --help lacks some of {flags}"
        else:
            proc = run([sys.executable, *args], workdir)
            assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    else:
        pytest.fail(f"README command {command!r}: no rule for running {tool!r} in this test; add one or a "
                    "readme-test marker")


def test_the_readme_has_its_commands_and_markers_match():
    readme = [c for b in SHELL_BLOCKS if b.page == "README.md" for c in b.commands()]
    assert readme[:2] == ["make demo", "make test"], "Quick start: exactly `make demo` and `make test` first"
    assert len(readme) >= 8 and any(c.startswith("snakemake") for c in readme)
    assert len(README.read_text().splitlines()) <= 250, "README.md is a guide: the rest goes to docs/"
    for block in SHELL_BLOCKS:
        for prefix in block.skips:
            assert any(c.startswith(prefix) for c in block.commands()), \
                f"{block.page} line {block.line}: the skip marker {prefix!r} matches no command of its block"
    commands = [c for b in SHELL_BLOCKS for c in b.commands()]
    # --configfile takes every word after it: a target behind it would be read as a config file
    for command in commands:
        if command.startswith("snakemake") and "--configfile" in command:
            after = command.split("--configfile", 1)[1].split()
            assert not any(w.startswith("results/") for w in after), f"target after --configfile: {command}"


@pytest.mark.parametrize("block", [_param(b) for b in DISTINCT_BLOCKS])
def test_readme_command_block_works_as_printed(block, workdir):
    for command in block.commands():
        if block.skipped(command):
            continue
        run_command(command, workdir)
