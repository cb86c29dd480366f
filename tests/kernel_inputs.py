"""What the kernel test files share: where kernels run (the GPU, or the CPU under Triton's interpreter),
one random seed per test process (printed in every failure message), and seeded random inputs."""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cuda" if HAS_CUDA and not INTERPRET else "cpu")
SEED = int(os.environ.get("KERNEL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))

needs_kernel = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET),
    reason="CPU without TRITON_INTERPRET=1: run by test_cpu_kernels_in_interpreter_subprocess in a child process")


def _gen(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED * 1000 + salt)


def _msg(what: str) -> str:
    return f"{what} (seed {SEED}; rerun with KERNEL_TEST_SEED={SEED})"


def _randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)
