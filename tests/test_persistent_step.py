"""The persistent decode step (kernels/persistent_step.py) against the kernel-per-op step's torch references.

On the CPU its phases run one launch each under Triton's interpreter (a grid barrier cannot open there: the
interpreter runs programs one after another), in a child process (tests/interpreter.py). On a GPU the persistent
launch itself is checked: against the references, against the phased launches bit for bit, and rows against the
single row bit for bit (batch invariance).
"""
from __future__ import annotations

import importlib.util
import inspect
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from onepass.engine.fused_model import FusedDecoder
from onepass.engine.gguf_loader import ROPE_FREQS, load_gguf
from onepass.engine.gguf_writer import random_weights, write_gguf
from onepass.engine.kv_cache import ContiguousKVCache, PagedKVCache
from onepass.engine.step import AUTO_MARGIN
from onepass.kernels.backend import get_step_kernels
from onepass.kernels.errors import ConfigError
from tests.conftest import TINY_LLAMA, TINY_QWEN3
from tests.interpreter import run_in_interpreter
from tests.kernel_inputs import DEV, HAS_CUDA, INTERPRET, SEED, _gen, _msg, needs_kernel

# fp32 on the CPU: the interpreter's run of this kernel in bf16 does not follow the references (seen before and
# after the norm fold); the GPU tests hold the bf16 kernel to them
DT = torch.bfloat16 if DEV.type == "cuda" else torch.float32
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def _model(path):
    cfg, w, _ = load_gguf(path, dtype=DT, device=DEV, progress=False)
    return FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=64)


def _cache(cfg, paged: bool, slots: int = 4, blocks: int = 2):
    """32 positions a slot; paged: blocks of 4 positions, `blocks` of them a slot (its first 4 * blocks positions)."""
    if not paged:
        return ContiguousKVCache(cfg, slots, 32, DT, DEV)
    kv = PagedKVCache(cfg, blocks * slots + 8, 4, slots, 32, DT, DEV)
    perm = torch.randperm(blocks * slots + 7, generator=_gen(7))[: blocks * slots].add(1).tolist()  # 0: the scratch
    kv.set_tables({s: perm[blocks * s: blocks * (s + 1)] + [0] * (8 - blocks) for s in range(slots)})
    return kv


def _history(model, kv, lengths, paged):
    """Each slot's first `lengths[s]` tokens through the reference step (the cache then holds them)."""
    g = _gen(3)
    for s, n in enumerate(lengths):
        toks = torch.randint(3, 200, (n,), generator=g).to(DEV)
        model.hidden(toks, torch.arange(n, device=DEV), torch.full((n,), s, device=DEV), kv, model.buffers(n),
                     block_table=kv.block_table if paged else None)


def _clone(kv):
    c = kv.__class__.__new__(kv.__class__)
    c.__dict__.update(kv.__dict__)
    c.k, c.v = [t.clone() for t in kv.k], [t.clone() for t in kv.v]
    return c


def _step(model, kv, tokens, positions, slots, paged, mode, **settings):
    from onepass.kernels.persistent_step import PersistentStep

    res = model.buffers(len(tokens))["residual"]
    model.k.embedding(tokens, model.embed, out=res)
    settings.setdefault("programs", 3 if DEV.type == "cpu" else None)
    PersistentStep(model, kv, mode=mode, **settings)(positions, slots, res, kv.block_table if paged else None)
    return res


GEMM_FORMS = {   # the K loop's forms, with K chunks small enough that every item takes several
    "hand": dict(block_k=32, stages=0), "pipelined": dict(stages=3, block_k=16),
}


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("paged", [False, True])
def test_phases_match_the_kernel_per_op_references(tiny_ggufs, arch, paged, form=None):
    """Three rows of three slots at different positions: the final residual rows and every layer's cache entries."""
    model = _model(tiny_ggufs[arch])
    kv = _cache(model.cfg, paged)
    _history(model, kv, [5, 1, 7], paged)
    mine = _clone(kv)
    tokens = torch.randint(3, 200, (3,), generator=_gen(4)).to(DEV)
    positions, slots = torch.tensor([5, 1, 7], device=DEV), torch.tensor([0, 1, 2], device=DEV)
    ref = model.hidden(tokens, positions, slots, kv, model.buffers(3), block_table=kv.block_table if paged else None)
    got = _step(model, mine, tokens, positions, slots, paged, "phased", **GEMM_FORMS.get(form, {}))
    tol = TOL[DT]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol, msg=_msg(f"{arch} residual rows"))
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(mine.k[layer].float(), kv.k[layer].float(), rtol=tol, atol=tol,
                                   msg=_msg(f"layer {layer} keys"))
        torch.testing.assert_close(mine.v[layer].float(), kv.v[layer].float(), rtol=tol, atol=tol,
                                   msg=_msg(f"layer {layer} values"))


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("form", GEMM_FORMS)
def test_gemm_forms_match_the_references(tiny_ggufs, arch, form):
    """Each form of the GEMM phases' K loop: by hand item by item, one pipelined loop over items and chunks."""
    test_phases_match_the_kernel_per_op_references(tiny_ggufs, arch, False, form)


# packed formats on the tiny shapes (Q4_K needs rows of 256)
WIDE_LLAMA = replace(TINY_LLAMA, dim=256, head_dim=64, ffn_dim=512, n_layers=1, name="wide-llama")
PACKED = {"q4_0": TINY_LLAMA, "q4_1": TINY_QWEN3, "q8_0": TINY_LLAMA, "q4_k": WIDE_LLAMA}


@needs_kernel
@pytest.mark.parametrize("fmt", PACKED)
def test_packed_weights_read_as_their_dequantized_values(tmp_path, fmt):
    """Weights kept packed (Q4_0/Q4_1/Q4_K/Q8_0) give exactly the step of the same weights held dense in the values
    the kernel decodes each chunk to: in 16-bit (the GPU) the folded ones the int4 kernels multiply (unpack_folded),
    in fp32 (the CPU) the exact ones; and that matches the kernel-per-op references."""
    from onepass.kernels.persistent_step import PROJECTIONS
    from onepass.kernels.quant_pack import unpack_folded

    cfg = PACKED[fmt]
    path = tmp_path / f"{fmt}.gguf"
    write_gguf(path, cfg, random_weights(cfg, seed=5), weight_type=fmt)
    dense, packed = (FusedDecoder(*load_gguf(path, dtype=DT, device=DEV, progress=False, keep_quantized=k)[:2],
                                  get_step_kernels("torch"), max_pos=64) for k in (False, True))
    for d, p in zip(dense.layers, packed.layers):
        for name in PROJECTIONS:
            d[name].weights[0].copy_(unpack_folded(p[name].weights[0], DT))
    kv = _cache(cfg, False)
    _history(dense, kv, [5, 2], False)
    tokens = torch.randint(3, 200, (2,), generator=_gen(8)).to(DEV)
    positions, slots = torch.tensor([5, 2], device=DEV), torch.tensor([0, 1], device=DEV)
    mode = "phased" if DEV.type == "cpu" else "persistent"
    form = dict(stages=3, block_k=32)
    got = _step(packed, _clone(kv), tokens, positions, slots, False, mode, **form)
    want = _step(dense, _clone(kv), tokens, positions, slots, False, mode, **form)
    assert torch.equal(got, want), _msg(f"{fmt}: packed and dequantized steps differ")
    ref = dense.hidden(tokens, positions, slots, _clone(kv), dense.buffers(2))
    torch.testing.assert_close(got.float(), ref.float(), rtol=TOL[DT], atol=TOL[DT], msg=_msg(f"{fmt} residual"))
    with pytest.raises(ConfigError, match="block_k must be a multiple of 32 and stages >= 2"):
        _step(packed, _clone(kv), tokens, positions, slots, False, mode, stages=0)
    packed.layers[0]["o"].weights = dense.layers[0]["o"].weights      # a file of mixed formats
    with pytest.raises(ConfigError, match=f"projections of several formats \\(dense, {fmt}\\)"):
        _step(packed, _clone(kv), tokens, positions, slots, False, mode, **form)


@needs_kernel
@pytest.mark.parametrize("paged", [False, True])
def test_several_rows_of_one_slot(tiny_ggufs, paged):
    """A prompt's rows in one step (positions 2..6 of slot 1, beside a decode row of slot 0): each row attends to the
    rows before it, written in the same step."""
    model = _model(tiny_ggufs["llama"])
    kv = _cache(model.cfg, paged)
    _history(model, kv, [4, 2], paged)
    mine = _clone(kv)
    tokens = torch.randint(3, 200, (6,), generator=_gen(6)).to(DEV)
    positions, slots = torch.tensor([2, 3, 4, 4, 5, 6], device=DEV), torch.tensor([1, 1, 1, 0, 1, 1], device=DEV)
    ref = model.hidden(tokens, positions, slots, kv, model.buffers(6), block_table=kv.block_table if paged else None)
    got = _step(model, mine, tokens, positions, slots, paged, "phased" if DEV.type == "cpu" else "persistent")
    torch.testing.assert_close(got.float(), ref.float(), rtol=TOL[DT], atol=TOL[DT], msg=_msg("prompt rows"))


# rows long enough that attention cuts their keys into splits: on the CPU 8 programs (4 splits at most a row over 2
# kv heads) of 4 keys a step, on the GPU every SM's program (16 splits at most) of tl.dot's least 16 keys
SPLIT_FORM = (dict(block_n_attn=4, attn_keys=4, programs=8) if DEV.type == "cpu" else
              dict(block_n_attn=16, attn_keys=16))


@needs_kernel
@pytest.mark.parametrize("paged", [False, True])
def test_attention_split_over_keys(tiny_ggufs, paged):
    """Rows of 10 to 21 keys, each cut into 2-3 splits merged by the last to finish, a prompt's three rows of one slot
    among them (their keys written in the step fall in different splits): equal to the references; and each row
    equal, bit for bit, to itself stepped alone (a row's splits depend on its own length only)."""
    model = _model(tiny_ggufs["qwen3"])
    kv = _cache(model.cfg, paged, blocks=8)
    _history(model, kv, [20, 9, 13], paged)
    tokens = torch.randint(3, 200, (5,), generator=_gen(8)).to(DEV)
    positions, slots = torch.tensor([20, 9, 10, 11, 13], device=DEV), torch.tensor([0, 1, 1, 1, 2], device=DEV)
    mode = "phased" if DEV.type == "cpu" else "persistent"
    mine = _clone(kv)
    ref = model.hidden(tokens, positions, slots, kv, model.buffers(5), block_table=kv.block_table if paged else None)
    got = _step(model, mine, tokens, positions, slots, paged, mode, **SPLIT_FORM)
    torch.testing.assert_close(got.float(), ref.float(), rtol=TOL[DT], atol=TOL[DT], msg=_msg("split rows"))
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(mine.k[layer].float(), kv.k[layer].float(), rtol=TOL[DT], atol=TOL[DT],
                                   msg=_msg(f"layer {layer} keys"))
    for r in (0, 4):     # the decode rows (a prompt row alone would lack its slot's other rows' keys)
        alone = _step(model, _clone(mine), tokens[r:r + 1], positions[r:r + 1], slots[r:r + 1], paged, mode,
                      **SPLIT_FORM)
        assert torch.equal(alone[0], got[r]), _msg(f"row {r} alone")


@needs_kernel
def test_rows_are_batch_invariant(tiny_ggufs):
    """Each row of a 3-row step equals, bit for bit, the same row stepped alone."""
    model = _model(tiny_ggufs["qwen3"])
    kv = _cache(model.cfg, False)
    _history(model, kv, [4, 6, 2], False)
    tokens = torch.randint(3, 200, (3,), generator=_gen(5)).to(DEV)
    positions, slots = torch.tensor([4, 6, 2], device=DEV), torch.tensor([0, 1, 2], device=DEV)
    mode = "phased" if DEV.type == "cpu" else "persistent"
    together = _step(model, _clone(kv), tokens, positions, slots, False, mode)
    for r in range(3):
        alone = _step(model, _clone(kv), tokens[r:r + 1], positions[r:r + 1], slots[r:r + 1], False, mode)
        assert torch.equal(alone[0], together[r]), _msg(f"row {r}")


def test_refuses_what_it_cannot_run(tiny_ggufs):
    from onepass.kernels.persistent_step import PersistentStep

    cfg, w, _ = load_gguf(tiny_ggufs["llama"], progress=False)
    model = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=64)
    kv = ContiguousKVCache(cfg, 2, 16, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="stages=1; 0 \\(by hand\\) or >= 2"):
        PersistentStep(model, kv, stages=1)
    model.cfg = type(cfg)(**{**cfg.__dict__, "arch": "qwen35"})
    with pytest.raises(ConfigError, match="architecture 'qwen35'.*engine.step=kernels"):
        PersistentStep(model, kv)


def compiled_for_sm90(test):
    """A test that compiles the persistent kernel for a Hopper target (no GPU needed; not under the interpreter)."""
    marks = (pytest.mark.compile_only,
             pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (Linux-only dependency)"),
             pytest.mark.skipif(INTERPRET, reason="under TRITON_INTERPRET kernels are interpreted, not compiled"))
    for mark in marks:
        test = mark(test)
    return test


@compiled_for_sm90
@pytest.mark.parametrize("form", ["hand", "pipelined"])
def test_compiled_kernel_reads_weights_in_16_byte_loads(form):
    """The persistent kernel as a Hopper launch would compile it (no GPU needed): every layer's tensors are reached by
    an offset loaded at run time, and without an alignment hint on it Triton read each weight 2 bytes a load (and
    the pipelined loop got no cp.async). Bf16 weights; K chunks that divide the rows."""
    from onepass.kernels.persistent_step import PersistentStep

    cfg = replace(WIDE_LLAMA, n_layers=2)
    w = {k: v if k == ROPE_FREQS else v.to(torch.bfloat16) for k, v in random_weights(cfg, seed=2).items()}
    model = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=64)
    kv = ContiguousKVCache(cfg, 2, 32, torch.bfloat16, "cpu")
    settings = dict(block_k=128, stages=0) if form == "hand" else dict(block_k=128, stages=3)
    step = PersistentStep(model, kv, programs=4, **settings)
    assert step.align == 16, "torch's allocations are 16-element aligned: the hint must say so"
    res = model.buffers(2)["residual"]
    ptx = step.compile_for(torch.tensor([3, 4]), torch.tensor([0, 1]), res).asm["ptx"]
    loads = re.findall(r"\b(ld\.global[\w:.]*|cp\.async\.c[ag]\.shared\.global[\w:.]*)", ptx)
    if form == "hand":
        weight_loads = [op for op in loads if "evict_first" in op]     # the K loop marks its weight reads so
        assert weight_loads and all(".v4." in op for op in weight_loads), Counter(weight_loads)
    else:   # weights through cp.async into shared memory, 16 bytes a copy (unhinted, they were 2-byte plain loads)
        copies = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx)
        assert copies and set(copies) == {"0x10"}, Counter(copies)


@compiled_for_sm90
def test_split_phases_stay_pipelined():
    """Phases whose K ranges are cut in splits keep their weight reads in the pipelined cp.async loop: a CTA barrier
    in the split's bookkeeping (tl.debug_barrier) once kept Triton from pipelining it, and the reads went plain."""
    from onepass.kernels.persistent_step import PersistentStep

    cfg = replace(WIDE_LLAMA, n_layers=2)
    w = {k: v if k == ROPE_FREQS else v.to(torch.bfloat16) for k, v in random_weights(cfg, seed=2).items()}
    model = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=64)
    kv = ContiguousKVCache(cfg, 2, 32, torch.bfloat16, "cpu")
    copies = {}
    for balance in (0, 90):
        step = PersistentStep(model, kv, programs=3, block_k=64, balance=balance)
        ptx = step.compile_for(torch.tensor([3, 4]), torch.tensor([0, 1]), model.buffers(2)["residual"]).asm["ptx"]
        copies[balance] = (ptx.count("cp.async.cg.shared.global"), step.splits)
    assert max(copies[90][1].values()) > 1 and copies[90][0] >= copies[0][0], copies


@compiled_for_sm90
@pytest.mark.parametrize("fmt", ["q4_0", "q4_k"])
def test_packed_scales_are_copied_ahead(fmt):
    """A packed step's scales, mins and sub-scales (2- and 1-byte values) reach the K loop by cp.async like its words:
    read one value a load, they stayed out of the pipeline (cp.async moves 4 bytes or more), and each K chunk waited
    a memory latency for them (Q4_0 Llama-1B layers 1,894 us against the kernel-per-op 616 us on the H100)."""
    from onepass.harness.synth import random_packed
    from onepass.kernels import persistent_step
    from onepass.kernels.persistent_step import PersistentStep

    cfg = replace(WIDE_LLAMA, n_layers=2)
    w = {k: v if k == ROPE_FREQS else v.to(torch.bfloat16) for k, v in random_weights(cfg, seed=2).items()}
    g = torch.Generator().manual_seed(3)
    w.update({k: random_packed(tuple(v.shape), fmt, v.shape[1] ** -0.5, "cpu", g) for k, v in w.items()
              if k.startswith("blk.") and v.dim() == 2})
    model = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=64)
    step = PersistentStep(model, ContiguousKVCache(cfg, 2, 32, torch.bfloat16, "cpu"), programs=4)
    assert step.fmt >= 0
    ptx = step.compile_for(torch.tensor([3, 4]), torch.tensor([0, 1]), model.buffers(2)["residual"]).asm["ptx"]
    # the loads made for a packed chunk: those whose inlined source chain passes through _packed_chunk's lines
    src, first = inspect.getsourcelines(persistent_step._packed_chunk.fn)
    chunk = {f"persistent_step.py:{first + i}:" for i in range(len(src))}
    narrow, where = [], ""
    for line in ptx.splitlines():
        if ".loc" in line:
            where = line.partition("//")[2]
        elif re.search(r"\bld\.global[\w:.]*\.[bsu](?:8|16)\b", line) and any(c in where for c in chunk):
            narrow.append(where.strip())
    assert not narrow and "cp.async.ca.shared.global" in ptx, Counter(narrow)


@compiled_for_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_default_form_fits_hopper_shared_memory(dtype):
    """The default form's pipeline stages, compiled for Hopper, fit its 227 KB of shared memory a block, in bf16 and
    fp32 (whose chunks are halved to the same bytes): fp32 steps of 512-wide chunks failed to launch on the H100."""
    from onepass.kernels.persistent_step import PersistentStep

    cfg = replace(WIDE_LLAMA, n_layers=2)
    w = {k: v if k == ROPE_FREQS else v.to(dtype) for k, v in random_weights(cfg, seed=2).items()}
    model = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=64)
    step = PersistentStep(model, ContiguousKVCache(cfg, 2, 32, dtype, "cpu"), programs=4)
    shared = step.compile_for(torch.tensor([3, 4]), torch.tensor([0, 1]), model.buffers(2)["residual"]).metadata.shared
    assert 0 < shared <= 232448, f"{dtype}: {shared} B of shared memory"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("form", GEMM_FORMS)
def test_persistent_launch_equals_its_phases(tiny_ggufs, arch, paged, form):
    """One launch with grid barriers computes exactly what one launch per phase does, at R = 1, 5 and 16, in each form
    of the GEMM phases' K loop."""
    model = _model(tiny_ggufs[arch])
    kv = _cache(model.cfg, paged, slots=16)
    _history(model, kv, [3 + s % 5 for s in range(16)], paged)
    for R in (1, 5, 16):
        tokens = torch.randint(3, 200, (R,), generator=_gen(R)).to(DEV)
        slots = torch.arange(R, device=DEV)
        positions = torch.tensor([3 + s % 5 for s in range(R)], device=DEV)
        a, b = _clone(kv), _clone(kv)
        one = _step(model, a, tokens, positions, slots, paged, "persistent", **GEMM_FORMS[form])
        phased = _step(model, b, tokens, positions, slots, paged, "phased", **GEMM_FORMS[form])
        assert torch.equal(one, phased), _msg(f"{arch} R={R}")
        for layer in range(model.cfg.n_layers):
            assert torch.equal(a.k[layer], b.k[layer]) and torch.equal(a.v[layer], b.v[layer])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_two_programs_an_sm_equal_phases(tiny_ggufs):
    """per_sm=2: twice the programs, each phase's units spread over both of an SM's. The same bits as the phases."""
    model = _model(tiny_ggufs["llama"])
    kv = _cache(model.cfg, False, slots=16)
    _history(model, kv, [3 + s % 5 for s in range(16)], False)
    tokens = torch.randint(3, 200, (5,), generator=_gen(5)).to(DEV)
    slots, positions = torch.arange(5, device=DEV), torch.tensor([3 + s % 5 for s in range(5)], device=DEV)
    a, b = _clone(kv), _clone(kv)
    one = _step(model, a, tokens, positions, slots, False, "persistent", per_sm=2)
    phased = _step(model, b, tokens, positions, slots, False, "phased", per_sm=2)
    assert torch.equal(one, phased), _msg("per_sm=2")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_timed_launch_stamps_every_barrier(tiny_ggufs):
    """timed=True: the same bits as an untimed launch; every phase takes a positive time, of which the barrier's part
    (from the last program's arrival, stamped before its release, to program 0 leaving) is no more than the phase
    and positive in all; no program works longer in a phase than the phase lasts, nor the mean longer than the
    slowest."""
    from onepass.kernels.persistent_step import PersistentStep

    model = _model(tiny_ggufs["llama"])
    kv = _cache(model.cfg, False)
    _history(model, kv, [3, 4], False)
    tokens = torch.randint(3, 200, (2,), generator=_gen(9)).to(DEV)
    slots, positions = torch.arange(2, device=DEV), torch.tensor([3, 4], device=DEV)
    plain = _step(model, _clone(kv), tokens, positions, slots, False, "persistent")
    res = model.buffers(2)["residual"]
    model.k.embedding(tokens, model.embed, out=res)
    step = PersistentStep(model, _clone(kv), timed=True)
    step(positions, slots, res)
    torch.cuda.synchronize()
    assert torch.equal(res, plain)
    st = step.stamped_us()
    time, sync, slowest, mean = st["time"], st["sync"], st["slowest"], st["mean"]
    assert all(time[p] > 0 for p in time), st
    assert all(0 <= sync[p] <= time[p] for p in time) and sum(sync.values()) > 0, st
    # a program's work sits between the opening it saw and the closing barrier's last arrival: within the phase,
    # but for the spread of the exits it is measured from (each program's own; a few us at most)
    assert all(0 <= mean[p] <= slowest[p] <= time[p] + 5 for p in time), st


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_barrier_alone_costs_a_positive_time_each():
    """The barrier-only kernel passes all its barriers (a barrier that never opened would hang the test: the GPU
    job's time limit) and stamps each: a positive period, of which the sync part is no more than it."""
    from onepass.kernels.persistent_step import barrier_cost_us

    props = torch.cuda.get_device_properties(0)
    cost = barrier_cost_us(props.multi_processor_count, 64, torch.device("cuda"))
    assert 0 < cost["sync"] <= cost["period"] < 100, cost


def test_programs_an_sm_holds():
    """The residency check's arithmetic on Hopper's SM (64 K registers, 228 KB shared memory, 2,048 threads): which
    limit binds, so a form whose programs cannot all be resident is refused before it hangs at a barrier."""
    from types import SimpleNamespace

    from onepass.kernels.persistent_step import programs_an_sm_holds

    sm90 = SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                           max_threads_per_multi_processor=2048)
    assert programs_an_sm_holds(255, 56320, 4, sm90) == 2       # registers: 8 warps of 256 a thread
    assert programs_an_sm_holds(255, 56320, 8, sm90) == 1
    assert programs_an_sm_holds(64, 56320, 4, sm90) == 4        # shared memory: 4 x 57 KB (registers: 8)
    assert programs_an_sm_holds(168, 1024, 4, sm90) == 3        # 168 a thread: 3 warps a quarter of 16 K
    assert programs_an_sm_holds(32, 0, 16, sm90) == 4           # threads: 4 x 512
    assert programs_an_sm_holds(255, 120000, 4, sm90) == 1


@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="kernel tests run in-process here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (Linux-only dependency)")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, _msg(""), KERNEL_TEST_SEED=str(SEED))


def test_engine_step_setting_is_checked_before_a_model_loads(tiny_ggufs):
    """A misspelled step, the persistent step on the CPU, and on an architecture it does not run: refused from the
    settings and the file's header alone (Engine.from_gguf checks both before load_gguf)."""
    from onepass.engine.engine import EngineSpec
    from onepass.engine.gguf_loader import read_config

    with pytest.raises(ConfigError, match="engine.step='fused'; choose kernels, persistent or auto"):
        EngineSpec(step="fused").resolve()
    with pytest.raises(ConfigError, match="engine.step=persistent is a GPU kernel"):
        EngineSpec(device="cpu", step="persistent").resolve()
    cfg = read_config(tiny_ggufs["llama"])
    EngineSpec(step="persistent").check_model(cfg)
    with pytest.raises(ConfigError, match="not 'qwen35'"):
        EngineSpec(step="persistent").check_model(type(cfg)(**{**cfg.__dict__, "arch": "qwen35"}))


def test_persistent_form_setting(tiny_ggufs):
    """engine.persistent_form: settings parsed by name, a misspelled or non-integer one refused before a model loads;
    the model builds its persistent step in them, and another form drops the built step and auto's measurements."""
    from onepass.engine.engine import EngineSpec
    from onepass.kernels.persistent_step import parse_form

    assert parse_form("") == {} and parse_form(" block_k=256, stages=3 ") == {"block_k": 256, "stages": 3}
    with pytest.raises(ConfigError, match="'blockk=256' is not one of block_k=<int>, num_warps=<int>"):
        EngineSpec(persistent_form="blockk=256").resolve()
    with pytest.raises(ConfigError, match="stages takes an integer, got 'two'"):
        EngineSpec(persistent_form="stages=two").resolve()
    cfg, w, _ = load_gguf(tiny_ggufs["llama"], progress=False)
    model = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=64, step="auto",
                         persistent_form="block_k=32,stages=2")
    kv = ContiguousKVCache(cfg, 2, 16, torch.float32, "cpu")
    step = model.persistent_step(kv)
    assert (step.block_k, step.stages) == (32, 2) and model.persistent_step(kv) is step
    with pytest.raises(ConfigError, match="per_sm=0; give 1 or more"):
        type(step)(model, kv, per_sm=0)
    with pytest.raises(ConfigError, match="attn_keys=24; give a multiple of block_n_attn"):
        type(step)(model, kv, attn_keys=24)
    model.choice, model.pick_us[4] = True, (2.0, 1.0)
    model.set_step("auto", "block_k=32,stages=2")          # the same form: kept
    assert model.persistent_step(kv) is step and model.choice is True
    model.set_step("auto", "block_k=64,stages=0")
    assert model.choice is None and model.pick_us == {}
    assert (model.persistent_step(kv).block_k, model.persistent_step(kv).stages) == (64, 0)


def test_auto_step_takes_one_form_for_every_row_count(tiny_ggufs):
    """engine.step=auto: once decided, every step of up to 16 rows takes the same form (a request's tokens must not
    depend on how many rows share its step: at per-count picks, a batch of 4 on one form diverged from its single
    stream on the other); undecided, wider steps and the CPU take the kernel-per-op step; the decision outlives a
    change of form and back."""
    from onepass.engine.engine import EngineSpec

    EngineSpec(device="cpu", step="auto").resolve()     # the CPU runs auto as kernel-per-op
    cfg, w, _ = load_gguf(tiny_ggufs["llama"], progress=False)
    model = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=64, step="auto")
    assert model.choice is None and not model.takes_persistent(1)
    model.choice = True
    assert all(model.takes_persistent(r) for r in (1, 3, 4, 16)) and not model.takes_persistent(17)
    model.set_step("kernels")
    assert not model.takes_persistent(4)
    model.set_step("persistent")
    assert model.takes_persistent(2) and not model.takes_persistent(17)
    model.set_step("auto")
    assert model.choice is True and model.takes_persistent(1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_auto_step_measures_both_forms_at_capture(tiny_ggufs):
    """A graphed static batch under engine.step=auto times both forms for every bucket of up to 16 rows, keeps the
    faster, and its greedy tokens equal the kernel-per-op step's (fp32: the forms round alike)."""
    from onepass.engine.runner import run_static

    cfg, w, _ = load_gguf(tiny_ggufs["qwen3"], dtype=torch.float32, device=DEV, progress=False)
    prompts = [torch.randint(3, 200, (6,), generator=_gen(9 + i)).tolist() for i in range(3)]
    outs = {}
    for step in ("kernels", "auto"):   # fp32 projections through cuBLAS (the Triton GEMM takes 16-bit inputs)
        model = FusedDecoder(cfg, w, get_step_kernels("triton", "cublas"), max_pos=64, step=step)
        outs[step] = run_static(model, ContiguousKVCache(cfg, 4, 48, torch.float32, DEV), prompts, 12).outputs
    assert 4 in model.pick_us and set(model.pick_us) <= {1, 2, 4, 8, 16}, model.pick_us   # B = 3: the 4-row bucket
    assert all(k > 0 and p > 0 for k, p in model.pick_us.values()), model.pick_us
    assert set(model.pick_rows) <= set(model.pick_us) and model.choice == (
        sum(model.pick_us[r][1] for r in model.pick_rows)
        < (1 - AUTO_MARGIN) * sum(model.pick_us[r][0] for r in model.pick_rows))
    assert outs["auto"] == outs["kernels"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("mode,prefill,layout,prefix", [("continuous", "chunked", "paged", "auto"),
                                                        ("continuous", "token", "contiguous", "off"),
                                                        ("static", "chunked", "paged", "off")])
def test_persistent_step_serves_every_schedule(tiny_ggufs, mode, prefill, layout, prefix):
    """Under each scheduler mode, graphed: a step's decode rows (up to 16) take the persistent kernel, prompt chunks
    and wider steps the kernel-per-op path, paged caches and reused prefix blocks included; every request's tokens
    equal the kernel-per-op engine's (fp32: the two forms round alike), with slots refilled mid-run."""
    from onepass.engine.block_manager import BlockManager
    from onepass.engine.runner import Runner
    from onepass.engine.sampler import SamplingParams
    from onepass.engine.scheduler import Request, Scheduler

    cfg, w, _ = load_gguf(tiny_ggufs["llama"], dtype=torch.float32, device=DEV, progress=False)
    g = _gen(11)
    shared = torch.randint(3, 200, (20,), generator=g).tolist()    # a whole 16-token block to reuse
    prompts = [(shared if i % 2 else []) + torch.randint(3, 200, (2 + i,), generator=g).tolist() for i in range(7)]
    max_new = [4 + (5 * i) % 9 for i in range(7)]
    outs = {}
    for step in ("kernels", "persistent"):
        model = FusedDecoder(cfg, w, get_step_kernels("triton", "cublas"), max_pos=65, step=step)   # fp32: cuBLAS
        # blocks of 16: the kernel-per-op step's paged attention reads no smaller ones
        bm = BlockManager(24, 16, prefix_caching=prefix == "auto") if layout == "paged" else None
        kv = (PagedKVCache(cfg, 24, 16, 3, 64, torch.float32, DEV) if layout == "paged"
              else ContiguousKVCache(cfg, 4, 64, torch.float32, DEV))
        runner = Runner(model, kv, Scheduler(3, mode, prefill, 16, bm, 64), SamplingParams())
        res = runner.run([Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))])
        assert not res.rejected
        outs[step] = {r.rid: r.output for r in res.finished}
    assert model._persistent is not None, "no step took the persistent kernel"
    assert outs["persistent"] == outs["kernels"] and len(outs["kernels"]) == 7


def test_auto_step_keeps_the_kernel_per_op_form_where_the_persistent_one_cannot_run(tiny_ggufs, monkeypatch):
    """auto never fails a run for the persistent form's sake: a model it cannot take, or a persistent kernel that
    does not build on this GPU, leaves every bucket on the kernel-per-op step with the reason kept for the job's log."""
    from onepass.engine.sampler import SamplingParams
    from onepass.engine.step import Step

    cfg, w, _ = load_gguf(tiny_ggufs["llama"], progress=False)
    model = FusedDecoder(cfg, w, get_step_kernels("torch"), max_pos=64, step="auto")
    step = Step(model, ContiguousKVCache(cfg, 3, 16, torch.float32, "cpu"), 2, 2, SamplingParams(), paged=False,
                use_graphs=False)

    def no_build(kv):
        raise RuntimeError("out of shared memory")

    monkeypatch.setattr(model, "persistent_step", no_build)
    # a static batch with batched prefill captures no layer bucket: its lockstep's rows (2 slots: 2) are timed still
    assert step._pick_buckets([]) == [2] and step._pick_buckets([1, 4]) == [1, 2, 4]
    step._pick_step_forms(step._pick_buckets([]), graphed=False)
    assert model.choice is False and model.pick_us == {} and not model.takes_persistent(2)
    assert "did not build (RuntimeError: out of shared memory)" in model.pick_why
    model.choice = None
    monkeypatch.setattr(model, "persistent_unsupported", lambda kv: "a test's reason")
    step._pick_step_forms([1], graphed=False)
    assert model.choice is False and model.pick_why == "a test's reason"


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "model").glob("*.yaml")))
def test_probe_reads_each_model_as_the_harness_composes_it(name):
    """persistent_probe's shapes are the composed model config's (schema defaults filled in: SmolLM2's yaml names no
    rope_scaling, the q4_0 variant inherits Llama's); a model without synthetic shapes is refused by name."""
    from omegaconf import OmegaConf

    from onepass.harness.persistent_probe import model_shape
    from onepass.harness.synth import synthetic_config
    from onepass.kernels.errors import ConfigError

    if "synthetic" not in OmegaConf.load(Path(__file__).parents[1] / "conf" / "model" / f"{name}.yaml"):
        with pytest.raises(ConfigError, match=name):
            model_shape(name)
        return
    shape = model_shape(name)
    cfg = synthetic_config(name, shape)                 # every key it reads is there
    if name == "llama-3.2-1b-q4_0":                     # its yaml names only the weight type; the rest is Llama's
        base = synthetic_config(name, model_shape("llama-3.2-1b"))
        assert shape.weight_type == "q4_0" and cfg == base
