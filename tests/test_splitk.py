"""Split-K partials handed to the consuming kernel (kernels/splitk.py): the residual add + RMSNorm and SwiGLU fed a
SplitSums give bitwise what they give on the reduce kernel's output, and the GEMMs' defer=True hands back partials
that do. Where kernels run: as tests/test_kernels_elementwise.py (the GPU, or the CPU interpreter, in this process
under TRITON_INTERPRET=1 or in a child process otherwise); the CUDA mma kernel's deferral on the GPU only."""
from __future__ import annotations

import pytest
import torch

from onepass.kernels.gemm import linear
from onepass.kernels.splitk import splitk_reduce
from onepass.kernels.int4_gemm import w4a16_linear
from onepass.kernels.rmsnorm import add_rms_norm_triton
from onepass.kernels.splitk import SplitSums
from onepass.kernels.swiglu import swiglu_triton
from tests.interpreter import run_in_interpreter
from tests.kernel_inputs import DEV, HAS_CUDA, INTERPRET, SEED, _gen, _msg, needs_kernel


def _reduce_kernel(ws: torch.Tensor, dtype: torch.dtype, rne: bool) -> torch.Tensor:
    """The reduce the consumers replace (kernels/gemm.py's; nvrtc's adds in the same order)."""
    S, M, N = ws.shape
    return splitk_reduce(ws, torch.empty(M, N, dtype=dtype, device=ws.device), S, rne)


def _exact(a, b, what):
    assert a.dtype == b.dtype and torch.equal(a, b), _msg(f"{what}: {int((a != b).sum())} elements differ")


@needs_kernel
@pytest.mark.parametrize("S", [2, 5, 12])
@pytest.mark.parametrize("rne", [False, True])
@pytest.mark.parametrize("row_limit", [None, 0, "chunked"])
def test_consumers_add_partials_as_the_reduce(S, rne, row_limit, monkeypatch):
    """In the consumer, or (row_limit 0: more partials per row than the norm takes) by the reduce run first into the
    GEMM's out, or ("chunked") by the norm's chunked form (rows wider than ROW_MAX_D): the same bits either way."""
    from onepass.kernels import rmsnorm

    if row_limit == "chunked":
        monkeypatch.setattr(rmsnorm, "ROW_MAX_D", 128)
        monkeypatch.setattr(rmsnorm, "CHUNK", 128)
    elif row_limit is not None:
        monkeypatch.setattr(rmsnorm, "SPLIT_ROW_BYTES", row_limit)
        monkeypatch.setattr(rmsnorm, "SPLIT_MIN_ROWS", 1 << 30)
    g = _gen(S)
    M, D = 5, 320
    ws = (torch.randn(S, M, 2 * D, generator=g) * torch.logspace(-2, 2, S)[:, None, None]).to(DEV)
    sums = SplitSums(ws, torch.full((M, 2 * D), float("nan"), dtype=torch.bfloat16, device=DEV), rne=rne)
    y = _reduce_kernel(ws, torch.bfloat16, rne)
    res = (torch.randn(M, 2 * D, generator=g) * 3).bfloat16().to(DEV)
    w = (torch.rand(2 * D, generator=g) + 0.5).bfloat16().to(DEV)
    r1, r2 = res.clone(), res.clone()
    n1 = add_rms_norm_triton(y, r1, w, 1e-6)[0]
    n2 = add_rms_norm_triton(sums, r2, w, 1e-6)[0]
    _exact(n2, n1, f"add_rms_norm S={S}")
    _exact(r2, r1, f"residual S={S}")
    if row_limit == 0:
        _exact(sums.out, y, f"the reduce into out S={S}")
    _exact(swiglu_triton(sums), swiglu_triton(y), f"swiglu S={S}")
    if not (INTERPRET and not rne):        # the interpreter's own bf16 cast truncates: the reduce's RNE path only
        _exact(sums.reduce(), y, f"SplitSums.reduce S={S}")


@needs_kernel
def test_gemms_defer_their_reduce():
    """defer=True returns the partials where K splits (the consumer's output is the reduced path's), the finished
    output where it does not."""
    from tests.test_int4_gemm import _weight, _x

    g = _gen(7)
    M, N, K = 3, 96, 1024
    x = (torch.randn(M, K, generator=g) * 0.1).bfloat16().to(DEV)
    wd = (torch.randn(N, K, generator=g) * 0.05).bfloat16().to(DEV)
    res = torch.randn(M, N, generator=g).bfloat16().to(DEV)
    nw = (torch.rand(N, generator=g) + 0.5).bfloat16().to(DEV)
    pw, xs = _weight("q4_k", N, K, SEED % 1000, device=DEV)
    xq = _x(SEED, M, K, xs, device=DEV)
    for name, run, xx in (("dense", lambda **kw: linear(x, wd, **kw), x),
                          ("int4", lambda **kw: w4a16_linear(xq, pw, **kw), xq)):
        split = run(config={"SPLIT_K": 4}, defer=True)
        assert isinstance(split, SplitSums) and split.splits == 4 and tuple(split.shape) == (M, N), name
        full = run(config={"SPLIT_K": 4})
        r1, r2 = res.clone(), res.clone()
        _exact(add_rms_norm_triton(split, r2, nw, 1e-6)[0], add_rms_norm_triton(full, r1, nw, 1e-6)[0], name)
        _exact(r2, r1, name)
        one = run(config={"SPLIT_K": 1}, defer=True)
        assert isinstance(one, torch.Tensor), f"{name}: one split has nothing to defer"


@needs_kernel
@pytest.mark.parametrize("S", [2, 5])
@pytest.mark.parametrize("rne", [False, True])
def test_hybrid_consumers_add_column_partials(S, rne):
    """The hybrid's q|k|v|z partials split by columns (SplitSums.cols): the conv ring fed its q|k|v columns and the
    gated norm its z columns give bitwise what they give on the reduce's output (outputs and the ring), and a column
    slice finishes into its columns."""
    from onepass.kernels.gdn import conv_ring_update_triton, gated_rms_norm_triton

    g = _gen(S + 10)
    M, C, hv, dv, K = 3, 96, 2, 32, 4
    ws = (torch.randn(S, M, C + hv * dv, generator=g) * torch.logspace(-1, 1, S)[:, None, None]).to(DEV)
    out = torch.full((M, C + hv * dv), float("nan"), dtype=torch.bfloat16, device=DEV)
    sums = SplitSums(ws, out, rne=rne)
    y = _reduce_kernel(ws, torch.bfloat16, rne)
    ring = torch.randn(4, C, K - 1, generator=g).bfloat16().to(DEV)
    w = (torch.randn(C, K, generator=g) * 0.5).bfloat16().to(DEV)
    slots, positions = torch.tensor([2, 0, 3], device=DEV), torch.tensor([5, 0, 9], device=DEV)
    r1, r2 = ring.clone(), ring.clone()
    c1 = conv_ring_update_triton(y[:, :C], r1, w, slots, positions)
    c2 = conv_ring_update_triton(sums.cols(0, C), r2, w, slots, positions)
    _exact(c2, c1, f"conv S={S}")
    _exact(r2, r1, f"conv ring S={S}")
    o = torch.randn(M, hv, dv, generator=g).to(DEV)
    nw = (torch.rand(dv, generator=g) + 0.5).bfloat16().to(DEV)
    g1 = gated_rms_norm_triton(o, y[:, C:].unflatten(1, (hv, dv)), nw, 1e-6)
    _exact(gated_rms_norm_triton(o, sums.cols(C, C + hv * dv), nw, 1e-6), g1, f"gated norm S={S}")
    sums.cols(C, C + hv * dv).finish()
    _exact(out[:, C:], y[:, C:], f"finish of a column slice S={S}")
    assert torch.isnan(out[:, :C].float()).all(), "finish wrote outside its columns"


def _split_kernels(honor_defer: bool):
    """The triton step kernels with every projection split in two along K (BLOCK_K 32; packed ones through the
    Triton W4A16 kernel), deferring or not."""
    from dataclasses import replace

    from onepass.kernels.quant_pack import PackedWeight
    from onepass.kernels.backend import get_step_kernels

    def lin(x, w, out=None, defer=False, x_image=None):
        if isinstance(w, PackedWeight):
            return w4a16_linear(x, w, out, config={"BLOCK_K": 32, "SPLIT_K": 2}, defer=defer and honor_defer)
        return linear(x, w, out=out, config={"BLOCK_K": 32, "SPLIT_K": 2}, defer=defer and honor_defer)

    return replace(get_step_kernels("triton"), linear=lin)


@needs_kernel
def test_fused_decoders_consume_partials(tiny_ggufs, tmp_path):
    """The llama and hybrid fused steps with every GEMM split: handing the o / ssm_out, gate|up and down partials
    (and, packed, the hybrid's q|k|v|z partials beside its dense beta|alpha rows) to the next kernels gives the logits
    (and residual stream) of reducing them first, bit for bit."""
    from onepass.engine.config import ModelConfig
    from onepass.engine.fused_model import FusedDecoder
    from onepass.engine.fused_qwen35 import FusedQwen35Decoder
    from onepass.engine.gguf_loader import load_gguf
    from onepass.engine.gguf_writer import random_weights, write_gguf
    from onepass.engine.kv_cache import ContiguousKVCache
    from onepass.engine.state_pool import HybridCache
    from onepass.harness.synth import LazyWeights

    hybrid = ModelConfig(arch="qwen35", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
                         vocab_size=256, norm_eps=1e-6, rope_theta=1e7, context_length=256, qk_norm=True, rotary_dim=8,
                         rope_sections=(2, 1, 1, 0), attn_output_gate=True, gdn_conv_kernel=4, bos_id=1, eos_ids=(2,),
                         name="tiny-qwen35-split", full_attention_interval=2, gdn_k_heads=2, gdn_v_heads=2,
                         gdn_k_dim=16, gdn_v_dim=16, tie_embeddings=True)
    write_gguf(tmp_path / "h.gguf", hybrid, random_weights(hybrid, seed=5), weight_type="f32")
    hcache = lambda c: HybridCache.create(c, 3, 32, torch.bfloat16, DEV, torch.float32)  # noqa: E731
    loaded = lambda path: load_gguf(path, dtype=torch.bfloat16, device=DEV, progress=False)[:2]  # noqa: E731
    cases = {"llama": (lambda: loaded(tiny_ggufs["llama"]), FusedDecoder,
                       lambda c: ContiguousKVCache(c, 3, 32, torch.bfloat16, DEV)),
             "qwen35": (lambda: loaded(tmp_path / "h.gguf"), FusedQwen35Decoder, hcache),
             "qwen35-packed": (lambda: (hybrid, dict(LazyWeights(hybrid, torch.bfloat16, DEV, seed=5,
                                                                 packed_fmt="q4_0").items())),
                               FusedQwen35Decoder, hcache)}
    tokens = torch.tensor([5, 9, 7, 3], device=DEV)
    positions, slots = torch.tensor([0, 0, 1, 1], device=DEV), torch.tensor([0, 1, 0, 1], device=DEV)
    for name, (weights, cls, cache) in cases.items():
        cfg, w = weights()
        got = {}
        for honor in (False, True):
            model = cls(cfg, w, _split_kernels(honor), max_pos=32)
            if name == "qwen35-packed":       # the q|k|v|z GEMM beside beta|alpha: the one whose partials defer
                C, V = cfg.gdn_conv_dim, cfg.gdn_value_dim
                assert model.layers[0]["in_proj"].main_cols() == (0, C + V)
            kv, buf = cache(cfg), model.buffers(2)
            for r in (slice(0, 2), slice(2, 4)):
                h = model.hidden(tokens[r], positions[r], slots[r], kv, buf)
            got[honor] = (h.clone(), model.logits(h).float())
        _exact(got[True][0], got[False][0], f"{name} residual stream")
        _exact(got[True][1], got[False][1], f"{name} logits")


@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="runs the tests above in a child interpreter process on CPU hosts")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, _msg(""), KERNEL_TEST_SEED=str(SEED))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fold", [False, True])
def test_mma_defer_matches_its_reduce(fold):
    """The CUDA kernels' partials (nvrtc.run_packed) through the consumers: the reduce kernel's bits."""
    from onepass.kernels import int4_mma
    from tests.test_int4_gemm import _weight, _x

    if not int4_mma.available():
        pytest.skip("no NVRTC binding or no sm_80+ device")
    N, K = 5120, 6144                             # 12 splits in the folded form
    pw, xs = _weight("q4_k", N, K, SEED % 1000, device="cuda")
    w = (torch.rand(N, generator=_gen(3)) + 0.5).bfloat16().cuda()
    for M in (1, 8, 32):
        x = _x(SEED + M, M, K, xs, device="cuda")
        res = torch.randn(M, N, generator=_gen(M)).bfloat16().cuda()
        split = int4_mma.w4a16_mma(x, pw, torch.empty(M, N, dtype=x.dtype, device="cuda"), fold=fold, defer=True)
        full = int4_mma.w4a16_mma(x, pw, fold=fold)
        assert isinstance(split, SplitSums) and split.splits > 1
        _exact(split.reduce(), full, f"M={M} fold={fold}")
        r1, r2 = res.clone(), res.clone()
        _exact(add_rms_norm_triton(split, r2, w, 1e-6)[0], add_rms_norm_triton(full, r1, w, 1e-6)[0], f"M={M}")
        _exact(r2, r1, f"M={M}")
