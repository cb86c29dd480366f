"""Load a llama / qwen3 GGUF file: typed config plus dequantized weights in torch (out, in) layout.

q/k projections come back in Hugging Face's rotate-half (NEOX) layout for both architectures.
"""
from __future__ import annotations

import gc
import math
import os
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from engine.config import ModelConfig
from engine.errors import GGUFError
from engine.gguf_meta import open_reader, read_metadata
from engine.quant import SUPPORTED_TYPES, dequantize

SUPPORTED_ARCHS = ("llama", "qwen3")
ROPE_FREQS = "rope_freqs.weight"
_SUPPORTED_NAMES = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's llama q/k row order: each head's rotate-half rows -> interleaved pairs."""
    out, inp = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, inp).transpose(1, 2).reshape(out, inp)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `permute_qk`: GGUF llama q/k rows back to rotate-half order."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def qk_heads(cfg: ModelConfig, name: str) -> int | None:
    """Head count for llama's permuted attn_q / attn_k rows; None for every other tensor."""
    if cfg.arch != "llama" or name.count(".") < 2:
        return None
    return {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}.get(name.split(".")[-2])


def config_from_metadata(
    meta: dict[str, Any], path: str, tensor_shapes: dict[str, tuple[int, ...]] | None = None
) -> ModelConfig:
    """Build the ModelConfig from GGUF metadata. `tensor_shapes` (torch order, by GGUF name) supplies
    what metadata cannot: whether output.weight exists (untied head) and a vocab-size fallback;
    without it the head is taken as untied."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    shapes = tensor_shapes or {}

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata key {arch}.{key} is missing")
        if isinstance(value, list):
            raise GGUFError(f"{path}: metadata key {arch}.{key} is per-layer ({value[:4]}...), which is not supported")
        return value

    dim, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", dim // n_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{path}: attention.value_length differs from key_length {head_dim}; not supported")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{path}: partial rotary embedding (rope.dimension_count != head_dim {head_dim}) "
                        "is not supported")
    if get("rope.scaling.type", "none") != "none":
        raise GGUFError(f"{path}: rope scaling type {get('rope.scaling.type')!r} is not supported")

    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    if vocab is None and "token_embd.weight" in shapes:
        vocab = shapes["token_embd.weight"][0]
    if vocab is None:
        raise GGUFError(f"{path}: cannot tell the vocabulary size "
                        f"(no {arch}.vocab_size, tokenizer.ggml.tokens or token_embd.weight)")

    # llama.cpp stops on any end-of-generation id: eos, end-of-turn, end-of-message
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        arch=arch,
        n_layers=int(get("block_count")),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length")),
        vocab_size=int(vocab),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        context_length=int(get("context_length")),
        tie_embeddings="output.weight" not in shapes,
        qk_norm=arch == "qwen3",
        name=str(meta.get("general.name", "")),
        bos_id=None if bos is None else int(bos),
        eos_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )


class _Truncated(Exception):
    def __init__(self, tensor: str, end: int, size: int) -> None:
        super().__init__(f"truncated: tensor {tensor} needs bytes up to {end}, file has {size}")


class _BoundsCheckedReader(gguf.GGUFReader):
    """GGUFReader that checks every tensor's data range against the file size before mapping it."""

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
            end = int(start_offs) + int(offset[0]) + math.prod(int(d) for d in dims) // block * type_size
            if end > size:
                raise _Truncated(bytes(name).decode("utf-8", "replace"), end, size)
        super()._build_tensors(start_offs, fields)


def _open(path: str) -> gguf.GGUFReader:
    # gguf-py builds ~1M acyclic numpy views for a tokenizer's metadata; cycle GC passes over them
    # cost more than the parse itself
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return open_reader(path)
    except GGUFError:
        # gguf-py fails on cut tensor data with a bare reshape error; name the tensor instead
        try:
            _BoundsCheckedReader(path, "r")
        except _Truncated as e:
            raise GGUFError(f"{path}: {e}") from None
        except Exception:
            pass
        raise
    finally:
        if gc_was_enabled:
            gc.enable()


def _check_tensors(path: str, cfg: ModelConfig, found: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs: present, right shape, decodable type. Returns name -> shape."""
    wanted = cfg.tensor_shapes()
    if ROPE_FREQS in found:
        wanted[ROPE_FREQS] = (cfg.head_dim // 2,)
    for name, shape in wanted.items():
        t = found.get(name)
        if t is None:
            raise GGUFError(f"{path}: tensor {name} is missing (needed by {cfg.arch} with {cfg.n_layers} layers)")
        got = tuple(int(d) for d in reversed(t.shape.tolist()))
        if got != shape:
            raise GGUFError(f"{path}: tensor {name} has shape {got}, expected {shape}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {name} has type {t.tensor_type.name}, which is not supported "
                            f"(supported: {_SUPPORTED_NAMES})")
    return wanted


def load_gguf(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    progress: bool = True,
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, weights by GGUF name in torch (out, in) layout as `dtype` on `device`, raw metadata).
    `rope_freqs.weight` (Llama 3 RoPE divisors), when present, is included as float32."""
    path = os.fspath(path)
    reader = _open(path)
    meta = read_metadata(reader)
    found = {t.name: t for t in reader.tensors}
    shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in found.items()}
    cfg = config_from_metadata(meta, path, shapes)
    wanted = _check_tensors(path, cfg, found)

    weights: dict[str, torch.Tensor] = {}
    for name in tqdm(wanted, desc=f"loading {os.path.basename(path)}", unit="tensor", disable=not progress):
        t = found[name]
        # copy out of the read-only memmap so torch owns writable bytes; decode on the target device
        raw = torch.from_numpy(np.array(t.data, copy=True).view(np.uint8)).to(device)
        w = dequantize(raw, t.tensor_type, wanted[name])
        n_head = qk_heads(cfg, name)
        if n_head is not None:
            w = unpermute_qk(w, n_head)
        weights[name] = w if name == ROPE_FREQS else w.to(dtype)
    return cfg, weights, meta
