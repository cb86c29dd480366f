"""Real weights on the GPU: SmolLM2 through the Triton kernels with CUDA graphs (dequantized weights)
reproduces the CPU fp32 reference's 64 greedy tokens on 8 prompts.

fp16 keeps 10 mantissa bits, enough to follow the fp32 reference for 64 tokens on all 8 prompts
(measured on the H200). bf16 (8 bits) diverges after 14-41 tokens on 5 of the 8 prompts: that is
rounding, not a bug, and the bf16 path is held to bit-exactness across batch sizes instead
(tests/test_fused_model.py)."""
import pytest
import torch

from onepass.engine.fused_model import FusedDecoder
from onepass.engine.gguf_loader import load_gguf
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.models import build_model
from onepass.engine.sampler import SamplingParams
from onepass.engine.models.generate import reference_generate
from onepass.engine.runner import run_static
from onepass.engine.tokenizer import Tokenizer
from onepass.kernels.backend import get_step_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
PROMPTS = ["Tell me a short story about a robot learning to paint.", "What is the capital of France?",
           "Write a haiku about the sea.", "Explain photosynthesis in simple terms.", "def fibonacci(n):",
           "List three primary colors.", "How do I make a cup of tea?", "Translate 'good morning' into Spanish."]


def test_smollm2_fp16_gpu_reproduces_cpu_reference(smollm2_path):
    tok = Tokenizer.from_gguf(smollm2_path)
    cfg, w, _ = load_gguf(smollm2_path, progress=False)
    ref_model = build_model(cfg, w)
    cfg16, w16, _ = load_gguf(smollm2_path, dtype=torch.float16, device="cuda", progress=False)
    fused = FusedDecoder(cfg16, w16, get_step_kernels("triton"), max_pos=600)
    for text in PROMPTS:
        ids = tok.encode_chat(text)
        ref = reference_generate(ref_model, ContiguousKVCache(cfg, 1, 512, torch.float32, "cpu"), [ids], 64,
                              SamplingParams())
        kv = ContiguousKVCache(cfg16, 2, 512, torch.float16, "cuda")
        got = run_static(fused, kv, [ids], 64)
        assert got.outputs[0] == ref.outputs[0], f"{text!r}: {tok.decode(got.outputs[0])!r}"


def test_smollm2_persistent_step_matches_the_kernel_per_op_step(smollm2_path):
    """The persistent step (kernels/persistent_step.py) and the kernel-per-op step give the same 64 greedy tokens on
    the 8 prompts (fp16, as above: their norms and attention sum in different orders)."""
    tok = Tokenizer.from_gguf(smollm2_path)
    cfg16, w16, _ = load_gguf(smollm2_path, dtype=torch.float16, device="cuda", progress=False)
    for text in PROMPTS:
        ids = tok.encode_chat(text)
        outs = {}
        for persistent in (False, True):
            fused = FusedDecoder(cfg16, w16, get_step_kernels("triton"), max_pos=600,
                                 step="persistent" if persistent else "kernels")
            outs[persistent] = run_static(fused, ContiguousKVCache(cfg16, 2, 512, torch.float16, "cuda"), [ids], 64,
                                          use_graphs=True).outputs[0]
        assert outs[True] == outs[False], f"{text!r}: {tok.decode(outs[True])!r} vs {tok.decode(outs[False])!r}"
