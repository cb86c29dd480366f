"""Load a llama / qwen3 / qwen35 GGUF file: typed config plus dequantized (or, keep_quantized, packed) weights
in torch (out, in) layout.

q/k projections come back in Hugging Face's rotate-half (NEOX) layout for every architecture.

qwen35 (Qwen3.5/3.6/3.8 hybrid: Gated DeltaNet + gated attention) weights keep their GGUF names and
values with one exception. The conventions, all decided here and read by engine/models/qwen35.py:
  * Norms: every norm weight is the plain multiplier `rms_norm(x) * w`. llama.cpp's converter baked
    HF's zero-centred `1 + w` into every `*norm.weight` except `ssm_norm` (the GDN gated norm, plain
    in HF too), so the GGUF values are used as they are -- no +1 anywhere at run time.
  * `ssm_a` (no `.weight` suffix) is already -exp(A_log); `ssm_dt.bias` is dt_bias; `ssm_conv1d.weight`
    is the squeezed [conv_dim, K] depthwise kernel (cross-correlation, newest input in column K-1).
  * `attn_gate` is the GDN z projection (input of the SiLU-gated norm); the attention output gate
    lives in `attn_q`, whose rows are per head [q (head_dim) | gate (head_dim)].
  * V heads: when ssm.time_step_rank (Hv) != ssm.group_count (Hk) the converter reorders value heads
    from HF's grouped order (v head h reads k head h // (Hv/Hk)) to a tiled order (GGUF head
    rho*Hk + g == HF head g*(Hv/Hk) + rho). The loader undoes it, so weights, the recurrent state and
    every downstream kernel use HF's grouped order (the pairing FLA / vLLM kernels assume). One exception
    with keep_quantized: a packed ssm_out keeps the file's column order (packed blocks take row gathers
    only) and comes with `blk.N.ssm_out.input_order`, the permutation its input needs (see load_gguf).
  * MTP blocks (`nextn_predict_layers`, counted in block_count) are loaded and kept under their GGUF
    names (blk.{n_layers + j}.*); cfg.n_layers counts trunk layers only, cfg.mtp_layers the rest.
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

from onepass.engine.config import ModelConfig
from onepass.kernels.errors import GGUFError
from onepass.engine.gguf_meta import open_reader, read_metadata
from onepass.engine.quant import SUPPORTED_TYPES, dequantize

SUPPORTED_ARCHS = ("llama", "qwen3")  # plain decoders
HYBRID_ARCHS = ("qwen35",)  # Gated DeltaNet + attention: per-slot recurrent state (engine/state_pool.py)
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


def _v_head_order(n_k_heads: int, n_v_heads: int, tiled_from_grouped: bool) -> torch.Tensor:
    """Index list over value heads: out[j] = in[perm[j]]. Grouped (HF) head g*r + rho sits at tiled
    (GGUF) position rho*Hk + g, with r = Hv/Hk."""
    r = n_v_heads // n_k_heads
    grouped = torch.arange(n_v_heads).view(n_k_heads, r)  # [g, rho] -> grouped index
    if tiled_from_grouped:
        return grouped.t().reshape(-1)  # tiled position j = rho*Hk + g holds grouped head g*r + rho
    return torch.argsort(grouped.t().reshape(-1))


def reorder_v_heads(w: torch.Tensor, dim: int, n_k_heads: int, n_v_heads: int, head_dim: int,
                    to_gguf: bool) -> torch.Tensor:
    """Permute value heads (blocks of head_dim along `dim`) between HF grouped order and llama.cpp's
    tiled order: to_gguf=True is the converter's reorder, False its inverse (what the loader applies)."""
    perm = _v_head_order(n_k_heads, n_v_heads, to_gguf)
    idx = (perm.view(-1, 1) * head_dim + torch.arange(head_dim)).reshape(-1).to(w.device)
    return w.index_select(dim, idx)


def gdn_v_reorder(cfg: ModelConfig, name: str, w: torch.Tensor, to_gguf: bool) -> torch.Tensor:
    """Apply (to_gguf) or undo the converter's V-head reorder to one qwen35 tensor; other tensors,
    and every tensor when Hv == Hk, come back unchanged."""
    if cfg.arch != "qwen35" or cfg.gdn_v_heads == cfg.gdn_k_heads or name.count(".") < 2:
        return w
    kind = name.split(".", 2)[2]
    hk, hv, dv, kd = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_v_dim, 2 * cfg.gdn_key_dim
    if kind in ("attn_qkv.weight", "ssm_conv1d.weight"):  # only the V rows / channels after [q | k]
        return torch.cat([w[:kd], reorder_v_heads(w[kd:], 0, hk, hv, dv, to_gguf)])
    if kind == "attn_gate.weight":
        return reorder_v_heads(w, 0, hk, hv, dv, to_gguf)
    if kind in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
        return reorder_v_heads(w, 0, hk, hv, 1, to_gguf)
    if kind == "ssm_out.weight":  # columns
        return reorder_v_heads(w, 1, hk, hv, dv, to_gguf)
    return w


_REQUIRED = object()


def _qwen35_config(meta: dict[str, Any], path: str, shapes: dict[str, tuple[int, ...]], vocab: Any) -> ModelConfig:
    """qwen35 metadata -> ModelConfig, read as llama.cpp's loader reads it (same keys, same defaults),
    with every value checked: a missing, mistyped or inconsistent key is a GGUFError naming it."""
    arch = "qwen35"

    def bad(key: str, why: str) -> GGUFError:
        return GGUFError(f"{path}: metadata key {arch}.{key} {why}")

    def num(key: str, default: Any = _REQUIRED, kind: type = int, minimum: float | None = 1) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            if default is _REQUIRED:
                raise bad(key, "is missing")
            return default
        if isinstance(value, list):
            raise bad(key, f"is per-layer ({value[:4]}...), which is not supported")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise bad(key, f"has value {value!r}; expected {'an integer' if kind is int else 'a number'}")
        value = kind(value)
        if not math.isfinite(value):
            raise bad(key, f"is {value}; it must be finite")
        if minimum is not None and value < minimum:
            raise bad(key, f"is {value}; must be >= {minimum}")
        return value

    block_count = num("block_count")
    nextn = num("nextn_predict_layers", 0, minimum=0)
    if nextn >= block_count:
        raise bad("nextn_predict_layers", f"is {nextn} but block_count is {block_count}: no trunk layers left")
    n_layers = block_count - nextn
    dim, n_heads = num("embedding_length"), num("attention.head_count")
    n_kv = num("attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise bad("attention.head_count_kv", f"is {n_kv}, which does not divide head_count {n_heads}")
    interval = num("full_attention_interval", 4)  # llama.cpp's default
    first_attn = next((i for i in range(n_layers) if (i + 1) % interval == 0), None)
    q_norm = shapes.get(f"blk.{first_attn}.attn_q_norm.weight") if first_attn is not None else None
    head_dim = num("attention.key_length", q_norm[0] if q_norm else dim // n_heads)
    if num("attention.value_length", head_dim) != head_dim:
        raise bad("attention.value_length", f"differs from key_length {head_dim}; not supported")
    rope_dim = num("rope.dimension_count", head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise bad("rope.dimension_count", f"is {rope_dim}; must be even and <= head_dim {head_dim}")
    sections = meta.get(f"{arch}.rope.dimension_sections", [])
    if (not isinstance(sections, list) or len(sections) > 4
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in sections)):
        raise bad("rope.dimension_sections", f"is {sections!r}; expected up to 4 non-negative integers")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise bad("rope.scaling.type", f"is {scaling!r}; only 'none' is supported")

    k_heads, v_heads = num("ssm.group_count"), num("ssm.time_step_rank")
    if v_heads % k_heads:
        raise bad("ssm.time_step_rank", f"({v_heads} value heads) is not a multiple of ssm.group_count ({k_heads})")
    inner = num("ssm.inner_size")
    if inner % v_heads:
        raise bad("ssm.inner_size", f"({inner}) is not a multiple of ssm.time_step_rank ({v_heads})")
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")  # llama.cpp's optional explicit pattern
    if recurrent is not None:
        expected = [(i < n_layers) and (i + 1) % interval != 0 for i in range(block_count)]
        if not isinstance(recurrent, list) or [bool(x) for x in recurrent] != expected:
            raise bad("attention.recurrent_layers", f"is {recurrent!r}; only the full_attention_interval "
                      f"pattern (every {interval}th layer full attention) is supported")

    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    fields = dict(
        arch=arch, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        ffn_dim=num("feed_forward_length"), vocab_size=int(vocab),
        norm_eps=_in_domain(path, f"{arch}.attention.layer_norm_rms_epsilon",
                            num("attention.layer_norm_rms_epsilon", kind=float, minimum=None), float, 0.0, True),
        rope_theta=num("rope.freq_base", 10000.0, kind=float, minimum=1.0),
        context_length=num("context_length"), tie_embeddings="output.weight" not in shapes, qk_norm=True,
        name=str(meta.get("general.name", "")), bos_id=None if bos is None else int(bos),
        eos_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        full_attention_interval=interval, rotary_dim=rope_dim, rope_sections=tuple(sections),
        attn_output_gate=True, gdn_k_heads=k_heads, gdn_v_heads=v_heads, gdn_k_dim=num("ssm.state_size"),
        gdn_v_dim=inner // v_heads, gdn_conv_kernel=num("ssm.conv_kernel"), mtp_layers=nextn,
    )
    try:
        return ModelConfig(**fields)
    except ValueError as e:  # ModelConfig's own consistency checks
        raise GGUFError(f"{path}: inconsistent qwen35 metadata: {e}") from None


def config_from_metadata(
    meta: dict[str, Any], path: str, tensor_shapes: dict[str, tuple[int, ...]] | None = None
) -> ModelConfig:
    """Build the ModelConfig from GGUF metadata. `tensor_shapes` (torch order, by GGUF name) supplies
    what metadata cannot: whether output.weight exists (untied head) and a vocab-size fallback;
    without it the head is taken as untied."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS + HYBRID_ARCHS:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_ARCHS + HYBRID_ARCHS)})")
    shapes = tensor_shapes or {}
    if arch == "qwen35":
        return _qwen35_config(meta, path, shapes, _vocab_size(meta, path, arch, shapes))

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata key {arch}.{key} is missing")
        if isinstance(value, list):
            raise GGUFError(f"{path}: metadata key {arch}.{key} is per-layer ({value[:4]}...), which is not supported")
        return value

    def count(key: str, default: Any = None) -> int:
        return _in_domain(path, f"{arch}.{key}", get(key, default), int, 1)

    def positive(key: str, default: Any = None) -> float:
        return _in_domain(path, f"{arch}.{key}", get(key, default), float, 0.0, open_low=True)

    dim, n_heads = count("embedding_length"), count("attention.head_count")
    n_kv = count("attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise GGUFError(f"{path}: metadata key {arch}.attention.head_count_kv is {n_kv}, which does not divide "
                        f"attention.head_count {n_heads}")
    head_dim = count("attention.key_length", max(dim // n_heads, 1))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{path}: attention.value_length differs from key_length {head_dim}; not supported")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{path}: partial rotary embedding (rope.dimension_count != head_dim {head_dim}) "
                        "is not supported")
    if get("rope.scaling.type", "none") != "none":
        raise GGUFError(f"{path}: rope scaling type {get('rope.scaling.type')!r} is not supported")

    vocab = _vocab_size(meta, path, arch, shapes)

    # llama.cpp stops on any end-of-generation id: eos, end-of-turn, end-of-message
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        arch=arch,
        n_layers=count("block_count"),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn_dim=count("feed_forward_length"),
        vocab_size=int(vocab),
        norm_eps=positive("attention.layer_norm_rms_epsilon"),
        rope_theta=positive("rope.freq_base", 10000.0),
        context_length=count("context_length"),
        tie_embeddings="output.weight" not in shapes,
        qk_norm=arch == "qwen3",
        name=str(meta.get("general.name", "")),
        bos_id=None if bos is None else int(bos),
        eos_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )


def _in_domain(path: str, key: str, value: Any, kind: type, low: float, open_low: bool = False):
    """A scalar hyperparameter as `kind`, refused unless a finite number >= low (> low with open_low)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise GGUFError(f"{path}: metadata key {key} has value {value!r}; expected a number")
    if not math.isfinite(value):
        raise GGUFError(f"{path}: metadata key {key} is {value}; it must be finite")
    if kind is int and value != int(value):
        raise GGUFError(f"{path}: metadata key {key} is {value}; expected an integer")
    if value < low or (open_low and value == low):
        raise GGUFError(f"{path}: metadata key {key} is {value}; it must be {'>' if open_low else '>='} {low:g}")
    return kind(value)


def _vocab_size(meta: dict[str, Any], path: str, arch: str, shapes: dict[str, tuple[int, ...]]) -> int:
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    if vocab is None and "token_embd.weight" in shapes:
        vocab = shapes["token_embd.weight"][0]
    if vocab is None:
        raise GGUFError(f"{path}: cannot tell the vocabulary size "
                        f"(no {arch}.vocab_size, tokenizer.ggml.tokens or token_embd.weight)")
    return vocab


def _open(path: str) -> gguf.GGUFReader:
    # gguf-py builds ~1M acyclic numpy views for a tokenizer's metadata; cycle GC passes over them
    # cost more than the parse itself
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return open_reader(path)
    finally:
        if gc_was_enabled:
            gc.enable()


def _needed_by(cfg: ModelConfig, name: str) -> str:
    what = f"{cfg.arch} with {cfg.n_layers} layers"
    if cfg.arch != "qwen35" or not name.startswith("blk."):
        return what
    i = int(name.split(".")[1])
    if i >= cfg.n_layers:
        return f"{what}: MTP block {i - cfg.n_layers} of {cfg.mtp_layers}"
    kind = "full-attention" if cfg.layer_kinds[i] == "attention" else "Gated DeltaNet"
    return f"{what}: layer {i} is a {kind} layer (full_attention_interval {cfg.full_attention_interval})"


def _check_tensors(path: str, cfg: ModelConfig, found: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs: present, right shape, decodable type. Returns name -> shape."""
    wanted = cfg.tensor_shapes()
    if ROPE_FREQS in found:
        wanted[ROPE_FREQS] = (cfg.rope_dim // 2,)
    wanted.update({n: s for n, s in cfg.optional_tensor_shapes().items() if n in found})
    for name, shape in wanted.items():
        t = found.get(name)
        if t is None:
            raise GGUFError(f"{path}: tensor {name} is missing (needed by {_needed_by(cfg, name)})")
        got = tuple(int(d) for d in reversed(t.shape.tolist()))
        if got != shape:
            raise GGUFError(f"{path}: tensor {name} has shape {got}, expected {shape}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise _unsupported(path, t)
    return wanted


def _unsupported(path: str, t: Any) -> GGUFError:
    return GGUFError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which is not supported "
                     f"(supported: {_SUPPORTED_NAMES})")


# the projections keep_quantized may leave packed; everything else is dequantized
PACKABLE_PROJECTIONS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                        "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
# qwen35's Gated DeltaNet projections on top (in_proj_qkv, in_proj_z, out_proj). ssm_beta / ssm_alpha (Hv rows
# each), the conv taps, norms, ssm_a and ssm_dt stay dense: they are tiny, and the fused decoder runs the
# beta|alpha rows as a dense GEMM beside the packed qkv|z ones
GDN_PACKABLE_PROJECTIONS = ("attn_qkv.weight", "attn_gate.weight", "ssm_out.weight")
# the suffix of the index tensor that comes with a packed, column-reordered ssm_out (see _load_packed)
INPUT_ORDER = ".input_order"


def keeps_packed(cfg: ModelConfig, name: str, qtype: Any) -> bool:
    """Whether keep_quantized leaves this tensor packed: a projection, the token embedding or an untied
    output.weight stored as Q4_0 / Q4_1 / Q4_K / Q8_0. llama / qwen3: attn_q/k/v/output, ffn_gate/up/down. qwen35
    (trunk and MTP blocks): the same plus the GDN attn_qkv, attn_gate and ssm_out; its V-head reorder becomes a row
    gather (attn_qkv's V rows, attn_gate) or, for ssm_out's columns, a permutation of the GEMM's input (the loader
    adds `blk.N.ssm_out.input_order`). The embedding's gather decodes its rows on the fly (kernels/embedding.py)."""
    from onepass.kernels.quant_pack import packable

    if cfg.arch not in SUPPORTED_ARCHS + HYBRID_ARCHS or not packable(qtype):
        return False
    if name in ("output.weight", "token_embd.weight"):
        return True
    kinds = PACKABLE_PROJECTIONS + (GDN_PACKABLE_PROJECTIONS if cfg.arch == "qwen35" else ())
    return name.startswith("blk.") and name.split(".", 2)[-1] in kinds


def _check_layout(reader: gguf.GGUFReader, path: str) -> None:
    """The tensors' data as the header describes it, before any of it is read: each range aligned, inside the file,
    overlapping no other, and together covering the data section with no hole an alignment wide. A changed
    count, offset, shape or type field shows up here as one of those."""
    align, start, size = int(reader.alignment), int(reader.data_offset), len(reader.data)
    prev_end, prev, prev_t = start, "the header", None
    for t in sorted(reader.tensors, key=lambda t: int(t.data_offset)):
        off, end = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
        if (off - start) % align:
            raise GGUFError(f"{path}: tensor {t.name} starts at data offset {off - start}, not a multiple of the "
                            f"file's alignment {align}")
        if off < prev_end:
            raise GGUFError(f"{path}: tensor {t.name} (bytes {off}..{end}) overlaps {prev} (ending at {prev_end})")
        if off - prev_end >= align:
            if prev_t is not None and prev_t.tensor_type not in SUPPORTED_TYPES:   # the likelier cause, named so
                raise _unsupported(path, prev_t)
            raise GGUFError(f"{path}: {off - prev_end} unused bytes between {prev} and tensor {t.name}: a type, "
                            "shape or offset field does not match the data")
        if end > size:
            raise GGUFError(f"{path}: tensor {t.name} needs bytes up to {end}, the file has {size}")
        prev_end, prev, prev_t = end, f"tensor {t.name}", t
    if size - prev_end >= align:
        raise GGUFError(f"{path}: {size - prev_end} bytes after {prev}, the last tensor the header lists "
                        f"({len(reader.tensors)}): the tensor count or a tensor's size does not match the data")


def _check_layers(path: str, cfg: ModelConfig, found: dict[str, Any]) -> None:
    """No tensor of a layer the header does not count (block_count): such a file is not the model it claims."""
    blocks = cfg.n_layers + cfg.mtp_layers
    beyond = sorted((int(n.split(".")[1]), n) for n in found
                    if n.startswith("blk.") and n.split(".")[1].isdigit() and int(n.split(".")[1]) >= blocks)
    if beyond:
        raise GGUFError(f"{path}: tensor {beyond[0][1]} belongs to layer {beyond[0][0]}, but block_count is "
                        f"{blocks}: the file holds more layers than its header counts")


def _check_block_count(path: str, meta: dict[str, Any], found: dict[str, Any]) -> None:
    """block_count no higher than the layers the tensors hold, checked before anything is sized by it: a config of
    2**31 layers costs GBs in per-layer tables before the first missing tensor is noticed. (Layers beyond
    block_count are _check_layers' refusal.)"""
    arch = meta.get("general.architecture")
    key = f"{arch}.block_count"
    claimed = meta.get(key)
    if isinstance(claimed, bool) or not isinstance(claimed, int):
        return   # missing or mistyped: config_from_metadata names it
    # distinct layers, not the highest index: one stray blk.2147483647.* tensor must not vouch for 2**31 layers
    layers = {int(n.split(".")[1]) for n in found if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if claimed > len(layers):
        held = (f"tensors for {len(layers)} layers (blk.{min(layers)} to blk.{max(layers)})" if layers
                else "no blk.* tensors")
        raise GGUFError(f"{path}: metadata key {key} is {claimed}, but the file holds {held}: the header does not "
                        "describe this file's layers; use an intact copy of the file")


def _header(reader: gguf.GGUFReader, path: str) -> tuple[dict[str, Any], dict[str, Any], ModelConfig]:
    _check_layout(reader, path)
    meta = read_metadata(reader)
    found = {t.name: t for t in reader.tensors}
    _check_block_count(path, meta, found)
    shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in found.items()}
    cfg = config_from_metadata(meta, path, shapes)
    _check_layers(path, cfg, found)
    return meta, found, cfg


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The file's ModelConfig from its header alone (no tensor is read): what a job may check before loading."""
    path = os.fspath(path)
    return _header(_open(path), path)[2]


def load_gguf(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    progress: bool = True, keep_quantized: bool = False,
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, weights by GGUF name in torch (out, in) layout as `dtype` on `device`, raw metadata).
    `rope_freqs.weight` (Llama 3 RoPE divisors), when present, is included as float32.

    keep_quantized: every projection `keeps_packed` names comes back as an kernels.quant_pack.PackedWeight
    on `device` (the file's bits repacked once, on the device: memory ~ the file's size) instead of a
    dequantized tensor; llama's q/k rows are un-permuted by an exact row gather, and so are qwen35's
    V-head rows (attn_qkv's V part, attn_gate). A packed qwen35 ssm_out, whose V-head reorder is a column
    permutation that packed blocks cannot take, keeps the file's column order and comes with
    `blk.N.ssm_out.input_order` (int64 [Hv*Dv], only when Hv != Hk): the GEMM's input x (model head order)
    must be fed as x[:, input_order] (engine/fused_qwen35.py does it). A packable token_embd stays packed too (the
    gather decodes its rows), and when the LM head is tied to it, `output.weight` is the same PackedWeight (one copy:
    the weights take ~ the file's bytes). Other tensors as before."""
    path = os.fspath(path)
    reader = _open(path)
    meta, found, cfg = _header(reader, path)
    wanted = _check_tensors(path, cfg, found)

    weights: dict[str, torch.Tensor] = {}
    for name in tqdm(wanted, desc=f"loading {os.path.basename(path)}", unit="tensor", disable=not progress):
        t = found[name]
        # copy out of the read-only memmap so torch owns writable bytes; decode on the target device
        raw = torch.from_numpy(np.array(t.data, copy=True).view(np.uint8)).to(device)
        if keep_quantized and keeps_packed(cfg, name, t.tensor_type):
            weights[name] = _load_packed(cfg, name, raw, t.tensor_type, wanted[name])
            _check_finite(path, name, weights[name].scales, weights[name].mins)
            order = ssm_out_input_order(cfg, name)
            if order is not None:  # ssm_out's columns stay in the file's order: permute its input instead
                weights[name.removesuffix(".weight") + INPUT_ORDER] = order.to(device)
            if name == "token_embd.weight" and cfg.tie_embeddings:
                weights["output.weight"] = weights[name]   # tied LM head: the same packed bytes
            continue
        w = dequantize(raw, t.tensor_type, wanted[name])
        _check_finite(path, name, w)
        n_head = qk_heads(cfg, name)
        if n_head is not None:
            w = unpermute_qk(w, n_head)
        w = gdn_v_reorder(cfg, name, w, to_gguf=False)
        weights[name] = w if name == ROPE_FREQS else w.to(dtype)
    return cfg, weights, meta


def _check_finite(path: str, name: str, *tensors: torch.Tensor | None) -> None:
    """A weight (or a packed weight's scales) with a NaN or an infinity makes every output NaN or garbage that a
    greedy check can still call consistent: refused at load, named (one pass over the values; on the CPU about a
    second per 4 GB)."""
    for t in tensors:
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise GGUFError(f"{path}: tensor {name} holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or inf)")


def ssm_out_input_order(cfg: ModelConfig, name: str) -> torch.Tensor | None:
    """For a qwen35 ssm_out kept in the file's column order: the index list (int64, CPU) that puts the model's
    gated-norm output (HF grouped V-head order) into the file's (tiled) order, x_file = x[:, order], so that
    x_file @ W_file^T == x @ W^T with W the loader's dense, reordered weight. None for every other tensor
    and when Hv == Hk (no reorder)."""
    if not name.endswith(".ssm_out.weight"):
        return None
    cols = torch.arange(cfg.gdn_value_dim).view(1, -1)
    order = gdn_v_reorder(cfg, name, cols, to_gguf=True)  # the converter's own column permutation
    return None if order is cols else order.view(-1).contiguous()


def _load_packed(cfg: ModelConfig, name: str, raw: torch.Tensor, qtype: Any, shape: tuple[int, ...]):
    """One projection's raw bytes -> PackedWeight, with llama's q/k rows back in rotate-half order and
    qwen35's V-head rows (attn_qkv's V part, attn_gate) back in grouped order; ssm_out stays as in the file
    (its reorder is on columns: see ssm_out_input_order)."""
    from onepass.kernels.quant_pack import pack

    pw = pack(raw, qtype, shape)
    rows = torch.arange(shape[0]).view(-1, 1)
    n_head = qk_heads(cfg, name)
    if n_head is not None:  # the same row permutation unpermute_qk applies, as an index list
        pw = pw.select_rows(unpermute_qk(rows, n_head).view(-1))
    elif not name.endswith(".ssm_out.weight"):
        idx = gdn_v_reorder(cfg, name, rows, to_gguf=False)  # the loader's row reorder, as an index list
        if idx is not rows:
            pw = pw.select_rows(idx.view(-1))
    return pw
