"""The code a rule runs, read from the sources (stages/provenance/code.py): what it finds against what
Python really imports, and the narrowing that keeps one method's edit to its own quantize jobs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stages.provenance.code import ROOT, closure, direct_imports, fingerprint, lazy_homes, source_path
from stages.quant.variants import METHOD_MODULES


@pytest.mark.parametrize("verb", ["prepare", "quantize", "evaluate", "report", "finetune"])
def test_every_module_python_imports_is_found(verb):
    """Sound where it matters: every `stages` module that importing the verb loads is in its closure
    (the closure also holds modules imported inside functions, which Python loads later)."""
    code = (f"import sys, json; import stages.{verb}; "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'stages' or m.startswith('stages.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert loaded and loaded <= set(closure([f"stages.{verb}"])), loaded - set(closure([f"stages.{verb}"]))


def test_imports_inside_functions_and_lazy_names_are_followed():
    # load_variant (evaluate's loader) imports the quantized loader inside a function, by its lazy
    # name in stages.quant
    assert lazy_homes("stages.quant")["load_quantized"] == "stages.quant.loader"
    assert "stages.quant.loader" in direct_imports("stages.inference.loading")
    assert "stages.quant.loader" in closure(["stages.evaluate"])


def test_type_checking_imports_are_not_code_that_runs():
    # stages/model/__init__.py names llama under `if TYPE_CHECKING:`; prepare reaches the package only
    assert "stages.model" in closure(["stages.prepare"])
    assert "stages.model.llama" not in closure(["stages.prepare"])
    assert "stages.model.llama" in closure(["stages.pretrain"])


def test_each_quantize_method_counts_only_its_own_module():
    def job(method):
        return set(closure(["stages.quantize"], [m for other, mods in METHOD_MODULES.items() if other != method
                                                  for m in mods]))

    assert "stages.quant.gptq" in job("gptq") and "stages.quant.gptq" not in job("rtn") | job("a8w8")
    assert "stages.quant.smoothquant" in job("a8w8") and "stages.quant.smoothquant" not in job("gptq") | job("rtn")
    # the calibration driver both calibrated methods share, and the packing every method uses
    assert "stages.quant.block_calibration" in job("gptq") & job("a8w8")
    assert "stages.quant.rtn" in job("rtn") & job("gptq") & job("a8w8")


def test_the_fingerprint_is_of_the_files_and_their_paths():
    modules = closure(["stages.report"])
    assert len(fingerprint(modules)) == 16 and fingerprint(modules) == fingerprint(reversed(modules))
    assert fingerprint(modules) != fingerprint(modules[:-1])
    assert source_path("stages.quant.gptq") == "stages/quant/gptq.py"
    assert source_path("stages.quant") == "stages/quant/__init__.py"


def test_an_unknown_module_is_refused():
    with pytest.raises(ValueError, match="no module 'stages.nope'"):
        closure(["stages.nope"])
