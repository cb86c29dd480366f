"""The HF transformers peer is built from our weights: it must compute the same function."""
from dataclasses import replace

import pytest
import torch

from engine.gguf_loader import load_gguf
from engine.kv_cache import ContiguousKVCache
from engine.models import build_model
from kernels.ops import get_ops
from tests.conftest import TINY_LLAMA

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_peer_model_matches_ours(tiny_ggufs, arch):
    from harness.peers import hf_model

    cfg, w, _ = load_gguf(tiny_ggufs[arch], progress=False)
    if arch == "llama":
        cfg = replace(cfg, rope_scaling=TINY_LLAMA.rope_scaling)  # the file keeps only rope_freqs
    hf = hf_model(cfg, w, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ours = build_model(cfg, w, get_ops("torch")).forward(ids, torch.arange(40).view(1, -1), torch.tensor([0]),
                                                         ContiguousKVCache(cfg, 1, 64, torch.float32, "cpu"), last_only=False)
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
