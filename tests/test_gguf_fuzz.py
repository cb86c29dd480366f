"""300 mutated tiny GGUF files (llama with a tokenizer and chat template, qwen3, qwen35 with an MTP block), a fixed
seed: each must be refused with a GGUFError or ConfigError, or load and run to a verdict, within a time bound per
mutant (tests/gguf_fuzz.py) and a memory bound for the whole run, never with a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = 300
PEAK_RSS = 3 * 2**30      # the whole child, every mutant included
ADDRESS_SPACE_GIB = 12   # a hard stop, so a runaway mutant fails the test instead of the machine


def test_mutated_ggufs_are_refused_or_run_to_a_verdict():
    env = {**os.environ, "RUST_BACKTRACE": "0", "TQDM_DISABLE": "1"}
    out = subprocess.run([sys.executable, "-m", "tests.gguf_fuzz", "--mutants", str(MUTANTS), "--seed", "0",
                          "--address-space-gib", str(ADDRESS_SPACE_GIB)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])["summary"]
    print(json.dumps(report["counts"]), f"slowest {report['slowest_s']:.2f} s")
    assert report["failures"] == [], json.dumps(report["failures"], indent=1)[:6000]
    assert sum(report["counts"].values()) == MUTANTS
    assert report["peak_rss_bytes"] < PEAK_RSS, f"peak RSS {report['peak_rss_bytes'] / 2**30:.1f} GiB"
    # the mix must exercise both ends: files refused, and files that load and verify
    assert report["counts"].get("GGUFError", 0) > MUTANTS // 4 and report["counts"].get("verified", 0) > 10
    # every failed verdict says why
    assert all(report["reasons"]), report["reasons"]
