"""The hybrid model's small kernels against their torch references: gated q/k norm + partial RoPE + KV write
and the sigmoid output gate (kernels/gated_attention.py), the GDN gated RMSNorm (kernels/gdn.py).

Where they run: as tests/test_kernels_gdn.py (GPU in-process; CPU under TRITON_INTERPRET=1 in-process, or
in a child pytest started by test_cpu_kernels_in_interpreter_subprocess). fp32 results within 1e-5
(reduction order of the norms); bf16 results within 1 bf16 ulp of the largest element (the interpreter
truncates fp32 -> bf16 where the GPU rounds to nearest even; a bf16-rounded norm feeds RoPE). KV values
(v is a copy) and batch invariance are bitwise. Seeds: KERNEL_TEST_SEED=<n> replays a run.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from onepass.kernels.gated_attention import (gate_view, gated_rope_kv_write_ref, gated_rope_kv_write_triton,
                                     sigmoid_gate_mul_ref, sigmoid_gate_mul_triton)
from onepass.kernels.gdn import gated_rms_norm_ref, gated_rms_norm_triton
from onepass.kernels.rope import rope_cache, rope_inv_freq
from tests.interpreter import run_in_interpreter

from tests.kernel_inputs import DEV, HAS_CUDA, INTERPRET, SEED, _gen, _msg, _randn, needs_kernel



def _tol(dtype, ref):
    if dtype == torch.float32:
        return 1e-5 * max(1.0, ref.float().abs().max().item())
    return 2 * 2.0 ** -7 * ref.float().abs().max().item()  # 2 bf16 ulps of the largest element


def _close(out, ref, what):
    tol = _tol(out.dtype, ref)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, _msg(f"{what}: max abs err {err:.3g} > {tol:.3g}")


H, KVH, D = 4, 2, 32


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rd", [8, 32])  # partial (qwen35: a quarter of the head) and full rotary
@pytest.mark.parametrize("paged", [False, True])
def test_gated_rope_kv_write(dtype, rd, paged):
    g = _gen(1 + rd + 100 * paged)
    R, n_slots, ctx = 5, 6, 48
    qkv = _randn(g, R, (2 * H + 2 * KVH) * D, dtype=dtype)
    qn, kn = _randn(g, D, scale=0.1) + 1, _randn(g, D, scale=0.1) + 1
    cs = rope_cache(rope_inv_freq(rd, 1e7), 64).to(DEV)
    slots = torch.tensor([3, 0, -1, 5, 1], device=DEV)
    pos = torch.tensor([0, 17, 4, 47, 33], device=DEV)
    if paged:
        bs, nb = 16, 24
        shape = (nb, bs, KVH, D)
        bt = torch.randperm(nb - 1, generator=g)[:n_slots * 3].view(n_slots, 3).add(1).to(torch.int32).to(DEV)
    else:
        shape, bt = (n_slots, ctx, KVH, D), None
    kc, vc = torch.zeros(shape, dtype=dtype, device=DEV), torch.zeros(shape, dtype=dtype, device=DEV)
    kr, vr = kc.clone(), vc.clone()
    ref = gated_rope_kv_write_ref(qkv, pos, slots, cs, kr, vr, H, KVH, D, rd, qn, kn, 1e-6, block_table=bt)
    out = gated_rope_kv_write_triton(qkv, pos, slots, cs, kc, vc, H, KVH, D, rd, qn, kn, 1e-6, block_table=bt)
    _close(out, ref, f"q rd={rd}")
    _close(kc, kr, f"k cache rd={rd}")
    assert torch.equal(vc, vr), _msg("v cache (a copy)")
    assert kc.abs().sum() > 0
    # the pass-through dims are the normed input, and the gate is never touched
    qkv0 = qkv.clone()
    gated_rope_kv_write_triton(qkv, pos, slots, cs, kc, vc, H, KVH, D, rd, qn, kn, 1e-6, block_table=bt)
    assert torch.equal(qkv, qkv0)
    # batch invariance: a row alone is bitwise the row in the batch
    for r in (1, 4):
        one = gated_rope_kv_write_triton(qkv[r:r + 1], pos[r:r + 1], slots[r:r + 1], cs, kc.clone(), vc.clone(),
                                         H, KVH, D, rd, qn, kn, 1e-6, block_table=bt)
        assert torch.equal(one[0], out[r]), _msg(f"row {r} alone")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_mul(dtype):
    g = _gen(2)
    R = 3
    qkv = _randn(g, R, (2 * H + 2 * KVH) * D, dtype=dtype)
    gate = gate_view(qkv, H, D)
    assert gate.shape == (R, H, D) and not gate.is_contiguous()
    o = _randn(g, R, H, D, dtype=dtype)
    ref = sigmoid_gate_mul_ref(o, gate)
    out = sigmoid_gate_mul_triton(o, gate)
    _close(out, ref, "sigmoid gate")
    sigmoid_gate_mul_triton(o, gate, out=o)  # in place, as the decoder calls it
    assert torch.equal(o, out)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(dtype):
    g = _gen(3)
    R, hv, dv = 3, 6, 16
    o = _randn(g, R, hv, dv)
    zbuf = _randn(g, R, hv * dv + 10, dtype=dtype)
    z = zbuf[:, 3:3 + hv * dv].unflatten(1, (hv, dv))  # a strided view, as in the decoder's fused projection
    w = _randn(g, dv, scale=0.1) + 1
    ref = gated_rms_norm_ref(o, z, w, 1e-6)
    out = gated_rms_norm_triton(o, z, w, 1e-6)
    assert out.dtype == dtype and out.shape == (R, hv * dv)
    _close(out, ref, "gated rms norm")


@needs_kernel
def test_gated_rms_norm_into_permuted_columns():
    """The output written in a permuted column order (a packed ssm_out's file order): the bits of writing it in
    order, then gathering the columns; the reference permutes the same way."""
    g = _gen(4)
    R, hv, dv = 3, 6, 16
    o = _randn(g, R, hv, dv)
    z = _randn(g, R, hv, dv, dtype=torch.bfloat16)
    w = _randn(g, dv, scale=0.1) + 1
    order = torch.randperm(hv * dv, generator=g).to(DEV)        # input column c of ssm_out = grouped column order[c]
    cols = torch.empty_like(order).index_copy_(0, order, torch.arange(hv * dv, device=DEV)).to(torch.int32)
    plain = gated_rms_norm_triton(o, z, w, 1e-6)
    got = gated_rms_norm_triton(o, z, w, 1e-6, out_cols=cols)
    assert torch.equal(got, plain[:, order]), _msg("permuted columns differ from writing in order and gathering")
    _close(gated_rms_norm_ref(o, z, w, 1e-6, out_cols=cols), plain[:, order], "the reference's permuted columns")


@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="kernel tests run in-process here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (Linux-only dependency)")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, _msg(""), KERNEL_TEST_SEED=str(SEED))
