"""The environment a run is made in: the lock file it was installed from, and the exact versions installed.

`make install` installs the CPU lock (locks/cpu.txt) and leaves a copy of it in the venv (INSTALLED_LOCK), so a run
can name the lock it came from by its hash even after locks/ changes; an environment installed by hand from a lock
(`pip install -r locks/cuda.txt`) is known by every pin of that lock being installed.
"""
from __future__ import annotations

import hashlib
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_LOCK = ROOT / "locks" / "cpu.txt"     # Linux x86-64, Python 3.11, torch's CPU build, the test extra
CUDA_LOCK = ROOT / "locks" / "cuda.txt"   # Linux x86-64, Python 3.12, PyPI's CUDA torch and cupy
LOCKS = (CPU_LOCK, CUDA_LOCK)
# the lock `make install` installed, copied into the venv it made (the Makefile writes it)
INSTALLED_LOCK = Path(sys.prefix) / "onepass-lock.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def _name(name: str) -> str:
    """A distribution's name as pip compares it (PEP 503): case, '.', '_' and '-' do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """Each installed distribution's version by its normalized name; the first on sys.path where a venv with system
    site packages sees two (the one that imports)."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and _name(name) not in out:
            out[_name(name)] = dist.version
    return out


def pins(lock: Path) -> dict[str, str]:
    """A lock file's `name==version` lines by normalized name."""
    return {_name(m[1]): m[2] for line in lock.read_text().splitlines() if (m := PIN.match(line.strip()))}


def lock_in_use() -> Path | None:
    """The lock this environment was installed from: the copy `make install` left in the venv, else the first of
    LOCKS whose every pin is installed at its version; None where neither is."""
    if INSTALLED_LOCK.is_file():
        return INSTALLED_LOCK
    have = installed()
    for lock in LOCKS:
        if lock.is_file() and (want := pins(lock)) and all(have.get(n) == v for n, v in want.items()):
            return lock
    return None


def lock_hash() -> str:
    """The first 12 hex digits of the sha256 of the lock file in use; "" where none is (a run's tag)."""
    lock = lock_in_use()
    return hashlib.sha256(lock.read_bytes()).hexdigest()[:12] if lock else ""


def package_versions() -> str:
    """Every installed distribution as a `name==version` line, sorted by name (a requirements file that pins the
    environment exactly)."""
    names: dict[str, tuple[str, str]] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and _name(name) not in names:
            names[_name(name)] = (name, dist.version)
    return "".join(f"{name}=={version}\n" for _, (name, version) in sorted(names.items()))
