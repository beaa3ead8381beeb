"""Which heavy modules importing one of ours pulls in, checked in a fresh interpreter: the modules
the workflow imports while Snakemake parses, and those that import a library only where it is used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def loaded_by_import(module: str, candidates: tuple[str, ...]) -> list[str]:
    """The names in `candidates` that are in sys.modules after `import module` alone."""
    return loaded_by_code(f"import {module}", candidates)


def loaded_by_code(code: str, candidates: tuple[str, ...]) -> list[str]:
    """The names in `candidates` that are in sys.modules after running `code` in the repository."""
    code = f"import sys\n{code}\nprint(','.join(m for m in {candidates!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]
