"""Weights kept quantized, end to end on the CPU: the loader's keep_quantized, the fused decoder on packed
weights, the int4 dispatch (table lookup, rule, fallbacks, the table printed from recorded runs) and the
dequantize-into-workspace kernel (Triton's interpreter).

GPU tests live in tests/test_nvrtc.py (every dispatch variant vs reference), the CUDA kernels' own tests and
tests/test_gpu_int4_smollm2.py.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from onepass.engine.config import ModelConfig  # noqa: E402
from onepass.engine.fused_model import FusedDecoder  # noqa: E402
from onepass.engine.gguf_loader import load_gguf  # noqa: E402
from onepass.engine.gguf_writer import random_weights, write_gguf  # noqa: E402
from onepass.engine.kv_cache import ContiguousKVCache  # noqa: E402
from onepass.kernels.quant_pack import PackedWeight, pack, unpack_ref  # noqa: E402
from onepass.engine.runner import run_static  # noqa: E402
from onepass.harness import int4_tables as tables  # noqa: E402
from onepass.kernels import int4_dispatch as disp, nvrtc  # noqa: E402
from onepass.kernels.backend import get_step_kernels  # noqa: E402
from onepass.kernels.int4_gemm import _INTERPRETED, w4a16_linear_ref  # noqa: E402
from tests.conftest import TINY_LLAMA, TINY_QWEN3  # noqa: E402
from tests.interpreter import run_in_interpreter  # noqa: E402

# Q4_K needs rows that are multiples of 256
WIDE_LLAMA = ModelConfig(arch="llama", n_layers=1, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                         vocab_size=256, rope_theta=10000.0, name="wide-llama")
CASES = {"q4_0": TINY_LLAMA, "q4_1": TINY_LLAMA, "q8_0": TINY_QWEN3, "q4_k": WIDE_LLAMA}


@pytest.fixture(scope="module")
def quant_ggufs(tmp_path_factory):
    d = tmp_path_factory.mktemp("int4")
    out = {}
    for fmt, cfg in CASES.items():
        path = d / f"{cfg.name}-{fmt}.gguf"
        write_gguf(path, cfg, random_weights(cfg, seed=3), weight_type=fmt)
        out[fmt] = path
    return out


@pytest.mark.parametrize("fmt", list(CASES))
def test_keep_quantized_unpacks_to_the_dequantized_weights(quant_ggufs, fmt):
    cfg, dense, _ = load_gguf(quant_ggufs[fmt], progress=False)
    cfg2, packed, _ = load_gguf(quant_ggufs[fmt], progress=False, keep_quantized=True)
    assert cfg2 == cfg and packed.keys() - {"output.weight"} == dense.keys() - {"output.weight"}
    if cfg.tie_embeddings:   # the tied head is the packed embedding itself: one copy
        assert packed.pop("output.weight") is packed["token_embd.weight"]
    n_packed = 0
    for name, w in packed.items():
        if isinstance(w, PackedWeight):
            n_packed += 1
            assert w.fmt == fmt and w.shape == tuple(dense[name].shape), name
            assert torch.equal(unpack_ref(w), dense[name]), f"{name}: unpack differs from the dequantized weight"
        else:
            assert torch.equal(w, dense[name]), name
    assert isinstance(packed["token_embd.weight"], PackedWeight)          # its gather decodes rows on the fly
    assert n_packed == 7 * cfg.n_layers + (1 if cfg.tie_embeddings else 2)


def _run(path, batch, prompt, new, packed):
    cfg, w, _ = load_gguf(path, progress=False, keep_quantized=packed)
    model = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=128)
    kv = ContiguousKVCache(cfg, batch + 1, 64, torch.float32, "cpu")
    return model, run_static(model, kv, [prompt] * batch, new, use_graphs=False)


@pytest.mark.parametrize("fmt", list(CASES))
def test_fused_decoder_packed_matches_dequantized(quant_ggufs, fmt):
    prompt = torch.randint(3, 256, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    m_dense, dense = _run(quant_ggufs[fmt], 3, prompt, 10, packed=False)
    m_packed, packed = _run(quant_ggufs[fmt], 3, prompt, 10, packed=True)
    assert packed.outputs == dense.outputs
    qkv, gate_up = m_packed.layers[0]["qkv"].weights, m_packed.layers[0]["gate_up"].weights
    assert len(qkv) == len(gate_up) == 1                     # each one fused GEMM
    assert isinstance(qkv[0], PackedWeight) and isinstance(gate_up[0], PackedWeight)
    assert torch.equal(unpack_ref(qkv[0]), m_dense.layers[0]["qkv"].weights[0])
    assert m_packed.weight_bytes() < m_dense.weight_bytes()
    for name in ("qkv", "gate_up"):     # fp32 dense vs <= 8.5 bits per weight packed
        pw, w = m_packed.layers[0][name].weights[0], m_dense.layers[0][name].weights[0]
        assert pw.nbytes <= w.numel() * 8.5 / 8 * 1.03


def test_projection_of_mixed_formats():
    """Weights of one format fuse into one packed GEMM; mixed formats are dequantized into one dense GEMM
    (dequant_mixed, the plain decoder's choice) or run as one GEMM each into column slices (the hybrid's)."""
    from onepass.engine.projection import Projection

    g = torch.Generator().manual_seed(0)
    a = pack(torch.randint(0, 256, (4, 18), generator=g, dtype=torch.uint8), "q4_0", (4, 32))
    b = pack(torch.randint(0, 256, (2, 34), generator=g, dtype=torch.uint8), "q8_0", (2, 32))
    a.scales.fill_(0.25)
    b.scales.fill_(0.5)
    k = get_step_kernels("torch")
    x = torch.randn(3, 32, generator=g)
    want = x @ torch.cat([unpack_ref(a), unpack_ref(b)]).T
    fused = Projection([a, b], k, dequant_mixed=torch.float32)
    assert len(fused.weights) == 1 and isinstance(fused.weights[0], torch.Tensor)
    assert torch.equal(fused.weights[0], torch.cat([unpack_ref(a), unpack_ref(b)]))
    split = Projection([a, b], k)
    assert [w.fmt for w in split.weights] == ["q4_0", "q8_0"] and split.cols == [(0, 4), (4, 6)]
    for p in (fused, split):
        assert torch.allclose(p(x, torch.empty(3, 6)), want, rtol=1e-5, atol=1e-5)
    same = Projection([a, a], k, dequant_mixed=torch.float32)
    assert len(same.weights) == 1 and isinstance(same.weights[0], PackedWeight) and same.weights[0].N == 8


# --------------------------------------------------------------------------------------------------
# dispatch

def test_choose_rule_table_and_policies(monkeypatch):
    monkeypatch.setattr(disp, "MEASURED", {})
    for mod in (nvrtc, disp.int4_mma, disp.int4_wgmma):   # the rule's inputs pinned: the same on any machine
        monkeypatch.setattr(mod, "available", lambda: False)
    inv = disp.Int4Policy
    assert disp.choose(1, 5120, 17408, "q4_0", "invariant") == "triton"        # rule until measured
    monkeypatch.setattr(disp.int4_mma, "available", lambda: True)
    assert disp.choose(1, 5120, 17408, "q4_0", inv("invariant", 8)) == "cuda_mma_fold"     # small engine: folded mma
    assert disp.choose(300, 5120, 17408, "q4_0", inv("invariant", 8)) == "cuda_mma_fold"   # for every M it runs
    assert disp.choose(4, 5120, 17408, "q8_0", inv("invariant", 32)) == "cuda_mma_fold"    # Q8_0: the folded form
    assert disp.choose(4, 5120, 17408, "q4_0", inv("invariant", 64)) == "triton"
    monkeypatch.setattr(disp.int4_wgmma, "available", lambda: True)          # sm_90: the ws kernel for big weights
    assert disp.choose(9, 5120, 17408, "q4_0", inv("invariant", 16)) == "cuda_wgmma_ws"
    assert disp.choose(9, 2048, 2048, "q4_0", inv("invariant", 16)) == "cuda_mma_fold"    # small: below BIG
    assert disp.choose(9, 2048, 2048, "q4_0", inv("invariant", 64)) == "triton"
    assert disp.choose(9, 2048, 2048, "q8_0", inv("invariant", 64)) == "cuda_wgmma_ws_t128"  # no 16-bit Triton fold
    monkeypatch.setattr(disp, "MEASURED", {(5120, 17408, "q4_0"): {"invariant": "cuda_wgmma",
                                                                   "invariant_at": {1: "cuda_mma", 32: "triton"}}})
    assert disp.choose(1, 5120, 17408, "q4_0", "invariant") == "cuda_wgmma"   # no engine batch: the one pick
    assert disp.choose(100, 5120, 17408, "q4_0", "invariant") == "cuda_wgmma"  # one variant for every M
    assert disp.choose(100, 5120, 17408, "q4_0", inv("invariant", 1)) == "cuda_mma"
    assert disp.choose(1, 5120, 17408, "q4_0", inv("invariant", 16)) == "triton"   # the next measured B up
    assert disp.choose(1, 5120, 17408, "q4_0", inv("invariant", 512)) == "triton"  # beyond: the last
    assert disp.choose(4, 2048, 2048, "q4_0", "invariant") == "triton"        # other shape: rule
    assert disp.choose(1, 5120, 17408, "q4_0", "cuda_wgmma") == "cuda_wgmma"  # forced
    # a table entry naming no known variant (e.g. a removed one) falls back to the rule
    for gone in ("dequant_cublas", "cuda"):
        monkeypatch.setattr(disp, "MEASURED", {(64, 64, "q4_0"): {"invariant": gone, "invariant_at": {1: gone}}})
        assert disp.choose(1, 64, 64, "q4_0", "invariant") == "triton"
        assert disp.choose(1, 64, 64, "q4_0", inv("invariant", 1)) == disp.rule(1, 64, 64, "q4_0", "invariant", 1)
    for bad in ("fast", "fastest", "dequant_cublas", "cuda"):
        with pytest.raises(ValueError):
            disp.set_policy(bad)
        with pytest.raises(ValueError):
            inv(bad, 8)
    with pytest.raises(ValueError):
        disp.set_policy("invariant", max_batch=0)


def test_step_picks_overrule_the_table_for_their_engine_batch(monkeypatch):
    """STEP_PICKS (picks measured in the graphed step) replace invariant_at's for that engine batch only, the same
    for every M the engine runs; they name batch-invariant kernels that take the weight's format."""
    monkeypatch.setattr(disp, "MEASURED", {(64, 128, "q4_0"): {"invariant": "triton",
                                                              "invariant_at": {1: "cuda_mma", 8: "cuda_mma"}}})
    monkeypatch.setattr(disp, "STEP_PICKS", {(64, 128, "q4_0"): {1: "cuda_mma_fold"}})
    monkeypatch.setattr(disp, "_policy", disp._policy)
    monkeypatch.setattr(disp, "_max_batch", None)
    disp.set_policy("invariant", max_batch=1)
    assert {disp.choose(m, 64, 128, "q4_0") for m in (1, 22)} == {"cuda_mma_fold"}
    disp.set_policy("invariant", max_batch=8)
    assert disp.choose(1, 64, 128, "q4_0") == "cuda_mma"
    disp.set_policy("invariant")
    assert disp.choose(1, 64, 128, "q4_0") == "triton"                  # no engine batch: the all-B pick
    monkeypatch.undo()
    for (n, k, fmt), picks in disp.STEP_PICKS.items():
        assert (n, k, fmt) in disp.MEASURED and set(picks) <= set(disp.MEASURED[(n, k, fmt)]["invariant_at"])
        for v in picks.values():
            assert v in disp.INVARIANT_VARIANTS
            assert (disp.int4_wgmma_ws.supports(fmt) if v.startswith("cuda_wgmma_ws") else
                    disp.int4_mma.supports(fmt, fold=v != "cuda_mma") if v in disp.MMA_VARIANTS else True)


def test_invariant_pick_for_the_engine_batch(monkeypatch):
    """Given the engine's batch, the invariant policy takes the fastest batch-invariant kernel at that B (the next
    measured B up, the last beyond), the same for every M the engine runs; without it, the all-B pick."""
    monkeypatch.setattr(disp, "MEASURED", {(5120, 17408, "q4_k"): {"invariant": "triton",
                                                                   "invariant_at": {1: "cuda_mma_fold", 8: "cuda_mma",
                                                                                    32: "triton"}}})
    monkeypatch.setattr(disp, "_max_batch", None)
    monkeypatch.setattr(disp, "_policy", disp._policy)          # restored after the test
    assert disp.choose(1, 5120, 17408, "q4_k", "invariant") == "triton"
    for max_batch, want in ((1, "cuda_mma_fold"), (5, "cuda_mma"), (8, "cuda_mma"), (20, "triton"), (512, "triton")):
        disp.set_policy("invariant", max_batch=max_batch)
        assert {disp.choose(m, 5120, 17408, "q4_k") for m in (1, max_batch, 22 * max_batch)} == {want}
    # a format not measured on the shape takes a sibling format's picks
    for fmt in ("q4_0", "q4_1"):
        disp.set_policy("invariant", max_batch=5)
        assert disp.choose(1, 5120, 17408, fmt) == "cuda_mma"
    monkeypatch.setitem(disp.MEASURED, (5120, 17408, "q4_1"), {"invariant": "cuda_wgmma"})
    disp.set_policy("invariant")
    assert disp.choose(1, 5120, 17408, "q4_0") == "cuda_wgmma"            # q4_1 before q4_k for q4_0
    assert disp.choose(1, 5120, 17408, "q8_0") == disp.rule(1, 5120, 17408, "q8_0", "invariant")  # no sibling
    # unmeasured shapes: the folded mma kernel for an engine of <= 8 sequences where it runs; then the ws kernel for
    # big weights on sm_90; then the folded kernel to 32; else Triton
    monkeypatch.setattr(disp.int4_mma, "available", lambda: True)
    disp.set_policy("invariant", max_batch=8)
    assert (disp.choose(300, 4096, 4096, "q4_0") == "cuda_mma_fold"
            and disp.choose(1, 4096, 4096, "q8_0") == "cuda_mma_fold")
    disp.set_policy("invariant", max_batch=32)
    assert {disp.choose(m, 4096, 4096, "q4_k") for m in (1, 32, 300)} == {"cuda_mma_fold"}
    disp.set_policy("invariant", max_batch=33)
    assert disp.choose(1, 4096, 4096, "q4_0") == "triton"
    monkeypatch.setattr(disp.int4_wgmma, "available", lambda: True)
    assert {disp.choose(m, 4096, 4096, "q4_0") for m in (1, 33, 300)} == {"cuda_wgmma_ws"}
    assert disp.choose(1, 2048, 2048, "q4_0") == "triton"                 # below BIG
    disp.set_policy("invariant", max_batch=16)
    assert (disp.choose(1, 4096, 4096, "q4_k") == "cuda_wgmma_ws"
            and disp.choose(1, 2048, 2048, "q4_k") == "cuda_mma_fold")
    disp.set_policy("invariant")
    assert disp.choose(1, 4096, 4096, "q4_1") == "cuda_wgmma_ws"           # no engine batch: one pick for every M


def test_runnable_fallbacks(monkeypatch):
    x = torch.zeros(2, 32)
    monkeypatch.setattr(disp, "_INTERPRETED", False)
    n = len(disp.VARIANTS)                             # on the CPU every kernel variant runs the reference
    assert [disp.runnable(v, x) for v in disp.VARIANTS] == ["ref"] * n
    monkeypatch.setattr(disp, "_INTERPRETED", True)
    assert [disp.runnable(v, x) for v in disp.VARIANTS] == ["triton"] * n


@pytest.mark.parametrize("policy", ["invariant", "cuda_mma"])
def test_w4a16_on_cpu_matches_reference(policy, monkeypatch):
    monkeypatch.setattr(disp, "_policy", policy)
    monkeypatch.setattr(disp, "_INTERPRETED", False)   # the CPU path without the interpreter: the reference
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (40, 3 * 20), generator=g, dtype=torch.uint8)
    pw = pack(raw, "q4_1", (40, 96))
    pw.scales.copy_((torch.rand(pw.scales.shape, generator=g) * 0.1).half())
    pw.mins.copy_((torch.randn(pw.mins.shape, generator=g) * 0.1).half())
    x = torch.randn(5, 96, generator=g)
    out = torch.empty(5, 40)
    disp.w4a16(x, pw, out=out)
    torch.testing.assert_close(out, w4a16_linear_ref(x, pw), rtol=1e-5, atol=1e-5)


def test_backend_linear_takes_packed_weights():
    g = torch.Generator().manual_seed(4)
    pw = pack(torch.randint(0, 256, (8, 2 * 18), generator=g, dtype=torch.uint8), "q4_0", (8, 64))
    pw.scales.fill_(0.25)
    x = torch.randn(3, 64, generator=g)
    k = get_step_kernels("torch")
    assert torch.equal(k.linear(x, pw), w4a16_linear_ref(x, pw))
    dense = unpack_ref(pw)
    assert torch.equal(k.linear(x, dense), k.linear(x, pw))


def test_table_entries_from_recorded_runs(tmp_path, capsys):
    import pandas as pd

    rows = []
    for B, (t, c, d) in {1: (10.0, 6.0, 30.0), 16: (12.0, 20.0, 31.0), 128: (25.0, 90.0, 24.0)}.items():
        rows.append({"params.micro.n": "5120", "params.micro.k": "17408", "params.micro.fmt": "q4_0",
                     "params.batch.size": str(B), "metrics.triton_us": t, "metrics.cuda_mma_us": c,
                     "metrics.dequant_cublas_us": d, "metrics.cuda_us": 1.0, "metrics.triton_ok": 1,
                     "metrics.cuda_mma_ok": 1, "metrics.dequant_cublas_ok": 1, "metrics.cuda_ok": 1})
    rows.append({**rows[0], "params.micro.n": "2048", "params.micro.k": "8192", "metrics.cuda_mma_ok": 0})
    df = pd.DataFrame(rows)
    entries = tables.table_entries(df)
    # dequant_cublas and cuda (rows recorded before they were removed) are not variants any more: their times are
    # not read
    assert entries[(5120, 17408, "q4_0")] == {"invariant": "triton",
                                              "invariant_at": {1: "cuda_mma", 16: "triton", 128: "triton"}}
    assert entries[(2048, 8192, "q4_0")] == {"invariant": "triton",   # cuda_mma failed verification
                                             "invariant_at": {1: "triton"}}
    path = tmp_path / "runs.csv"
    df.to_csv(path, index=False)
    out = tmp_path / "table.py"
    assert tables.main(["--csv", str(path), "--out", str(out)]) == 0
    generated = {}
    exec(out.read_text(), generated)                      # the written module holds exactly the entries
    assert generated["MEASURED"] == entries and out.read_text().startswith('"""Generated by onepass-int4-table')
    assert tables.main(["--csv", str(path), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("'triton'", "'cuda_mma'", 1))   # a hand edit is caught
    assert tables.main(["--csv", str(path), "--out", str(out), "--check"]) == 1
    with pytest.raises(SystemExit) as e:                   # a missing file: an argparse error naming it, exit 2
        tables.main(["--csv", str(tmp_path / "missing.csv")])
    assert e.value.code == 2 and "missing.csv: no such file" in capsys.readouterr().err


def test_committed_table_is_what_the_recorded_runs_give():
    """kernels/int4_measured.py is regenerated from experiments/int4_gemm/runs.csv, never edited by hand."""
    assert tables.main(["--check"]) == 0


def test_invariant_pick_is_the_smallest_worst_ratio_not_the_smallest_total():
    """H200 times (us) of 2048x8192 Q4_0 at B = 1..128: cuda_mma has the smaller total (144 vs 148 us) but is
    1.69x the fastest at B = 128, where Triton is never worse than 1.66x: the invariant pick is Triton."""
    import pandas as pd

    B = [1, 2, 4, 8, 16, 32, 64, 128]
    t = {"triton": [12.8, 13.1, 14.8, 14.6, 18.1, 19.1, 25.1, 30.2],
         "cuda_mma": [8.7, 9.0, 9.5, 9.2, 10.9, 17.3, 28.4, 51.0],
         "dequant_cublas": [23.8, 23.7, 23.4, 22.3, 22.6, 23.0, 23.6, 29.0]}
    assert sum(t["cuda_mma"]) < sum(t["triton"])
    df = pd.DataFrame([{"params.micro.n": "2048", "params.micro.k": "8192", "params.micro.fmt": "q4_0",
                        "params.batch.size": str(b), **{f"metrics.{v}_us": t[v][i] for v in t}}
                       for i, b in enumerate(B)])
    entry = tables.table_entries(df)[(2048, 8192, "q4_0")]
    assert entry["invariant"] == "triton"
    # an engine built for B sequences takes the fastest batch-invariant kernel at B
    assert entry["invariant_at"] == {1: "cuda_mma", 2: "cuda_mma", 4: "cuda_mma", 8: "cuda_mma", 16: "cuda_mma",
                                     32: "cuda_mma", 64: "triton", 128: "triton"}


def test_ws_variants_pay_their_chain_cost_in_the_picks():
    """CHAIN_US is added before comparing: a ws variant less than its chain cost faster than another kernel is not
    picked, one faster by more is; the table entries compare with it for every B (random times each run)."""
    import pandas as pd

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cost = tables.CHAIN_US["cuda_wgmma_ws_t128"]
    assert cost > 0 and set(tables.CHAIN_US) == set(disp.WS_CONFIGS)
    base = 10.0 + 40.0 * torch.rand(2, generator=g)
    near, far = (base - cost * torch.tensor([0.5, 1.5])).tolist()
    df = pd.DataFrame([{"params.micro.n": "5120", "params.micro.k": "6144", "params.micro.fmt": "q4_k",
                        "params.batch.size": str(b), "metrics.cuda_wgmma_x2_us": float(base[i]),
                        "metrics.cuda_wgmma_ws_t128_us": ws}
                       for i, (b, ws) in enumerate([(32, near), (128, far)])])
    entry = tables.table_entries(df)[(5120, 6144, "q4_k")]
    assert entry["invariant_at"][32] == "cuda_wgmma_x2"
    assert entry["invariant_at"][128] == "cuda_wgmma_ws_t128"


def test_cuda_modules_import_and_configure_without_cupy():
    from onepass.kernels import int4_mma

    assert nvrtc.available() is False or ON_GPU
    assert int4_mma.available() is False or ON_GPU                          # through nvrtc's binding
    c1, c9 = int4_mma.mma_config(1, 5120, 17408, "q4_0"), int4_mma.mma_config(9, 5120, 17408, "q4_0")
    assert c1["SPLIT_K"] == c9["SPLIT_K"] and c1["groups_per_split"] == c9["groups_per_split"]   # not from M
    S, gps = c1["SPLIT_K"], c1["groups_per_split"]
    assert S * gps >= 17408 // 32 and (S - 1) * gps < 17408 // 32
    src = int4_mma.source("q4_k", 8, False, True, c1["RT"], c1["P"], c1["U"], True)
    assert "#define FMT 2" in src and "#include" not in src


# --------------------------------------------------------------------------------------------------
# the dequantize-into-workspace kernel (interpreter on the CPU)

def _interp_or_gpu() -> bool:
    return ON_GPU or _INTERPRETED


def test_in_interpreter_subprocess():
    if ON_GPU or _INTERPRETED:
        pytest.skip("runs in-process here")
    run_in_interpreter(__file__, "(tests/test_int4_wiring.py)")


def test_measured_picks_name_kernels_that_take_the_format():
    """Every variant the dispatch table names for a (N, K, fmt) runs that format itself (a pick that silently fell back
    to Triton would mean a stale table): Q8_0 never names the exact mma form."""
    takes = {"cuda_mma": lambda f: disp.int4_mma.supports(f),
             "cuda_mma_fold": lambda f: disp.int4_mma.supports(f, fold=True),
             "cuda_mma_fold_lat": lambda f: disp.int4_mma.supports(f, fold=True),
             "cuda_wgmma": disp.int4_wgmma.supports, "cuda_wgmma_x2": disp.int4_wgmma.supports,
             "cuda_wgmma_ws": disp.int4_wgmma_ws.supports, "cuda_wgmma_ws_t128": disp.int4_wgmma_ws.supports}
    for (N, K, fmt), entry in disp.MEASURED.items():
        picks = {v for k, v in entry.items() if k != "invariant_at"} | set(entry.get("invariant_at", {}).values())
        assert picks <= set(disp.VARIANTS), (N, K, fmt, picks)
        bad = [v for v in picks if v in takes and not takes[v](fmt)]
        assert not bad, f"{N}x{K} {fmt}: {bad} do not take {fmt}"
