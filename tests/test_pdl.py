"""Programmatic dependent launch (kernels/pdl.py): every kernel that may be launched with it keeps the contract
(trigger, then wait, before touching anything but weights), and a step's outputs are bitwise the same with it
on and off."""
from __future__ import annotations

import ast
import contextlib
import re
import threading
from pathlib import Path

import pytest
import torch

from onepass.kernels import int4_mma, int4_wgmma, int4_wgmma_ws, nvrtc, pdl

ROOT = Path(__file__).resolve().parent.parent
KERNEL_FILES = sorted((ROOT / "kernels").glob("*.py"))


def _jit_functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d.func if isinstance(d, ast.Call) else d) == "triton.jit" for d in node.decorator_list):
            yield node


def _launched_kernels(tree):
    """Names of Triton kernels launched as NAME[grid](...) in a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                and isinstance(node.func.value, ast.Name):
            yield node.func.value.id, node


# the one kernel that reads before its wait (kernels/gdn.py, STATE_BEFORE_WAIT_MAX_RUNS): under which constexpr, and
# the only calls it may make there (its run's bounds, its start position with the kept verify rows: step inputs staged
# like the positions, and its slot's state; never an input the kernel before writes)
PRE_WAIT_READS = {("gdn.py", "_gdn_step_kernel"): ("STATE_EARLY", {"_run", "_run_start", "_load_state"})}


def _index_arithmetic(stmt) -> bool:
    """An assignment computed from program ids, names and constants only (no call but tl.program_id, no subscript or
    attribute other than its own): it reads no memory."""
    if not isinstance(stmt, ast.Assign):
        return False
    calls = [c for c in ast.walk(stmt.value) if isinstance(c, ast.Call)]
    if any(ast.unparse(c.func) != "tl.program_id" for c in calls):
        return False
    attrs = [a for a in ast.walk(stmt.value) if isinstance(a, ast.Attribute)]
    return len(attrs) == len(calls) and not any(isinstance(n, ast.Subscript) for n in ast.walk(stmt.value))


def _after_pre_wait_reads(body: list, allowed: tuple, where: str) -> list:
    """The statements from pdl.enter(PDL) on, once those before it are found to be program ids (and index arithmetic
    on them) and one `if <constexpr>:` block calling only the allowed helpers."""
    flag, calls = allowed
    i = 0
    while _index_arithmetic(body[i]):
        i += 1
    block = body[i]
    assert isinstance(block, ast.If) and ast.unparse(block.test) == flag and not block.orelse, \
        f"{where}: before pdl.enter(PDL) only program ids and `if {flag}:`, found {ast.unparse(block)!r}"
    made = {ast.unparse(c.func) for c in ast.walk(block) if isinstance(c, ast.Call)}
    assert made <= calls, f"{where}: reads before the wait call {sorted(made - calls)}"
    return body[i + 1:]


def test_every_launched_triton_kernel_enters_with_pdl():
    """A kernel launched from kernels/ takes PDL, its first statement is pdl.enter(PDL) (PRE_WAIT_READS: after its
    allowed reads), and its launch passes pdl.triton_opts (which sets PDL and launch_pdl together: the attribute never
    comes without the wait)."""
    checked = 0
    for path in KERNEL_FILES:
        tree = ast.parse(path.read_text())
        jits = {f.name: f for f in _jit_functions(tree)}
        for name, call in _launched_kernels(tree):
            if name not in jits:
                continue
            fn = jits[name]
            assert "PDL" in [a.arg for a in fn.args.args], f"{path.name}:{name} has no PDL parameter"
            body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if (path.name, name) in PRE_WAIT_READS:
                body = _after_pre_wait_reads(body, PRE_WAIT_READS[(path.name, name)], f"{path.name}:{name}")
            first = ast.unparse(body[0])
            assert first == "pdl.enter(PDL)", f"{path.name}:{name} starts with {first!r}, not pdl.enter(PDL)"
            opts = [k for k in call.keywords if k.arg is None and "pdl.triton_opts" in ast.unparse(k.value)]
            assert opts, f"{path.name}: a launch of {name} does not pass **pdl.triton_opts(...)"
            checked += 1
    assert checked >= 20, checked   # every step kernel (norms, GEMMs, attention, GDN, sampling, ...)


def _globals(src: str) -> dict[str, str]:
    """Each __global__ kernel's body in a CUDA source."""
    out = {}
    for m in re.finditer(r"__global__ void[^\n]*\n(\w+)\(", src):
        i = src.index("{", m.end())
        depth, j = 0, i
        while True:
            depth += {"{": 1, "}": -1}.get(src[j], 0)
            if depth == 0:
                break
            j += 1
        out[m.group(1)] = src[i:j]
    return out


@pytest.mark.parametrize("which", ["reduce", "mma", "wgmma"])
def test_cuda_kernels_wait_before_x_and_outputs(which):
    """Every CUDA kernel waits before it stages x or writes (the GEMMs issue only their first weight loads before the
    wait). None triggers its dependents but through pdl_release(), a no-op unless PDL_RELEASE is defined: the GEMMs
    after their last weight load, the split-K reduce at entry."""
    src = {"reduce": nvrtc.reduce_source(False, False),
           "mma": int4_mma.source("q4_k", 8, False, True, 4, 1, 2, True, fold=True),
           "wgmma": int4_wgmma.source("q4_k", 64, False, False, 2, 2, 1, 4, sk=True)}[which]
    kernels = _globals(src)
    helper = src[src.index("void pdl_release()"):]
    helper = helper[:helper.index("\n}\n")]
    assert kernels and src.count("launch_dependents") == 1 and "launch_dependents" in helper
    assert "&& PDL_RELEASE" in helper and "#define PDL_RELEASE 0" in src
    if which == "reduce":
        red = kernels["w4a16_splitk_reduce"]
        assert red.index("pdl_release();") < red.index("pdl_wait();")
    for name, body in kernels.items():
        # the wgmma kernel waits inside k_segment, which runs before any store
        wait = "k_segment(" if name == "w4a16_wgmma" else "pdl_wait();"
        assert wait in body, name
        assert all(body.index(wait) < i for i in (body.find("store_acc("), body.find("sk_combine("),
                                                  body.find("cp_async16_s"), body.find("ws[")) if i >= 0), name
    if which == "mma":
        body = kernels["w4a16_mma"]
        assert body.index("load_quad") < body.index("pdl_wait();") < body.index("cp_async16_s")
        loop = body.rindex("LOAD(ring[u]);")              # the K loop's last load, then the release
        assert loop < body.index("pdl_release();") < body.rindex("APPLY(acc")
    if which == "wgmma":
        seg = src[src.index("k_segment(float"):]
        assert seg.index("load_quad") < seg.index("pdl_wait();") < seg.index("stage_copy(")
        body = kernels["w4a16_wgmma"]
        sk = body[body.index("#if SK\n    // stream-K"):]
        sk, plain = sk[:sk.index("#else")], sk[sk.index("#else"):]
        assert sk.index("k_segment(") < sk.index("pdl_release();") < sk.index("sk_combine(")
        assert plain.index("k_segment(") < plain.index("pdl_release();") < plain.index("store_acc(")


def test_ws_staging_triggers_its_gemm_and_the_gemm_releases_late():
    """The ws kernel's x-staging launch triggers its dependent (the GEMM) at entry, then waits before it reads x; the
    GEMM never triggers early: its producer releases (pdl_release) once every copy is issued. Its producer's x copies
    come after its wait (its first weight copies before it) and its consumers wait before any store."""
    src = int4_wgmma_ws.source("q4_k", 32, False, True, 4, 1, False, 1, 4)
    kernels = _globals(src)
    assert set(kernels) == {"wg_stage_x", "w4a16_wgmma_ws"}
    stage, gemm = kernels["wg_stage_x"], kernels["w4a16_wgmma_ws"]
    assert stage.index("pdl_trigger();") < stage.index("pdl_wait();") < stage.index("x + (i64)")
    assert "pdl_trigger" not in gemm
    producer, consumer = gemm.split("regs_inc<CONSUMER_REGS>();")
    # X_IN_GEMM's stagers wait before they read x and arrive on the stage's barrier after storing it
    start = producer.index("#if X_IN_GEMM")
    stagers = producer[start:producer.index("#endif", start)]
    assert stagers.index("pdl_wait();") < stagers.index("stage_x_quad(") < stagers.index("mbar_arrive(")
    # thread 0: weight copies first; the staged x copies after its wait (neither X_IN_GEMM's, which has no wait);
    # the release once every copy is issued
    copier = producer[producer.index("if (threadIdx.x != 0) return;"):]
    assert copier.index("copy_weights(") < copier.index("#if !X_IN_GEMM\n        if (i <= STAGES)")
    waits = [m.start() for m in re.finditer(r"pdl_wait\(\);", copier)]
    assert waits and all("#if !X_IN_GEMM" in copier[:w][copier[:w].rindex("#if"):] for w in waits)
    assert copier.index("pdl_wait();") < copier.index("xb + (i64)pend")
    assert copier.rindex("bulk_copy(") < copier.index("pdl_release();") < copier.rindex("return;")
    assert "pdl_release" not in consumer and "pdl_release" not in stage
    assert consumer.index("pdl_wait();") < consumer.index("store_acc(")
    assert "#define STAGE_TRIGGER 1" in src and "griddepcontrol.launch_dependents" in src


def test_engine_policy_and_early_trigger(monkeypatch):
    """An engine's LaunchPolicy follows engine.pdl, its batch and the model's architecture: the early trigger up to
    EARLY_MAX_BATCH, or the architecture's own limit (EARLY_MAX_BATCH_BY_ARCH); kernels see it only while it is in
    force, and only in the thread that put it there."""
    monkeypatch.setattr(pdl, "supported", lambda index: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    dev, policy = torch.device("cuda", 0), pdl.LaunchPolicy.for_engine
    assert pdl.RELEASE_MAX_BATCH < pdl.EARLY_MAX_BATCH
    with pdl.applied(policy(True, pdl.RELEASE_MAX_BATCH)):
        assert pdl.mode(dev) == 4 and pdl.gemm_release()
    with pdl.applied(policy(True, pdl.EARLY_MAX_BATCH)):
        assert pdl.mode(dev) == 2 and pdl.triton_opts(dev) == {"PDL": 2, "launch_pdl": True}
        assert not pdl.gemm_release()
        with pdl.applied(policy(True, pdl.EARLY_MAX_BATCH + 1)):    # another engine's run inside this one's
            assert pdl.mode(dev) == 1 and pdl.triton_opts(dev) == {"PDL": 1, "launch_pdl": True}
        assert pdl.mode(dev) == 2
        seen = []
        thread = threading.Thread(target=lambda: seen.append(pdl.current()))
        thread.start()
        thread.join()
        assert seen == [pdl.LaunchPolicy()]
    # the hybrid (qwen35) triggers early up to its own, measured limit; the dense decoders keep the default
    hybrid = pdl.early_max_batch("qwen35")
    assert hybrid > pdl.EARLY_MAX_BATCH and pdl.early_max_batch("llama") == pdl.EARLY_MAX_BATCH
    assert policy(True, hybrid, "qwen35").mode(dev) == 2 and policy(True, hybrid, "llama").mode(dev) == 1
    assert policy(True, hybrid + 1, "qwen35").mode(dev) == 1
    with pdl.applied(policy(False, 1)):
        assert pdl.mode(dev) == 0 and pdl.triton_opts(dev) == {}
    assert pdl.current() == pdl.LaunchPolicy() and not pdl.gemm_release()


@pytest.fixture
def fake_nvrtc(monkeypatch):
    """nvrtc._Kernel with a stand-in NVRTC binding and launcher (PDL on): yields (sources compiled, launches) and
    a fresh kernel of the reduce's source."""
    compiled, launched = [], []

    class Fn:
        func = 0

        def set_shared_memory_config(self, n):
            pass

    def compile_kernel(src, name, **kw):
        compiled.append(src)
        return Fn()

    monkeypatch.setattr(torch.cuda, "_compile_kernel", compile_kernel, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(pdl, "launch_ex", lambda func, *a: launched.append(a))
    monkeypatch.setattr(pdl, "enabled", lambda device=None: True)
    k = nvrtc._Kernel(nvrtc.reduce_source(False, True), "w4a16_splitk_reduce", "torch", torch.device("cuda", 0))
    yield compiled, launched, k


def test_gemm_release_compiles_its_own_kernel(fake_nvrtc):
    """nvrtc._Kernel compiles the source once per release setting, read at launch: with the release on, the
    kernel that runs is the one with PDL_RELEASE defined (its pdl_release() issues launch_dependents)."""
    compiled, launched, k = fake_nvrtc
    assert compiled == []                                   # nothing compiled before the first launch
    for flag in (False, True, False, True):
        with pdl.applied(pdl.LaunchPolicy(release=flag)):
            k(1, 256, [], torch.device("cuda", 0))
    assert len(compiled) == 2 and len(launched) == 4
    assert not compiled[0].startswith("#define PDL_RELEASE 1") and compiled[1].startswith("#define PDL_RELEASE 1\n")


def test_evict_launch_compiles_its_own_kernel(fake_nvrtc):
    """A launch with evict=True (int4_wgmma_ws's weights as L2 evict-first) runs the build with WEIGHT_EVICT defined,
    compiled once per release setting; the other launches keep the plain build."""
    compiled, launched, k = fake_nvrtc
    for evict, release in ((False, False), (True, False), (True, False), (False, False), (True, True)):
        with pdl.applied(pdl.LaunchPolicy(release=release)):
            k(1, 256, [], torch.device("cuda", 0), evict=evict)
    assert len(compiled) == 3 and len(launched) == 5
    assert "#define WEIGHT_EVICT 1" not in compiled[0] and compiled[1].startswith("#define WEIGHT_EVICT 1\n")
    assert compiled[2].startswith("#define PDL_RELEASE 1\n#define WEIGHT_EVICT 1\n")


def test_off_on_cpu_and_by_switch(monkeypatch):
    cpu = torch.device("cpu")
    assert not pdl.enabled(cpu) and pdl.triton_opts(cpu) == {}
    monkeypatch.setenv("ONEPASS_PDL", "0")
    assert not pdl.enabled()
    with pdl.applied(pdl.LaunchPolicy(pdl=True)):
        assert pdl.enabled() == (torch.cuda.is_available() and pdl.supported(torch.cuda.current_device()))


def test_launch_ex_refuses_unknown_arguments():
    with pytest.raises(TypeError, match="unsupported kernel argument float"):
        pdl.launch_ex(0, 1, 32, 0, 0, [1.5])


# ---------------------------------------------------------------------------------------------------
# GPU: the same tokens with PDL on and off, every int4 variant, inside CUDA graphs

from tests.test_fused_qwen35 import CONFIGS, ggufs, gpu_run  # noqa: E402,F401 (ggufs: a fixture)
from tests.test_qwen35_packed import CASES  # noqa: E402


@pytest.fixture(scope="module")
def packed_file(tmp_path_factory):
    from onepass.engine.gguf_writer import random_weights, write_gguf
    cfg, fmt = CASES["4x-value-heads-q4_k"]
    path = tmp_path_factory.mktemp("pdl") / "wide-q4_k.gguf"
    write_gguf(path, cfg, random_weights(cfg, seed=71), weight_type=fmt, seed=3)
    return path


def _packed_run(path, B, policy, prompts=None):
    """Greedy tokens of B streams (prompts, default one prompt B times) on the packed wide hybrid, graphed."""
    from onepass.engine.gguf_loader import load_gguf
    from onepass.engine.fused_qwen35 import FusedQwen35Decoder
    from onepass.engine.state_pool import HybridCache
    from onepass.engine.runner import run_static
    from onepass.kernels import int4_dispatch as disp
    from onepass.kernels.backend import get_step_kernels
    from tests.test_fused_qwen35 import prompt
    disp.set_policy(policy, B)
    try:
        cfg, w, _ = load_gguf(path, dtype=torch.bfloat16, device="cuda", progress=False, keep_quantized=True)
        model = FusedQwen35Decoder(cfg, w, get_step_kernels("triton"), max_pos=128)
        kv = HybridCache.create(cfg, B + 1, 64, torch.bfloat16, "cuda", torch.float32)
        return run_static(model, kv, prompts or [prompt(72, 9)] * B, 16, use_graphs=True).outputs
    finally:
        disp.set_policy("invariant")


def _on_off(fn):
    """fn's result with PDL off, on, and on with the Triton kernels triggering early."""
    runs = {}
    for mode, (on, early) in {"off": (False, False), "on": (True, False), "early": (True, True)}.items():
        with pdl.applied(pdl.LaunchPolicy(pdl=on, early=early)):
            runs[mode] = fn()
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_gpu_dense_hybrid_same_tokens_with_pdl(ggufs, name):  # noqa: F811 (ggufs: the imported fixture)
    from tests.test_fused_qwen35 import prompt
    assert pdl.supported(torch.cuda.current_device()), "the H200 path runs with PDL: it must be supported"
    runs = _on_off(lambda: gpu_run(ggufs[name], 8, prompt(73, 11), 24))
    assert runs["on"] == runs["off"] and runs["early"] == runs["off"]


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["triton", "cuda_mma", "cuda_mma_fold", "cuda_mma_fold_lat", "cuda_wgmma",
                                    "cuda_wgmma_x2", "cuda_wgmma_ws", "cuda_wgmma_ws_t128"])
@pytest.mark.parametrize("B", [1, 16])
def test_gpu_packed_hybrid_same_tokens_with_pdl(packed_file, policy, B):
    runs = _on_off(lambda: _packed_run(packed_file, B, policy))
    assert runs["on"] == runs["off"] and runs["early"] == runs["off"]
