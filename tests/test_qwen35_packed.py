"""A qwen35 GGUF loaded with keep_quantized=True (engine.weights=packed): its projections stay packed
(kernels/quant_pack.PackedWeight) and the fused hybrid decoder runs them through kernels.linear's packed path.

Files: tiny synthetic qwen35 GGUFs (engine/gguf_writer) with quantized matrices -- test_fused_qwen35's two
shapes (equal heads, tied head; 3x value heads, untied head, an MTP block) in Q4_0 and Q8_0, and a wider one
(4x value heads, rows of 256) in Q4_K, whose projections are random-but-valid Q4_K blocks.

(a) Every packed projection unpacks (unpack_ref) to exactly the tensor keep_quantized=False returns
    (dequantized, V heads reordered), except ssm_out, which keeps the file's column order: it equals the
    dense weight's columns taken in `blk.N.ssm_out.input_order` (present only when Hv != Hk), and equals the
    file's own dequantized bytes.
(b) FusedQwen35Decoder on the torch backend (fp32; packed GEMMs are x @ unpack_ref(w)^T) gives the logits of
    the same decoder on the dequantized weights within LOGIT_RTOL of the logits' scale (they differ only in
    fp32 summation order: ssm_out's permuted columns, and the qkv|z / beta|alpha GEMMs split where the dense
    path runs one), and identical greedy tokens.
(c) The Triton decoder (bf16, int4 dispatch; under the interpreter on the CPU, in a child process) on the
    packed weights is no further from the fp32 dequantized decoder than the bf16 torch decoder is
    (x BF16_SLACK, test_fused_qwen35's bar), and misses that bar without ssm_out's input order.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
from functools import partial

import pytest
import torch
from gguf import GGUFReader

from onepass.engine.config import ModelConfig
from onepass.engine.fused_qwen35 import FusedQwen35Decoder
from onepass.engine.gguf_loader import (GDN_PACKABLE_PROJECTIONS, INPUT_ORDER, PACKABLE_PROJECTIONS, keeps_packed,
                                load_gguf)
from onepass.engine.gguf_writer import random_weights, write_gguf
from onepass.engine.quant import dequantize
from onepass.kernels.quant_pack import PackedWeight, unpack_ref
from onepass.engine.sampler import SamplingParams
from onepass.engine.state_pool import HybridCache
from onepass.engine.runner import run_static
from onepass.kernels.backend import get_step_kernels
from tests.interpreter import run_in_interpreter
from tests.test_fused_qwen35 import BF16_SLACK, CONFIGS, HAS_CUDA, INTERPRET, needs_kernel, prompt

LOGIT_RTOL = 1e-5  # x max |logit|; measured <= 1.3e-6 (fp32 summation order only)

WIDE = dataclasses.replace(CONFIGS["3x-value-heads"], name="tiny-qwen35-q4k", dim=256, ffn_dim=256, n_heads=2,
                           n_kv_heads=1, head_dim=128, full_attention_interval=2, gdn_k_heads=2, gdn_v_heads=8,
                           gdn_k_dim=16, gdn_v_dim=32, mtp_layers=0)
CASES = {
    "equal-heads-q4_0": (CONFIGS["equal-heads"], "q4_0"),
    "3x-value-heads-q4_0": (CONFIGS["3x-value-heads"], "q4_0"),
    "3x-value-heads-q8_0": (CONFIGS["3x-value-heads"], "q8_0"),
    "4x-value-heads-q4_k": (WIDE, "q4_k"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen35_packed")
    out = {}
    for i, (case, (cfg, fmt)) in enumerate(CASES.items()):
        path = d / f"{case}.gguf"
        write_gguf(path, cfg, random_weights(cfg, seed=40 + i), weight_type=fmt, seed=i)
        out[case] = path
    return out


def load(path, packed):
    return load_gguf(path, progress=False, keep_quantized=packed)


def expected_packed(cfg: ModelConfig) -> set[str]:
    """Every projection keep_quantized packs in these files (all their matrices are packable types)."""
    names = {"token_embd.weight"} | (set() if cfg.tie_embeddings else {"output.weight"})
    for name in cfg.tensor_shapes():
        if name.startswith("blk.") and name.split(".", 2)[2] in PACKABLE_PROJECTIONS + GDN_PACKABLE_PROJECTIONS:
            names.add(name)
    return names


def test_keeps_packed_names():
    cfg = CONFIGS["3x-value-heads"]
    for kind in PACKABLE_PROJECTIONS + GDN_PACKABLE_PROJECTIONS:
        assert keeps_packed(cfg, f"blk.0.{kind}", "q4_k")
    for name in ("blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight", "blk.0.ssm_conv1d.weight", "blk.0.ssm_a",
                 "blk.4.nextn.eh_proj.weight", "blk.0.attn_norm.weight"):
        assert not keeps_packed(cfg, name, "q4_k"), name
    assert keeps_packed(cfg, "token_embd.weight", "q4_k") and not keeps_packed(cfg, "token_embd.weight", "bf16")
    assert keeps_packed(cfg, "output.weight", "q8_0") and not keeps_packed(cfg, "blk.0.attn_qkv.weight", "q6_k")
    llama = dataclasses.replace(CONFIGS["equal-heads"], arch="llama", qk_norm=False)
    assert not keeps_packed(llama, "blk.0.attn_qkv.weight", "q4_0")  # GDN names only for qwen35


@pytest.mark.parametrize("case", CASES)
def test_packed_projections_unpack_to_the_dequantized_weights(files, case):
    cfg, fmt = CASES[case]
    cfg_d, dense, _ = load(files[case], packed=False)
    cfg_p, packed, _ = load(files[case], packed=True)
    assert cfg_p == cfg_d
    reordered = cfg.gdn_v_heads != cfg.gdn_k_heads
    orders = {f"blk.{i}.ssm_out{INPUT_ORDER}" for i in cfg.gdn_layers} if reordered else set()
    extra = orders | ({"output.weight"} if cfg.tie_embeddings else set())
    assert packed.keys() == dense.keys() | extra

    names = {n for n, w in packed.items() if isinstance(w, PackedWeight)}
    assert names == expected_packed(cfg) | ({"output.weight"} if cfg.tie_embeddings else set())
    file_fmts = {w.fmt for w in packed.values() if isinstance(w, PackedWeight)}
    assert file_fmts == {fmt}  # (WIDE's rows are multiples of 256: no Q8_0 fallback in the Q4_K file)
    reader = GGUFReader(files[case])
    raw = {t.name: t for t in reader.tensors}
    for name, w in packed.items():
        if name.endswith(INPUT_ORDER):
            continue
        want = dense["token_embd.weight"] if name == "output.weight" and cfg.tie_embeddings else dense[name]
        if not isinstance(w, PackedWeight):
            assert torch.equal(w, want), name
            continue
        got = unpack_ref(w)
        assert w.shape == tuple(want.shape), name
        if name.endswith(".ssm_out.weight"):
            order = packed.get(name.removesuffix(".weight") + INPUT_ORDER)
            assert (order is not None) == reordered, name
            if order is not None:
                assert sorted(order.tolist()) == list(range(cfg.gdn_value_dim))
                assert not torch.equal(order, torch.arange(cfg.gdn_value_dim))
                want = want.index_select(1, order)  # W_file[:, i] = W[:, order[i]]
            t = raw[name]  # the file's own column order
            file_w = dequantize(torch.from_numpy(np.array(t.data).view(np.uint8)), t.tensor_type, tuple(want.shape))
            assert torch.equal(got, file_w), name
        assert torch.equal(got, want), f"{name}: unpack differs from the dequantized (reordered) weight"
    # the permuted input reproduces the dense GEMM
    for i in cfg.gdn_layers:
        order = packed.get(f"blk.{i}.ssm_out{INPUT_ORDER}")
        if order is not None:
            x = torch.randn(3, cfg.gdn_value_dim, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
            w_file, w = (unpack_ref(packed[f"blk.{i}.ssm_out.weight"]).double(),
                         dense[f"blk.{i}.ssm_out.weight"].double())
            torch.testing.assert_close(x[:, order] @ w_file.T, x @ w.T, rtol=1e-12, atol=1e-12)


def fused(cfg, w):
    return FusedQwen35Decoder(cfg, w, get_step_kernels("torch"), max_pos=128)


def logits_of(model, toks, seq_len):
    kv = HybridCache.create(model.cfg, 1, 64, model.dtype, model.device, torch.float32)
    t = lambda x: torch.as_tensor(x, device=model.device)  # noqa: E731
    hidden = model.hidden(t(toks), t(list(range(len(toks)))), t([0] * len(toks)), kv, model.buffers(len(toks)),
                          seq_len=seq_len)
    return model.logits(hidden).float()


@pytest.mark.parametrize("case", CASES)
def test_fused_decoder_packed_matches_dequantized(files, case):
    cfg, _ = CASES[case]
    _, dense, _ = load(files[case], packed=False)
    _, packed, _ = load(files[case], packed=True)
    m_dense, m_packed = fused(cfg, dense), fused(cfg, packed)
    gdn0 = m_packed.layers[cfg.gdn_layers[0]]
    assert [type(w).__name__ for w in gdn0["in_proj"].weights] == ["PackedWeight", "Tensor"]  # [qkv|z], [beta|alpha]
    assert isinstance(gdn0["out"].weights[0], PackedWeight)
    assert ("out_cols" in gdn0) == (cfg.gdn_v_heads != cfg.gdn_k_heads)
    assert not any("out_cols" in layer for layer in m_dense.layers)  # the dense path is unchanged
    assert isinstance(m_packed.lm_head, PackedWeight)
    assert m_packed.weight_bytes() < m_dense.weight_bytes()

    toks = prompt(50, 9)
    a, b = logits_of(m_packed, toks, len(toks)), logits_of(m_dense, toks, len(toks))
    assert (a - b).abs().max().item() <= LOGIT_RTOL * b.abs().max().item()

    p = prompt(51, 7)
    outs = []
    for model in (m_dense, m_packed):
        kv = HybridCache.create(cfg, 4, 64, torch.float32, "cpu", torch.float32)
        st = partial(run_static, model, kv, sampling=SamplingParams(), use_graphs=False)
        outs.append(st([p] * 3, 10).outputs)
    assert outs[1] == outs[0]
    assert len(set(map(tuple, outs[0]))) == 1


def test_input_order_is_what_makes_ssm_out_right(files):
    """Without the activation permutation the packed file-order ssm_out is wrong (the test can fail)."""
    case = "3x-value-heads-q4_0"
    cfg, _ = CASES[case]
    _, packed, _ = load(files[case], packed=True)
    toks = prompt(52, 6)
    right = logits_of(fused(cfg, packed), toks, 6)
    wrong = logits_of(fused(cfg, {n: w for n, w in packed.items() if not n.endswith(INPUT_ORDER)}), toks, 6)
    assert (right - wrong).abs().max().item() > 100 * LOGIT_RTOL * right.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("case", ["equal-heads-q4_0", "3x-value-heads-q4_0", "4x-value-heads-q4_k"])
def test_triton_packed_within_bf16_error(files, case):
    cfg, _ = CASES[case]
    dev = "cuda" if HAS_CUDA else "cpu"
    toks = prompt(53, 6)

    def run(backend, dtype, packed, drop_order=False):
        _, w, _ = load_gguf(files[case], dtype=dtype, device=dev, progress=False, keep_quantized=packed)
        if drop_order:
            w = {n: t for n, t in w.items() if not n.endswith(INPUT_ORDER)}
        model = FusedQwen35Decoder(cfg, w, get_step_kernels(backend), max_pos=128)
        return logits_of(model, toks, len(toks))

    truth = run("torch", torch.float32, False)
    bar = BF16_SLACK * (run("torch", torch.bfloat16, False) - truth).abs().max().item() \
        + 1e-3 * truth.abs().max().item()
    err = (run("triton", torch.bfloat16, True) - truth).abs().max().item()
    assert err <= bar, (err, bar)
    if cfg.gdn_v_heads != cfg.gdn_k_heads:
        wrong = (run("triton", torch.bfloat16, True, drop_order=True) - truth).abs().max().item()
        assert wrong > bar, (wrong, bar)


@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="kernel tests run in-process here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (Linux-only dependency)")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, "(packed qwen35 under the Triton interpreter)", only_skipped=True)
