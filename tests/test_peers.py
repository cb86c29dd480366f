"""The HF transformers peer is built from our weights: it must compute the same function."""
from dataclasses import replace

import pytest
import torch

from onepass.engine.gguf_loader import load_gguf
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.models import build_model
from tests.conftest import TINY_LLAMA

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_peer_model_matches_ours(tiny_ggufs, arch):
    from onepass.harness.peers import hf_model

    cfg, w, _ = load_gguf(tiny_ggufs[arch], progress=False)
    if arch == "llama":
        cfg = replace(cfg, rope_scaling=TINY_LLAMA.rope_scaling)  # the file keeps only rope_freqs
    hf = hf_model(cfg, w, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ours = build_model(cfg, w).forward(ids, torch.arange(40).view(1, -1), torch.tensor([0]),
                                                         ContiguousKVCache(cfg, 1, 64, torch.float32, "cpu"),
                                                         last_only=False)
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_peer_continuous_batching_matches_our_greedy(tiny_ggufs):
    """The serving peer (HF continuous batching) decodes the same tokens as our single-stream greedy."""
    from onepass.engine.sampler import SamplingParams
    from onepass.engine.models.generate import reference_generate
    from onepass.harness.peers import hf_model, hf_serving_rate

    cfg, w, _ = load_gguf(tiny_ggufs["qwen3"], progress=False)
    hf = hf_model(cfg, w, torch.device("cpu"), torch.float32)
    reqs = [([5 + i, 6, 7, 8, 9 + i], 3 + i % 4) for i in range(6)]
    peer = hf_serving_rate(hf, reqs, warmup=2)
    model = build_model(cfg, w)
    for (prompt, n), theirs in zip(reqs, peer["peer_outputs"]):
        ours = reference_generate(model, ContiguousKVCache(cfg, 1, 32, torch.float32, "cpu"), [prompt], n,
                               SamplingParams())
        assert ours.outputs[0] == theirs
    assert peer["peer_tok_s"] > 0
