"""The peer measured in the same process: HF transformers `generate` with the static KV cache
(torch.compile'd by transformers), built from the very weights our engine runs."""
from __future__ import annotations

import time

import torch

from onepass.engine.config import ModelConfig


def hf_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
    import transformers

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.context_length,
                  tie_word_embeddings=cfg.tie_embeddings)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if "rope_freqs.weight" in weights:
        s = cfg.rope_scaling
        if s is None:
            raise ValueError("the peer needs the llama3 scaling parameters; only synthetic models carry them")
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_context}
    if cfg.arch == "qwen3":
        hf_cfg, cls = transformers.Qwen3Config(**common, rope_parameters=rope), transformers.Qwen3ForCausalLM
    else:
        hf_cfg, cls = transformers.LlamaConfig(**common, rope_parameters=rope), transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(hf_cfg)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    state = {"model.embed_tokens.weight": weights["token_embd.weight"],
             "model.norm.weight": weights["output_norm.weight"],
             "lm_head.weight": weights.get("output.weight", weights["token_embd.weight"])}
    for key, t in weights.items():
        parts = key.split(".")
        if parts[0] == "blk" and parts[2] in names:
            state[f"model.layers.{parts[1]}.{names[parts[2]]}.weight"] = t
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, assign=True, strict=False)
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg).to(device)  # its buffers were on meta
    return model.to(device).eval()


@torch.inference_mode()
def hf_static_generate_rate(model, prompt: list[int], batch: int, new_tokens: int) -> dict[str, float]:
    """Decode rate of `generate` with cache_implementation="static": (time of N tokens - time of 1 token)
    over B*(N-1) tokens, after warm-up runs that compile for this batch size."""
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt] * batch, device=dev)
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0, eos_token_id=None)

    def timed(n: int) -> tuple[float, torch.Tensor]:
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t0, out

    t_compile0 = time.perf_counter()
    for n in (new_tokens, 1, new_tokens):  # compile and warm both lengths
        timed(n)
    compile_s = time.perf_counter() - t_compile0
    t_full, out = timed(new_tokens)
    t_one, _ = timed(1)
    rate = batch * (new_tokens - 1) / max(t_full - t_one, 1e-9)
    return {"peer_tok_s": rate, "peer_step_ms": (t_full - t_one) / (new_tokens - 1) * 1e3, "peer_warmup_s": compile_s,
            "peer_tokens": out[0, len(prompt):].tolist()}


@torch.inference_mode()
def hf_serving_rate(model, requests: list[tuple[list[int], int]], warmup: int = 8) -> dict:
    """HF transformers continuous batching (`init_continuous_batching`, paged attention): every request
    with its own max_new_tokens, greedy; generated tokens over the wall time from first submission
    to last result, after a short warm-up batch."""
    import transformers

    gc = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in requests),
                                       eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gc)
    manager.start()
    try:
        def serve(reqs, tag: str) -> tuple[float, dict[str, list[int]]]:
            t0 = time.perf_counter()
            ids = [manager.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n) for i, (p, n) in enumerate(reqs)]
            out = {}
            while len(out) < len(ids):
                r = manager.get_result(timeout=120)
                if r is None:
                    raise RuntimeError(f"HF continuous batching returned {len(out)} of {len(ids)} requests")
                if r.request_id.startswith(tag):
                    out[r.request_id] = list(r.generated_tokens)
            return time.perf_counter() - t0, out

        serve(requests[:warmup], "warm")
        wall, out = serve(requests, "r")
    finally:
        manager.stop(block=True)
    generated = sum(len(v) for v in out.values())
    return {"peer_tok_s": generated / wall, "peer_requests_s": len(out) / wall, "peer_wall_s": wall,
            "peer_outputs": [out[f"r{i}"] for i in range(len(requests))]}
