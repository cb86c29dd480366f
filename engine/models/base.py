"""What every decoder holds: the token embedding (dense, or packed under keep_quantized), the final norm and the LM
head (the embedding itself when the file has no output.weight), on one device in one dtype."""
from __future__ import annotations

import torch


class DecoderBase:
    def _init_head(self, weights: dict[str, torch.Tensor]) -> None:
        self.embed = weights["token_embd.weight"]
        self.out_norm = weights["output_norm.weight"]
        self.lm_head = weights.get("output.weight", self.embed)  # tied when the file has no output.weight

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.out_norm.dtype   # the embedding may be packed (engine/gguf_loader.py keep_quantized)
