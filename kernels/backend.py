"""The kernels of one decode step, bound to a backend: "torch" (the references; any device, eager)
or "triton" (GPU kernels; no host sync, no allocation when outputs are given, CUDA-graph safe). One binding for
every fused decoder: the hybrid (qwen35) step's GDN and gated-attention kernels are fields beside the rest.

`linear(x, w, out)` takes a dense weight or a PackedWeight (weights kept quantized, kernels/quant_pack.py):
the torch backend then runs the reference (kernels.int4_gemm.w4a16_linear_ref), the triton backend the
int4 dispatch (kernels/int4_dispatch.py: the Triton or a CUDA W4A16 kernel, under the engine's Int4Policy).
`linear(..., defer=True)` may return a GEMM's split-K partials unreduced (kernels/splitk.py: the triton
backend's GEMMs do where they split K); `add_rms_norm` and `swiglu` take them and add them as the reduce
would, so the same bits come out with one launch less. The torch backend always returns the finished output.
`x_image(x, w)` names where the kernel making x should also write it for the GEMM on w (kernels/x_image.py: a ws GEMM's
staged image; None elsewhere, and always on the torch backend); `rms_norm`, `add_rms_norm` and `swiglu` take it as
`image=`, `linear` as `x_image=`, and that GEMM then skips its staging launch."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from onepass.kernels.errors import ConfigError
from onepass.kernels.splitk import SplitSums

STEP_BACKENDS = ("torch", "triton")


def _no_image(x, w):
    return None


@dataclass(frozen=True)
class StepKernels:
    name: str
    embedding: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    add_residual: Callable
    linear: Callable
    rope_kv_write: Callable
    decode_attention: Callable
    swiglu: Callable
    argmax: Callable
    sample: Callable
    # the hybrid step's: causal conv + SiLU over the slot's ring (kernels/gdn.py), the gated delta rule in place in
    # the state pool, rms_norm(o) * w * silu(z); q/k norm + partial RoPE + KV write and o * sigmoid(gate)
    # (kernels/gated_attention.py)
    conv_ring_update: Callable
    gdn_step: Callable
    gated_rms_norm: Callable
    gated_rope_kv_write: Callable
    sigmoid_gate_mul: Callable
    # x_image(x, w): where the kernel making x [M, K] should also write x for linear(x, w, x_image=...) to skip the
    # GEMM's staging launch (kernels/x_image.py), or None. rms_norm, add_rms_norm and swiglu take it as `image`.
    x_image: Callable = _no_image


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if out is None else out.copy_(value)


def _add_residual(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual.add_(x)


def _packed_aware(dense: Callable, packed: Callable) -> Callable:
    """linear(x, w, out): `packed` when w is a PackedWeight (weights kept quantized), else `dense`."""
    from onepass.kernels.quant_pack import PackedWeight

    def linear(x, w, out=None, defer=False, x_image=None):
        if isinstance(w, PackedWeight):
            return packed(x, w, out=out, defer=defer, x_image=x_image)
        return dense(x, w, out=out, defer=defer)

    return linear


def _packed_ref(x, w, out=None, defer=False, x_image=None):
    from onepass.kernels.int4_gemm import w4a16_linear_ref

    return _into(out, w4a16_linear_ref(x, w))


def _packed_dispatch(policy):
    """linear for a packed weight: kernels/int4_dispatch.w4a16 under the engine's Int4Policy."""
    from onepass.kernels.int4_dispatch import w4a16

    def linear(x, w, out=None, defer=False, x_image=None):
        return w4a16(x, w, out=out, defer=defer, x_image=x_image, policy=policy)

    return linear


def _packed_image(policy):
    """x_image: kernels/int4_dispatch.image_for for a packed weight's GEMM on x (None for a dense one)."""
    from onepass.kernels.int4_dispatch import image_for
    from onepass.kernels.quant_pack import PackedWeight

    def x_image(x, w):
        return image_for(x, w, policy) if isinstance(w, PackedWeight) else None

    return x_image


def _write_image(image, y):
    """The torch backend's producers: what the Triton ones store into an image, written by the reference."""
    if image is not None:
        image.write_ref(y)
    return y


def torch_kernels() -> StepKernels:
    from onepass.kernels.attention import attention_ref
    from onepass.kernels.decode_attention import paged_attention_ref
    from onepass.kernels.embedding import embedding_ref
    from onepass.kernels.gated_attention import gated_rope_kv_write_ref, sigmoid_gate_mul_ref
    from onepass.kernels.gdn import conv_ring_update_ref, gated_rms_norm_ref, gdn_step_ref
    from onepass.kernels.gemm import linear_ref
    from onepass.kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref
    from onepass.kernels.rope import rope_kv_write_ref
    from onepass.kernels.sampling import argmax_ref, sample_ref
    from onepass.kernels.swiglu import swiglu_fused_ref

    def add_rms_norm(x, residual, w, eps, out=None, image=None):
        normed, new_res = add_rms_norm_ref(x, residual, w, eps)
        residual.copy_(new_res)
        return _write_image(image, _into(out, normed))

    def decode_attention(q, k_cache, v_cache, slots, positions, *, block_table=None, out=None, workspace=None,
                         max_len=None, scale=None):
        if block_table is not None:
            return _into(out, paged_attention_ref(q, k_cache, v_cache, block_table, slots, positions, scale))
        S = min(max_len or k_cache.shape[1], k_cache.shape[1])   # every position is < max_len: read no further
        o = attention_ref(q.unsqueeze(1), k_cache[slots, :S], v_cache[slots, :S], positions.view(-1, 1))
        return _into(out, o.squeeze(1))

    def conv(x, ring, w, slots, positions=None, seq_len=1, out=None, runs=None, spec=None, draft=None):
        if isinstance(x, SplitSums):     # a GEMM's deferred split-K partials: the reduce's value
            x = x.reduce()
        return _into(out, conv_ring_update_ref(x, ring, w, slots, positions, seq_len, runs=runs, spec=spec,
                                               draft=draft))

    def gdn(q, k, v, a, b, A, dt, state, slots, positions=None, seq_len=1, out=None, runs=None, log=None, spec=None,
            draft=None):
        return _into(out, gdn_step_ref(q, k, v, a, b, A, dt, state, slots, positions, seq_len, runs=runs, log=log,
                                       spec=spec, draft=draft))

    return StepKernels(
        "torch",
        embedding=lambda ids, table, out=None: _into(out, embedding_ref(ids, table)),
        rms_norm=lambda x, w, eps, out=None, image=None: _write_image(image, _into(out, rms_norm_ref(x, w, eps))),
        add_rms_norm=add_rms_norm,
        add_residual=_add_residual,
        linear=_packed_aware(lambda x, w, out=None, defer=False: _into(out, linear_ref(x, w)), _packed_ref),
        rope_kv_write=lambda *a, q_out=None, **kw: _into(q_out, rope_kv_write_ref(*a, **kw)),
        decode_attention=decode_attention,
        swiglu=lambda gu, out=None, image=None: _write_image(image, _into(out, swiglu_fused_ref(gu))),
        argmax=lambda logits, out=None: _into(out, argmax_ref(logits)),
        sample=lambda logits, *a, out=None, **kw: _into(out, sample_ref(logits, *a, **kw)),
        conv_ring_update=conv, gdn_step=gdn, gated_rms_norm=gated_rms_norm_ref,
        gated_rope_kv_write=gated_rope_kv_write_ref, sigmoid_gate_mul=sigmoid_gate_mul_ref,
    )


def triton_kernels(int4=None) -> StepKernels:
    from onepass.kernels.decode_attention import decode_attention
    from onepass.kernels.embedding import embedding_triton
    from onepass.kernels.gated_attention import gated_rope_kv_write_triton, sigmoid_gate_mul_triton
    from onepass.kernels.gdn import conv_ring_update_triton, gated_rms_norm_triton, gdn_step_triton
    from onepass.kernels.gemm import linear
    from onepass.kernels.rmsnorm import add_rms_norm_triton, rms_norm_triton
    from onepass.kernels.rope import rope_kv_write_triton
    from onepass.kernels.sampling import argmax_triton, sample_triton
    from onepass.kernels.swiglu import swiglu_triton

    def add_rms_norm(x, residual, w, eps, out=None, image=None):
        return add_rms_norm_triton(x, residual, w, eps, out=out, image=image)[0]

    return StepKernels("triton", embedding_triton, rms_norm_triton, add_rms_norm, _add_residual,
                       _packed_aware(linear, _packed_dispatch(int4)),
                       rope_kv_write_triton, decode_attention, swiglu_triton, argmax_triton, sample_triton,
                       conv_ring_update_triton, gdn_step_triton, gated_rms_norm_triton, gated_rope_kv_write_triton,
                       sigmoid_gate_mul_triton, x_image=_packed_image(int4))


GEMMS = ("triton", "cublas")


def _cublas_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                   defer: bool = False) -> torch.Tensor:
    return torch.matmul(x, w.t(), out=out)


def get_step_kernels(backend: str, gemm: str = "triton", int4=None) -> StepKernels:
    """`gemm="cublas"` swaps the projections to torch.matmul (fast at some shapes, but its kernel choice
    depends on the row count, so B streams may stop being bit-exact with a single stream). `int4`: the engine's
    kernels.int4_dispatch.Int4Policy for packed weights (None: the process default, set_policy's)."""
    if gemm not in GEMMS:
        raise ConfigError(f"unknown gemm {gemm!r}; choose one of {GEMMS}")
    if backend == "torch":
        kernels = torch_kernels()
    elif backend == "triton":
        kernels = triton_kernels(int4)
    else:
        raise ConfigError(f"unknown step backend {backend!r}; choose one of {STEP_BACKENDS}")
    if gemm == "cublas":
        kernels = replace(kernels, linear=_packed_aware(_cublas_linear, kernels.linear), name=kernels.name + "+cublas")
    return kernels
