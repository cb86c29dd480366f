"""Our reference models against an independent oracle: HF transformers built from the same GGUF.

Tolerances: fp32 on both sides, same dequantized weights; the op order differs (fused vs unfused
attention, GEMM blocking), so logits agree to ~1e-4 relative and we allow max |diff| <= 2e-3 on
logits of magnitude ~10-30.
"""
import pytest
import torch

from onepass.engine.gguf_loader import load_gguf
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.models import build_model
from onepass.engine.sampler import SamplingParams
from onepass.engine.models.generate import reference_generate
from onepass.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
LOGIT_ATOL = 2e-3
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "def fibonacci(n):", "List three primary colors.", "Tell me a short story about a robot learning to paint."]


def ours(path):
    cfg, w, _ = load_gguf(path, progress=False)
    return build_model(cfg, w)


def full_logits(model, ids):
    kv = ContiguousKVCache(model.cfg, 1, len(ids) + 1, torch.float32, "cpu")
    return model.forward(torch.tensor([ids]), torch.arange(len(ids)).view(1, -1), torch.tensor([0]), kv,
                         last_only=False)[0]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                           dtype=torch.float32)
    return ours(smollm2_path), hf.eval(), Tokenizer.from_gguf(smollm2_path)


def test_smollm2_logits_match_transformers(smollm2):
    model, hf, tok = smollm2
    for text in PROMPTS[:3]:
        ids = tok.encode_chat(text)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        got = full_logits(model, ids)
        assert (got - ref).abs().max().item() <= LOGIT_ATOL
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_smollm2_greedy_32_tokens_match_transformers(smollm2):
    model, hf, tok = smollm2
    for text in PROMPTS[:3]:   # the logits test takes all five; three greedy runs of 32 tokens keep the CI's time
        ids = tok.encode_chat(text)
        kv = ContiguousKVCache(model.cfg, 1, len(ids) + 32, torch.float32, "cpu")
        mine = reference_generate(model, kv, [ids], 32, SamplingParams(), stop_ids=tok.stop_ids).outputs[0]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=list(tok.stop_ids),
                              pad_token_id=tok.eos_id)
        theirs = out[0, len(ids):].tolist()
        assert mine == theirs, f"{text!r}: {tok.decode(mine)!r} vs {tok.decode(theirs)!r}"


def test_qwen3_synthetic_matches_transformers(tmp_path):
    from dataclasses import replace

    from onepass.engine.gguf_writer import random_weights, write_gguf
    from tests.conftest import TINY_QWEN3

    # transformers' GGUF mapping for qwen3 ignores attention.key_length and assumes head_dim 128 (as in
    # Qwen3-1.7B/4B), so the oracle's tiny model uses that head size: q_dim 256 != dim 64, as in Qwen3-4B.
    TINY_QWEN3 = replace(TINY_QWEN3, head_dim=128, n_heads=2, n_kv_heads=1)
    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf(path, TINY_QWEN3, random_weights(TINY_QWEN3, seed=2), weight_type="f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    model = ours(path)
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 17):
        ids = torch.randint(0, TINY_QWEN3.vocab_size, (n,), generator=g).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(full_logits(model, ids), ref, rtol=1e-4, atol=1e-4)
    ids = torch.randint(0, TINY_QWEN3.vocab_size, (6,), generator=g).tolist()
    kv = ContiguousKVCache(model.cfg, 1, 64, torch.float32, "cpu")
    mine = reference_generate(model, kv, [ids], 32, SamplingParams()).outputs[0]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 6:].tolist()
    assert mine == theirs
