"""The kernels a hybrid (qwen35) decode step needs beyond StepKernels, bound to the same two backends:
"torch" (the references) or "triton" (GPU; no host sync, no allocation when outputs are given, CUDA-graph
safe). Kept beside StepKernels rather than inside it, so the plain decoders' binding is untouched; the
fused hybrid decoder takes both (engine/fused_qwen35.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from onepass.engine.errors import ConfigError
from onepass.kernels.splitk import SplitSums


@dataclass(frozen=True)
class HybridKernels:
    name: str
    conv_ring_update: Callable     # kernels/gdn.py: causal conv + SiLU over the slot's ring (position 0 = fresh)
    gdn_step: Callable             # kernels/gdn.py: gates + delta rule in place in the state pool (+ its log)
    gated_rms_norm: Callable       # kernels/gdn.py: rms_norm(o) * w * silu(z)
    gated_rope_kv_write: Callable  # kernels/gated_attention.py: q/k norm, partial RoPE, KV write
    sigmoid_gate_mul: Callable     # kernels/gated_attention.py: o * sigmoid(gate)


def get_hybrid_kernels(backend: str) -> HybridKernels:
    """backend: "torch" or "triton"; a StepKernels name such as "triton+cublas" picks its base backend."""
    base = backend.split("+")[0]
    if base == "torch":
        from onepass.kernels.gated_attention import gated_rope_kv_write_ref, sigmoid_gate_mul_ref
        from onepass.kernels.gdn import conv_ring_update_ref, gated_rms_norm_ref, gdn_step_ref

        def conv(x, ring, w, slots, positions=None, seq_len=1, out=None, runs=None):
            if isinstance(x, SplitSums):     # a GEMM's deferred split-K partials: the reduce's value
                x = x.reduce()
            y = conv_ring_update_ref(x, ring, w, slots, positions, seq_len, runs=runs)
            return y if out is None else out.copy_(y)

        def gdn(q, k, v, a, b, A, dt, state, slots, positions=None, seq_len=1, out=None, runs=None, log=None):
            y = gdn_step_ref(q, k, v, a, b, A, dt, state, slots, positions, seq_len, runs=runs, log=log)
            return y if out is None else out.copy_(y)

        return HybridKernels("torch", conv, gdn, gated_rms_norm_ref, gated_rope_kv_write_ref, sigmoid_gate_mul_ref)
    if base == "triton":
        from onepass.kernels.gated_attention import gated_rope_kv_write_triton, sigmoid_gate_mul_triton
        from onepass.kernels.gdn import conv_ring_update_triton, gated_rms_norm_triton, gdn_step_triton

        return HybridKernels("triton", conv_ring_update_triton, gdn_step_triton, gated_rms_norm_triton,
                             gated_rope_kv_write_triton, sigmoid_gate_mul_triton)
    raise ConfigError(f"unknown hybrid kernel backend {backend!r}; choose torch or triton")
