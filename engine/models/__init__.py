"""Model families; `build_model` picks one from the config's architecture."""
from __future__ import annotations

import torch

from onepass.engine.config import ModelConfig
from onepass.kernels.errors import GGUFError
from onepass.engine.models.llama import LlamaModel
from onepass.engine.models.qwen3 import Qwen3Model
from onepass.engine.models.qwen35 import Qwen35Model

MODELS = {"llama": LlamaModel, "qwen3": Qwen3Model, "qwen35": Qwen35Model}


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> LlamaModel | Qwen35Model:
    """The plain-torch reference decoder for the config's architecture."""
    if cfg.arch not in MODELS:
        raise GGUFError(f"no model for architecture {cfg.arch!r}; supported: {sorted(MODELS)}")
    return MODELS[cfg.arch](cfg, weights)
