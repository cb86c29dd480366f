"""The environment is pinned and a run can name it: the lock files pin every requirement of pyproject.toml at a
version it admits (`make lock` after a change to it), lock_hash() names the lock an environment was installed from, and
package_versions() lists exactly what is installed."""
from __future__ import annotations

import hashlib
import re
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from onepass.harness import environment

PYPROJECT = environment.ROOT / "pyproject.toml"


def requirements(extras: tuple[str, ...], python: str) -> list[Requirement]:
    """pyproject.toml's dependencies and those of the extras (an extra's onepass[...] expanded), each whose marker
    holds on Linux x86-64 at that Python."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    optional = project["optional-dependencies"]

    def expand(texts: list[str], extra: str):
        env = {"python_version": python, "python_full_version": f"{python}.0", "platform_system": "Linux",
               "sys_platform": "linux", "platform_machine": "x86_64", "extra": extra}
        for req in map(Requirement, texts):
            if req.name == "onepass":
                for e in req.extras:
                    yield from expand(optional[e], e)
            elif req.marker is None or req.marker.evaluate(env):
                yield req

    return [*expand(project["dependencies"], ""), *(r for e in extras for r in expand(optional[e], e))]


@pytest.mark.parametrize("lock, extras, python", [(environment.CPU_LOCK, ("test",), "3.11"),
                                                  (environment.CUDA_LOCK, ("cuda13", "test"), "3.12")])
def test_each_lock_pins_every_requirement_at_a_version_it_admits(lock, extras, python):
    pins = environment.pins(lock)
    reqs = requirements(extras, python)
    assert len(reqs) > 20
    for req in reqs:
        name = environment._name(req.name)
        assert name in pins, f"{lock.name} has no pin for {req}: run make lock"
        assert req.specifier.contains(pins[name], prereleases=True), f"{lock.name} pins {name}=={pins[name]}: {req}"
    # which torch: the CPU lock the CPU build (no CUDA wheels), the CUDA lock PyPI's, with the cupy of its CUDA
    if lock == environment.CPU_LOCK:
        assert pins["torch"].endswith("+cpu") and not [n for n in pins if n.startswith(("nvidia-cu", "cupy"))]
    else:
        assert "+" not in pins["torch"] and "cupy-cuda13x" in pins and pins["nvidia-cuda-nvrtc"].startswith("13.")


def test_lock_hash_names_the_lock_installed_from(tmp_path, monkeypatch):
    have = environment.installed()
    matching = tmp_path / "matching.txt"
    matching.write_text(f"# a lock\npandas=={have['pandas']}\n    # via onepass\nnumpy=={have['numpy']}\n")
    other = tmp_path / "other.txt"
    other.write_text(f"pandas=={have['pandas']}\nnumpy==0.0.1\n")
    monkeypatch.setattr(environment, "INSTALLED_LOCK", tmp_path / "absent.txt")
    monkeypatch.setattr(environment, "LOCKS", (other, tmp_path / "missing.txt"))
    assert environment.lock_in_use() is None and environment.lock_hash() == ""
    # installed by hand from a lock: every pin of it is installed at its version
    monkeypatch.setattr(environment, "LOCKS", (other, matching))
    assert environment.lock_in_use() == matching
    assert environment.lock_hash() == hashlib.sha256(matching.read_bytes()).hexdigest()[:12]
    # installed by make install: the copy it left in the venv, whatever is installed now
    copy = tmp_path / "onepass-lock.txt"
    copy.write_text(other.read_text())
    monkeypatch.setattr(environment, "INSTALLED_LOCK", copy)
    assert environment.lock_hash() == hashlib.sha256(other.read_bytes()).hexdigest()[:12] != ""


def test_package_versions_lists_what_is_installed_once_each():
    lines = environment.package_versions().splitlines()
    assert all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==\S+", line) for line in lines), lines[:5]
    names = [line.split("==")[0] for line in lines]
    assert len({environment._name(n) for n in names}) == len(names)
    assert names == sorted(names, key=environment._name)
    assert f"pandas=={metadata.version('pandas')}" in lines and f"onepass=={metadata.version('onepass')}" in lines
