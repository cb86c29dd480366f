"""The HF transformers peer is built from our weights: it must compute the same function."""
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from onepass.engine.gguf_loader import load_gguf
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.models import build_model
from tests.conftest import ROOT, TINY_LLAMA

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
    from onepass.engine.static_batch import generate_static
    from onepass.harness.peers import hf_model, hf_serving_rate

    cfg, w, _ = load_gguf(tiny_ggufs["qwen3"], progress=False)
    hf = hf_model(cfg, w, torch.device("cpu"), torch.float32)
    reqs = [([5 + i, 6, 7, 8, 9 + i], 3 + i % 4) for i in range(6)]
    peer = hf_serving_rate(hf, reqs, warmup=2)
    model = build_model(cfg, w)
    for (prompt, n), theirs in zip(reqs, peer["peer_outputs"]):
        ours = generate_static(model, ContiguousKVCache(cfg, 1, 32, torch.float32, "cpu"), [prompt], n,
                               SamplingParams())
        assert ours.outputs[0] == theirs
    assert peer["peer_tok_s"] > 0


def test_top_level_names_stay_free_for_other_packages():
    """onepass installs one top-level name. Run from the repository root with onepass imported, none of `kernels`,
    `engine`, `harness` resolves to a folder of the repository's root, so Hugging Face's `kernels` (which
    transformers 5.25+ imports) is the one transformers gets, and it builds a model."""
    code = (f"import importlib.util as u, pathlib; import onepass.kernels.pdl; root = pathlib.Path({str(ROOT)!r}); "
            "found = [(n, s) for n in ('kernels', 'engine', 'harness') if (s := u.find_spec(n)) is not None]; "
            "mine = [n for n, s in found if pathlib.Path(next(iter(s.submodule_search_locations or [s.origin])))"
            ".resolve().parent == root]; "
            "assert not mine, mine; import transformers; "
            "transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=32, hidden_size=16, "
            "intermediate_size=32, "
            "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
