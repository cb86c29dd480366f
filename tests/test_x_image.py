"""kernels/x_image.py: a ws GEMM's staged x written by the kernel that makes x.

- the image's offsets are a permutation of the buffer (every element written once), partial tiles are refused;
- the Triton producers (RMSNorm, residual add + RMSNorm in both its one-program and chunked forms, SwiGLU, on plain
  inputs and split-K partials; the gated norm with and without its column order, the sigmoid gate) give the same
  outputs with an image as without, and the image is XImage.write_ref of that output (tests/test_int4_wgmma_ws.py
  checks write_ref against the staging kernel's own image); the torch references write the same;
- on the GPU, the hybrid decoder with every projection on the ws kernel makes the same tokens with the images as
  with the staging launches, and its GEMMs did take the images.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from onepass.kernels.splitk import SplitSums
from onepass.kernels.x_image import XImage
from tests.interpreter import run_in_interpreter
from tests.kernel_inputs import DEV, HAS_CUDA, INTERPRET, _gen, _msg, _randn, needs_kernel
from tests.test_pdl import _packed_run, packed_file  # noqa: F401  (the packed wide hybrid, a fixture)


def _image(M, K, BT, dtype=torch.bfloat16):
    n = (M // BT) * (K // 128) * 1024 * -(-BT // 8)
    return XImage(torch.full((n,), float("nan"), dtype=dtype, device=DEV), M, K, BT)


@pytest.mark.parametrize("M,K,BT", [(16, 128, 16), (64, 384, 32), (256, 256, 128), (48, 512, 16)])
def test_offsets_cover_the_image_once(M, K, BT):
    img = _image(M, K, BT)
    off = img.offsets().flatten()
    assert off.numel() == img.numel and torch.equal(off.sort().values, torch.arange(img.numel))


def test_partial_tiles_and_wrong_buffers_are_refused():
    buf = torch.empty(1 << 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="whole batch tiles"):
        XImage(buf, 24, 256, 16)
    with pytest.raises(ValueError, match="whole batch tiles"):
        XImage(buf, 16, 320, 16)
    with pytest.raises(ValueError, match="16-bit"):
        XImage(torch.empty(8, dtype=torch.bfloat16), 16, 256, 16)


def _want(img: XImage, y: torch.Tensor) -> torch.Tensor:
    ref = XImage(torch.full_like(img.buf, float("nan")), img.M, img.K, img.BT)
    ref.write_ref(y)
    return ref.buf


@needs_kernel
@pytest.mark.parametrize("D,chunked", [(256, False), (1024, True)])
@pytest.mark.parametrize("partials", [False, True])
def test_norms_store_their_output_into_the_image(D, chunked, partials, monkeypatch):
    from onepass.kernels import rmsnorm

    if chunked:
        monkeypatch.setattr(rmsnorm, "ROW_MAX_D", D // 2)      # the chunked kernel at a size the interpreter runs
    g = _gen(11 + D + partials)
    M, BT = 32, 16
    w = _randn(g, D, scale=0.5) + 1
    res0 = _randn(g, M, D, dtype=torch.bfloat16)
    if partials:
        x = SplitSums(_randn(g, 3, M, D), torch.empty(M, D, dtype=torch.bfloat16, device=DEV), rne=INTERPRET)
    else:
        x = _randn(g, M, D, dtype=torch.bfloat16)
    plain_res, img_res = res0.clone(), res0.clone()
    want, _ = rmsnorm.add_rms_norm_triton(x, plain_res, w, 1e-6)
    img = _image(M, D, BT)
    got, _ = rmsnorm.add_rms_norm_triton(x, img_res, w, 1e-6, out=torch.empty_like(want), image=img)
    assert torch.equal(got, want) and torch.equal(img_res, plain_res), _msg("add_rms_norm moved with an image")
    assert torch.equal(img.buf, _want(img, want)), _msg("add_rms_norm's image is not its output's")
    if not partials:
        img = _image(M, D, BT)
        y = rmsnorm.rms_norm_triton(res0, w, 1e-6, out=torch.empty_like(want), image=img)
        assert torch.equal(y, rmsnorm.rms_norm_triton(res0, w, 1e-6)), _msg("rms_norm moved with an image")
        assert torch.equal(img.buf, _want(img, y)), _msg("rms_norm's image is not its output's")


@needs_kernel
@pytest.mark.parametrize("partials", [False, True])
def test_swiglu_stores_its_output_into_the_image(partials):
    from onepass.kernels.swiglu import swiglu_triton

    g = _gen(23 + partials)
    M, F, BT = 32, 384, 32
    if partials:
        gu = SplitSums(_randn(g, 2, M, 2 * F), torch.empty(M, 2 * F, dtype=torch.bfloat16, device=DEV), rne=INTERPRET)
    else:
        gu = _randn(g, M, 2 * F, dtype=torch.bfloat16)
    want = swiglu_triton(gu)
    img = _image(M, F, BT)
    got = swiglu_triton(gu, out=torch.empty_like(want), image=img)
    assert torch.equal(got, want), _msg("swiglu moved with an image")
    assert torch.equal(img.buf, _want(img, want)), _msg("swiglu's image is not its output's")


@needs_kernel
@pytest.mark.parametrize("permuted", [False, True])
def test_gated_norm_stores_its_output_into_the_image(permuted):
    from onepass.kernels.gdn import gated_rms_norm_triton

    g = _gen(41 + permuted)
    M, H, D, BT = 32, 4, 64, 16
    o = _randn(g, M, H, D)
    z = _randn(g, M, H, D, dtype=torch.bfloat16)
    w = _randn(g, D, scale=0.5) + 1
    cols = torch.randperm(H * D, generator=g).to(torch.int32).to(DEV) if permuted else None
    want = gated_rms_norm_triton(o, z, w, 1e-6, out_cols=cols)
    img = _image(M, H * D, BT)
    got = gated_rms_norm_triton(o, z, w, 1e-6, out=torch.empty_like(want), out_cols=cols, image=img)
    assert torch.equal(got, want), _msg("gated_rms_norm moved with an image")
    assert torch.equal(img.buf, _want(img, want)), _msg("gated_rms_norm's image is not its output's")


@needs_kernel
def test_sigmoid_gate_stores_its_output_into_the_image():
    from onepass.kernels.gated_attention import sigmoid_gate_mul_triton

    g = _gen(47)
    M, H, D, BT = 16, 2, 128, 16
    o = _randn(g, M, H, D, dtype=torch.bfloat16)
    gate = _randn(g, M, H, D, dtype=torch.bfloat16)
    want = sigmoid_gate_mul_triton(o, gate)
    img = _image(M, H * D, BT)
    got = sigmoid_gate_mul_triton(o, gate, out=torch.empty_like(want), image=img)
    assert torch.equal(got, want), _msg("sigmoid_gate_mul moved with an image")
    assert torch.equal(img.buf, _want(img, want.flatten(1))), _msg("sigmoid_gate_mul's image is not its output's")


def test_torch_producers_write_the_image():
    """The references take the same argument (the torch backend's kernels), writing XImage.write_ref."""
    from onepass.kernels.gated_attention import sigmoid_gate_mul_ref
    from onepass.kernels.gdn import gated_rms_norm_ref

    g = torch.Generator().manual_seed(5)
    o, gate = torch.randn(16, 2, 64, generator=g), torch.randn(16, 2, 64, generator=g)
    img = XImage(torch.zeros(16 * 128, dtype=torch.float16), 16, 128, 16)
    y = sigmoid_gate_mul_ref(o.half(), gate.half(), image=img)
    assert torch.equal(img.buf, _want(img, y.flatten(1)))
    y = gated_rms_norm_ref(o, gate.half(), torch.ones(64), 1e-6, image=img)
    assert torch.equal(img.buf, _want(img, y))


@needs_kernel
def test_producers_refuse_an_image_of_another_shape():
    from onepass.kernels.rmsnorm import rms_norm_triton
    from onepass.kernels.swiglu import swiglu_triton

    g = _gen(31)
    x = _randn(g, 16, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the image is of"):
        rms_norm_triton(x, torch.ones(256, device=DEV), 1e-6, image=_image(32, 256, 16))
    with pytest.raises(ValueError, match="the image is of"):
        swiglu_triton(_randn(g, 16, 512, dtype=torch.bfloat16), image=_image(16, 128, 16))


@pytest.mark.skipif(HAS_CUDA or INTERPRET, reason="kernel tests run in-process here")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (Linux-only dependency)")
def test_cpu_kernels_in_interpreter_subprocess():
    run_in_interpreter(__file__, "(x images under the Triton interpreter)")


# --------------------------------------------------------------------------------------------------
# GPU: the hybrid decoder's steps with the images against the staging launches

@pytest.mark.gpu
@pytest.mark.parametrize("B", [16, 32])
def test_gpu_hybrid_tokens_with_images(packed_file, B, monkeypatch):  # noqa: F811 (the imported fixture)
    from onepass.kernels import int4_dispatch as disp
    from onepass.kernels import int4_wgmma_ws as ws
    from tests.test_fused_qwen35 import prompt

    took, call = [], ws._StagedLaunch.__call__

    def spy(self, *args, **kw):                 # which ws launches read an image
        took.append(self.image is not None)
        return call(self, *args, **kw)

    monkeypatch.setattr(ws._StagedLaunch, "__call__", spy)
    prompts = [prompt(90 + i, 9) for i in range(B)]      # distinct rows: an image row out of place changes tokens
    monkeypatch.setattr(disp, "PRODUCER_IMAGES", False)
    staged = _packed_run(packed_file, B, "cuda_wgmma_ws", prompts)
    took_staged, took[:] = list(took), []
    monkeypatch.setattr(disp, "PRODUCER_IMAGES", True)
    imaged = _packed_run(packed_file, B, "cuda_wgmma_ws", prompts)
    assert took_staged and not any(took_staged) and any(took), "the images were not taken (or with the switch off)"
    assert imaged == staged
