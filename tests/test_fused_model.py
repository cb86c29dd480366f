"""The fused decode step (engine/fused_model.py + runner) against the reference model.

On the CPU it runs with the torch reference kernels, which checks the step's structure (fused
q|k|v and gate|up, rows of (slot, position), the scratch slot, feedback of sampled ids). On a GPU the
Triton kernels with CUDA graphs must reproduce it, bit-exact across batch sizes.
"""
import pytest
import torch

from onepass.engine.fused_model import FusedDecoder
from onepass.engine.gguf_loader import load_gguf
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.models import build_model
from onepass.engine.sampler import SamplingParams
from onepass.engine.models.generate import reference_generate
from onepass.engine.runner import run_static
from onepass.engine.verify import verify_greedy
from onepass.kernels.backend import get_step_kernels


def fused_run(path, backend, batch, prompt, new, prefill="batched", graphs=False, dtype=torch.float32, device="cpu",
              sampling=SamplingParams()):
    cfg, w, _ = load_gguf(path, dtype=dtype, device=device, progress=False)
    model = FusedDecoder(cfg, w, get_step_kernels(backend), max_pos=128)
    kv = ContiguousKVCache(cfg, batch + 1, 64, dtype, device)
    return run_static(model, kv, [prompt] * batch, new, sampling, prefill=prefill, use_graphs=graphs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("prefill", ["batched", "token"])
def test_fused_torch_matches_reference_model(tiny_ggufs, arch, prefill):
    prompt = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    cfg, w, _ = load_gguf(tiny_ggufs[arch], progress=False)
    ref = reference_generate(build_model(cfg, w), ContiguousKVCache(cfg, 1, 64, torch.float32, "cpu"),
                          [prompt], 12, SamplingParams())
    got = fused_run(tiny_ggufs[arch], "torch", 3, prompt, 12, prefill)
    assert verify_greedy(got.outputs, ref.outputs[0]).ok


def test_padded_rows_write_only_the_scratch_slot(tiny_ggufs):
    """B=3 runs in the 4-row bucket: the padding row must leave slots 0..2 as a B=3 reference leaves
    them, and touch only position 0 of the scratch slot (padded rows never advance)."""
    cfg, w, _ = load_gguf(tiny_ggufs["llama"], progress=False)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (6,), generator=g).tolist() for _ in range(3)]
    model = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=128)
    kv = ContiguousKVCache(cfg, 4, 64, torch.float32, "cpu")
    got = run_static(model, kv, prompts, 5, use_graphs=False)
    ref_kv = ContiguousKVCache(cfg, 3, 64, torch.float32, "cpu")
    ref = reference_generate(build_model(cfg, w), ref_kv, prompts, 5, SamplingParams())
    assert got.outputs == ref.outputs
    for layer in range(cfg.n_layers):
        torch.testing.assert_close(kv.k[layer][:3, :10], ref_kv.k[layer][:, :10], rtol=1e-5, atol=1e-5)
        assert kv.k[layer][3, 0].abs().sum() > 0 and not kv.k[layer][3, 1:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_graphs_bit_exact_across_batch(tiny_ggufs, arch):
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(6)).tolist()
    runs = {B: fused_run(tiny_ggufs[arch], "triton", B, prompt, 24, graphs=True, dtype=torch.bfloat16, device="cuda")
            for B in (1, 3, 8, 64)}
    for B, r in runs.items():
        assert verify_greedy(r.outputs, runs[1].outputs[0]).ok, B
    eager = fused_run(tiny_ggufs[arch], "triton", 8, prompt, 24, graphs=False, dtype=torch.bfloat16, device="cuda")
    assert eager.outputs == runs[8].outputs
    token = fused_run(tiny_ggufs[arch], "triton", 8, prompt, 24, "token", graphs=True, dtype=torch.bfloat16,
                      device="cuda")
    assert token.outputs == runs[8].outputs


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_step_matches_torch_kernels_on_gpu(tiny_ggufs, arch):
    """bf16 on the GPU: one batched-prefill step of the Triton kernels against the torch references."""
    cfg, w, _ = load_gguf(tiny_ggufs[arch], dtype=torch.bfloat16, device="cuda", progress=False)
    tokens = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(8)).cuda()
    slots = torch.arange(2, device="cuda").repeat_interleave(9)
    positions = torch.arange(9, device="cuda").repeat(2)
    logits = {}
    for backend in ("torch", "triton"):
        model = FusedDecoder(cfg, w, get_step_kernels(backend), max_pos=64)
        kv = ContiguousKVCache(cfg, 3, 64, torch.bfloat16, "cuda")
        hidden = model.hidden(tokens.reshape(-1), positions, slots, kv, model.buffers(18))
        logits[backend] = model.logits(hidden).float()
    scale = logits["torch"].abs().max().item()
    assert (logits["triton"] - logits["torch"]).abs().max().item() <= 3e-2 * scale
