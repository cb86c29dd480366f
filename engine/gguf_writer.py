"""Synthetic GGUF files with a model's exact tensor shapes and llama.cpp's metadata (tests, benchmarks).

qwen35 files carry what llama.cpp's converter (conversion/qwen.py, Qwen3_5TextModel) writes: the ssm.*
keys, full_attention_interval, the partial rope.dimension_count and rope.dimension_sections, a
block_count that includes the MTP blocks plus nextn_predict_layers, tensors named and shaped as in
ModelConfig.tensor_shapes(), value heads reordered to the converter's tiled order when Hv != Hk, and
ssm_conv1d / 1-D / non-".weight" tensors (ssm_a, ssm_dt.bias) kept in F32 as the converter keeps them.
Weights are given in the loader's convention (GGUF values, HF grouped V-head order).

K-quant types (q4_k, q5_k, q6_k) have no quantizer in gguf-py, so their matrices are written as
random-but-valid blocks whose spread roughly matches the given weight: the stored values are NOT
the given weights (compare against gguf.quants.dequantize of the written bytes instead).
"""
from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, LlamaFileType as FT

from onepass.engine.config import ModelConfig, llama3_rope_factors
from onepass.engine.gguf_loader import ROPE_FREQS, gdn_v_reorder, permute_qk, qk_heads
from onepass.engine.quant import dequantize, nbytes_for

WEIGHT_TYPES: dict[str, tuple[QT, FT]] = {
    "f32": (QT.F32, FT.ALL_F32), "f16": (QT.F16, FT.MOSTLY_F16), "bf16": (QT.BF16, FT.MOSTLY_BF16),
    "q8_0": (QT.Q8_0, FT.MOSTLY_Q8_0), "q4_0": (QT.Q4_0, FT.MOSTLY_Q4_0), "q4_1": (QT.Q4_1, FT.MOSTLY_Q4_1),
    "q4_k": (QT.Q4_K, FT.MOSTLY_Q4_K_M), "q5_k": (QT.Q5_K, FT.MOSTLY_Q5_K_M), "q6_k": (QT.Q6_K, FT.MOSTLY_Q6_K),
}
_K_QUANTS = {QT.Q4_K: 2, QT.Q5_K: 2, QT.Q6_K: 1}  # -> number of fp16 scale fields (d, dmin)
_K_SCALE_AT = {QT.Q4_K: 0, QT.Q5_K: 0, QT.Q6_K: 208}  # byte offset of d inside a block
_K_Q_MEAN = {QT.Q4_K: 7.5, QT.Q5_K: 15.5}  # dmin = d * mean code keeps the values centred on 0


# bumped whenever random_weights draws differently, so cached synthetic files are written again
WEIGHTS_VERSION = 2


def random_weights(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """float32 weights of the exact shapes: matrices N(0, 1/fan_in), so every layer moves the residual stream;
    embeddings N(0, 0.02), so the hidden state is not the input token's embedding (with tied embeddings that makes
    greedy repeat its input, and a repeated reference verifies nothing); norm gains 1 + N(0, 0.02); plus
    `rope_freqs.weight` when cfg.rope_scaling is set. device: where the dense models' weights are drawn (a GPU draws a
    billion parameters in a moment; its draws differ from the CPU's)."""
    if cfg.arch == "qwen35":
        return {k: v.to(device) for k, v in _random_qwen35_weights(cfg, seed).items()}
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in cfg.tensor_shapes().items():
        noise = torch.randn(shape, generator=g, device=device)
        if len(shape) == 1:
            out[name] = noise.mul_(0.02).add_(1.0)
        elif name == "token_embd.weight":
            out[name] = noise.mul_(0.02)
        else:
            out[name] = noise.mul_(shape[1] ** -0.5)
    if cfg.rope_scaling is not None:
        out[ROPE_FREQS] = llama3_rope_factors(cfg.rope_scaling, cfg.head_dim, cfg.rope_theta).to(device)
    return out


def _random_qwen35_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """float32 qwen35 weights in the loader's convention, scaled so every layer matters: matrices
    N(0, 1/fan_in), embeddings N(0, 0.5), norm gains (GGUF's baked 1 + w) 1 + N(0, 0.1), conv taps
    N(0, 0.5), ssm_a = -A with A ~ U(0.05, 1) (slow-to-moderate decay), dt bias N(0, 0.5)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in cfg.tensor_shapes().items():
        noise = torch.randn(shape, generator=g)
        if name.endswith("ssm_a"):
            out[name] = -(torch.rand(shape, generator=g) * 0.95 + 0.05)
        elif name.endswith(("ssm_dt.bias", "ssm_conv1d.weight")) or name == "token_embd.weight":
            out[name] = noise.mul_(0.5)
        elif len(shape) == 1:
            out[name] = noise.mul_(0.1).add_(1.0)
        else:
            out[name] = noise.mul_(shape[1] ** -0.5)
    return out


def _tensor_type(name: str, shape: tuple[int, ...], qtype: QT) -> QT:
    if len(shape) == 1:  # norms and rope_freqs
        return QT.F32
    if name.endswith("ssm_conv1d.weight") or not name.endswith(".weight"):
        return QT.F32  # the converter keeps the conv taps (K-wide rows) and non-weights in F32
    block, _ = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block == 0:
        return qtype
    if qtype in _K_QUANTS and shape[-1] % 32 == 0:
        return QT.Q8_0  # llama.cpp also falls back to a 32-block type for rows not a multiple of 256
    raise ValueError(f"{name}: row length {shape[-1]} is not a multiple of the {qtype.name} block size {block}")


def _random_k_blocks(w: torch.Tensor, qtype: QT, g: torch.Generator) -> np.ndarray:
    """Random valid K-quant blocks with finite fp16 scales, scaled to w's standard deviation."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (w.numel() // block, size), dtype=torch.uint8, generator=g)
    at, q_mean = _K_SCALE_AT[qtype], _K_Q_MEAN.get(qtype, 0.0)

    def set_scales(d: float) -> None:
        fields = torch.tensor([d, d * q_mean][: _K_QUANTS[qtype]], dtype=torch.float16)
        raw[:, at : at + 2 * len(fields)] = fields.view(torch.uint8)

    set_scales(1.0)
    sample = raw[:4096]
    unit_std = dequantize(sample, qtype, (sample.shape[0] * block,)).std().item()
    set_scales(float(w.float().std()) / max(unit_std, 1e-12))
    return raw.numpy()


def _encode(w: torch.Tensor, qtype: QT, g: torch.Generator) -> np.ndarray:
    """Tensor -> its GGUF bytes as uint8 (rows, bytes per row)."""
    w = w.detach().to("cpu", torch.float32).contiguous()
    if qtype == QT.F32:
        return w.numpy().view(np.uint8)
    if qtype == QT.F16:
        return w.to(torch.float16).numpy().view(np.uint8)
    if qtype == QT.BF16:  # torch rounds to nearest even, like ggml_compute_fp32_to_bf16
        return w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    if qtype in _K_QUANTS:
        return _random_k_blocks(w, qtype, g)
    return gguf.quants.quantize(w.numpy(), qtype)


def _add_metadata(wr: gguf.GGUFWriter, cfg: ModelConfig, ftype: FT, quantized: bool,
                  tokenizer_meta: dict[str, Any] | None) -> None:
    wr.add_name(cfg.name)
    wr.add_context_length(cfg.context_length)
    wr.add_embedding_length(cfg.dim)
    wr.add_block_count(cfg.n_layers + cfg.mtp_layers)  # llama.cpp counts MTP blocks in block_count
    wr.add_feed_forward_length(cfg.ffn_dim)
    wr.add_head_count(cfg.n_heads)
    wr.add_head_count_kv(cfg.n_kv_heads)
    wr.add_key_length(cfg.head_dim)
    wr.add_value_length(cfg.head_dim)
    wr.add_rope_dimension_count(cfg.rope_dim)
    wr.add_rope_freq_base(cfg.rope_theta)
    wr.add_layer_norm_rms_eps(cfg.norm_eps)
    if cfg.arch == "qwen35":
        _add_qwen35_metadata(wr, cfg)
    wr.add_vocab_size(cfg.vocab_size)  # files without a tokenizer have no other record of it
    wr.add_file_type(ftype)
    if quantized:
        wr.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if len(cfg.eos_ids) > 3:
        raise ValueError(f"at most 3 eos ids (eos, eot, eom) fit in GGUF metadata, got {cfg.eos_ids}")
    ids = {f"tokenizer.ggml.{k}_token_id": int(t) for k, t in zip(("eos", "eot", "eom"), cfg.eos_ids)}
    if cfg.bos_id is not None:
        ids["tokenizer.ggml.bos_token_id"] = int(cfg.bos_id)
    for key, token in ids.items():
        wr.add_uint32(key, token)
    for key, value in (tokenizer_meta or {}).items():
        if not key.startswith("tokenizer."):
            raise ValueError(f"tokenizer_meta key {key!r} does not start with 'tokenizer.'")
        if key in ids:
            continue  # the config's bos/eos ids win
        if isinstance(value, bool):
            wr.add_bool(key, value)
        elif isinstance(value, int) and value >= 0:
            wr.add_uint32(key, value)
        elif isinstance(value, int):
            wr.add_int32(key, value)
        elif isinstance(value, float):
            wr.add_float32(key, value)
        elif isinstance(value, str):
            wr.add_string(key, value)
        else:
            wr.add_array(key, list(value))


def _add_qwen35_metadata(wr: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """The keys Qwen3NextModel / _Qwen35MRopeMixin / _Qwen35MtpMixin add (conversion/qwen.py)."""
    wr.add_ssm_conv_kernel(cfg.gdn_conv_kernel)
    wr.add_ssm_state_size(cfg.gdn_k_dim)
    wr.add_ssm_group_count(cfg.gdn_k_heads)
    wr.add_ssm_time_step_rank(cfg.gdn_v_heads)
    wr.add_ssm_inner_size(cfg.gdn_value_dim)
    wr.add_full_attention_interval(cfg.full_attention_interval)
    # the converter's default when the checkpoint's rope parameters carry no mrope_section
    wr.add_rope_dimension_sections(list(cfg.rope_sections) or [11, 11, 10, 0])
    if cfg.mtp_layers:
        wr.add_nextn_predict_layers(cfg.mtp_layers)


def write_gguf(path: str | os.PathLike, cfg: ModelConfig, weights: dict[str, torch.Tensor],
               weight_type: str = "bf16", tokenizer_meta: dict[str, Any] | None = None,
               seed: int = 0, embed_type: str | None = None) -> None:
    """Write `weights` (torch layout, keyed by GGUF name, written in dict order) as a GGUF file for
    cfg.arch. 1-D tensors and rope_freqs are F32, matrices `weight_type`. llama q/k rows get the
    converter's permutation, qwen35 value heads its grouped -> tiled reorder (when Hv != Hk). Tensors
    are encoded one at a time (no second full copy in memory).
    Weights are written as given: wrong shapes or missing tensors make deliberately broken files
    (q/k are permuted only when their shape is the expected one). `seed` drives K-quant blocks. embed_type: the
    embedding table's (and an untied output matrix's) type, when not weight_type."""
    for what, t in (("weight_type", weight_type), ("embed_type", embed_type or weight_type)):
        if t not in WEIGHT_TYPES:
            raise ValueError(f"{what} {t!r} not in {sorted(WEIGHT_TYPES)}")
    qtype, ftype = WEIGHT_TYPES[weight_type]
    etype = WEIGHT_TYPES[embed_type or weight_type][0]
    expected = cfg.tensor_shapes()
    types = {n: _tensor_type(n, tuple(w.shape), etype if n in ("token_embd.weight", "output.weight") else qtype)
             for n, w in weights.items()}

    wr = gguf.GGUFWriter(os.fspath(path), cfg.arch)
    _add_metadata(wr, cfg, ftype, qtype not in (QT.F32, QT.F16, QT.BF16), tokenizer_meta)
    for name, w in weights.items():
        shape = tuple(w.shape)
        nbytes = nbytes_for(types[name], shape)
        byte_shape = (*shape[:-1], nbytes // max(1, int(np.prod(shape[:-1]))))
        wr.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=types[name])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_ti_data_to_file()
    g = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        n_head = qk_heads(cfg, name)
        if n_head is not None and tuple(w.shape) == expected.get(name):
            w = permute_qk(w, n_head)
        if tuple(w.shape) == expected.get(name):
            w = gdn_v_reorder(cfg, name, w, to_gguf=True)
        wr.write_tensor_data(_encode(w, types[name], g))
    wr.close()
