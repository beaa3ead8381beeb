"""pyproject.toml and environment.yml pin the same packages at the same versions."""

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _pins(specs):
    pins = {}
    for spec in specs:
        name, _, version = spec.partition("==")
        assert version, f"{spec!r} is not pinned with =="
        pins[name.strip().lower()] = version.strip()
    return pins


def test_pyproject_and_environment_pin_the_same_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert _pins(project) == _pins(pip_section)


def test_torch_is_pinned_to_the_cpu_wheel_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in project


TEST_ONLY = {"pytest", "pytest-xdist", "openai", "selenium", "moto[server]"}


def test_test_tools_are_an_extra_that_no_stage_imports():
    """Jobs get the runtime packages only: the test tools live in the `test` extra, and no module of
    the `stages` package imports one of them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = set(_pins(project["dependencies"]))
    assert not TEST_ONLY & runtime
    assert TEST_ONLY <= set(_pins(project["optional-dependencies"]["test"]))
    modules = {"pytest", "xdist", "openai", "selenium", "moto"}
    for path in (ROOT / "stages").rglob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "from"):
                assert words[1].split(".")[0] not in modules, f"{path}: {line.strip()}"
