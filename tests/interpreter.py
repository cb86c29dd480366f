"""Run a kernel test file's CPU tests in a child pytest under Triton's interpreter.

Triton decides at import whether kernels are compiled or interpreted, so a process that imported it
without TRITON_INTERPRET=1 cannot interpret; the kernel test files call this from one test instead."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_in_interpreter(test_file: str | Path, note: str = "", only_skipped: bool = False, **env: str) -> None:
    """Fail with the child's output unless every selected test passed (none skipped). only_skipped: the child runs
    only the tests the parent skipped for it (tests/conftest.py), for files whose other tests never touch Triton."""
    child = {"ONEPASS_INTERPRETER_CHILD": "1"} if only_skipped else {}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider",
                           "-m", "not gpu and not compile_only", "-k", "not subprocess"], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1", **child, **env}, capture_output=True,
                          text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter run failed {note}:\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, tail
