"""qwen35 (Qwen3.5/3.6/3.8 hybrid: Gated DeltaNet + gated attention): synthetic GGUFs with llama.cpp's
converter layout, the loader's trap handling, the reference model against an independent oracle, and
the per-slot recurrent state.

Oracle: transformers cannot load a qwen35 GGUF, so `hf_from_gguf` reads the file with gguf-py alone
and inverts llama.cpp's conversion (norms - 1 except ssm_norm, A_log = log(-ssm_a), conv kernel
unsqueezed, V heads tiled -> grouped by an explicit index formula) into a Qwen3_5ForCausalLM.

Tolerances (fp32 everywhere, same weights): HF prefills with the chunked (UT-transform) delta rule and
fused-matmul attention, we walk the recurrence token by token, so logits differ by op order only:
measured ~5e-6 on logits of magnitude ~4; we allow LOGIT_ATOL = 1e-4 absolute on logits and
STATE_RTOL = 2e-5 on the recurrent state / conv ring (errors relative to max(1, max |ref|)). Chunked
prefill widths differ only in GEMM row counts (CPU GEMMs round by shape), so states, KV and logits agree
to CHUNK_RTOL = 2e-5 (measured <= 6e-6), not bit for bit; greedy tokens must agree exactly.
"""
from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from onepass.engine.config import LAYER_ATTENTION, LAYER_GDN, ModelConfig
from onepass.kernels.errors import ConfigError, GGUFError
from onepass.engine.gguf_loader import config_from_metadata, load_gguf
from onepass.engine.gguf_meta import read_metadata
from onepass.engine.gguf_writer import random_weights, write_gguf
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.models import build_model
from onepass.engine.sampler import SamplingParams
from onepass.engine.state_pool import HybridCache, StatePool, drop_recurrent_kv
from onepass.engine.models.generate import reference_generate

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4
STATE_RTOL = 2e-5
CHUNK_RTOL = 2e-5
EPS32 = float(np.float32(1e-6))  # what a GGUF float32 key gives back

_BASE = dict(arch="qwen35", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96, vocab_size=256,
             norm_eps=EPS32, rope_theta=1e7, context_length=256, qk_norm=True, rotary_dim=8, rope_sections=(2, 1, 1, 0),
             attn_output_gate=True, gdn_conv_kernel=4, bos_id=1, eos_ids=(2,))
CONFIGS = {
    # value heads == key heads (no reorder), tied head, two GDN + two attention layers, no MTP
    "equal-heads": ModelConfig(**_BASE, name="tiny-qwen35-eq", full_attention_interval=2, gdn_k_heads=2,
                               gdn_v_heads=2, gdn_k_dim=16, gdn_v_dim=16, tie_embeddings=True),
    # 3x value heads (reordered in the file), Dk != Dv, untied, 3 GDN + 1 attention (27B's pattern), 1 MTP block
    "3x-value-heads": ModelConfig(**_BASE, name="tiny-qwen35-gva", full_attention_interval=4, gdn_k_heads=2,
                                  gdn_v_heads=6, gdn_k_dim=8, gdn_v_dim=16, tie_embeddings=False, mtp_layers=1),
}
SEEDS = {"equal-heads": 11, "3x-value-heads": 12}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| relative to max(1, max |ref|)."""
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------------
# the oracle: HF transformers' Qwen3.5 built from the GGUF by inverting llama.cpp's conversion


def read_file(path):
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)
                                        .reshape(tuple(reversed(t.shape.tolist()))).copy()) for t in r.tensors}
    return meta, tensors, {t.name: t.tensor_type for t in r.tensors}


def tiled_to_hf(w: torch.Tensor, dim: int, hk: int, hv: int, hd: int) -> torch.Tensor:
    """GGUF value head j = rho*Hk + g is HF value head g*r + rho (r = Hv/Hk): gather HF order explicitly."""
    r = hv // hk
    idx = [(rho * hk + g) * hd + e for g in range(hk) for rho in range(r) for e in range(hd)]
    return w.index_select(dim, torch.tensor(idx))


def hf_from_gguf(path):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    meta, t, _ = read_file(path)
    A = "qwen35."
    n_layers = meta[A + "block_count"] - meta.get(A + "nextn_predict_layers", 0)
    hk, hv, dk = meta[A + "ssm.group_count"], meta[A + "ssm.time_step_rank"], meta[A + "ssm.state_size"]
    dv, hd = meta[A + "ssm.inner_size"] // hv, meta[A + "attention.key_length"]
    conf = Qwen3_5TextConfig(
        vocab_size=t["token_embd.weight"].shape[0], hidden_size=meta[A + "embedding_length"],
        intermediate_size=meta[A + "feed_forward_length"], num_hidden_layers=n_layers,
        num_attention_heads=meta[A + "attention.head_count"], num_key_value_heads=meta[A + "attention.head_count_kv"],
        head_dim=hd, rms_norm_eps=meta[A + "attention.layer_norm_rms_epsilon"],
        tie_word_embeddings="output.weight" not in t, max_position_embeddings=meta[A + "context_length"],
        rope_parameters={"rope_type": "default", "rope_theta": meta[A + "rope.freq_base"],
                         "partial_rotary_factor": meta[A + "rope.dimension_count"] / hd,
                         "mrope_section": list(meta[A + "rope.dimension_sections"][:3])},
        linear_conv_kernel_dim=meta[A + "ssm.conv_kernel"], linear_key_head_dim=dk, linear_value_head_dim=dv,
        linear_num_key_heads=hk, linear_num_value_heads=hv, full_attention_interval=meta[A + "full_attention_interval"],
        pad_token_id=0, bos_token_id=None, eos_token_id=None, attn_implementation="eager")
    untile = lambda w, dim, h: tiled_to_hf(w, dim, hk, hv, h)  # noqa: E731
    kd = 2 * hk * dk
    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"] - 1,
          "lm_head.weight": t.get("output.weight", t["token_embd.weight"])}
    for i in range(n_layers):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        sd[q + "input_layernorm.weight"] = t[p + "attn_norm.weight"] - 1
        sd[q + "post_attention_layernorm.weight"] = t[p + "post_attention_norm.weight"] - 1
        for a, b in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
            sd[q + f"mlp.{a}_proj.weight"] = t[p + b + ".weight"]
        if conf.layer_types[i] == "full_attention":
            for a, b in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                sd[q + f"self_attn.{a}.weight"] = t[p + b + ".weight"]
            sd[q + "self_attn.q_norm.weight"] = t[p + "attn_q_norm.weight"] - 1
            sd[q + "self_attn.k_norm.weight"] = t[p + "attn_k_norm.weight"] - 1
        else:
            la, qkv, conv = q + "linear_attn.", t[p + "attn_qkv.weight"], t[p + "ssm_conv1d.weight"]
            sd[la + "in_proj_qkv.weight"] = torch.cat([qkv[:kd], untile(qkv[kd:], 0, dv)])
            sd[la + "conv1d.weight"] = torch.cat([conv[:kd], untile(conv[kd:], 0, dv)])[:, None, :]
            sd[la + "in_proj_z.weight"] = untile(t[p + "attn_gate.weight"], 0, dv)
            sd[la + "in_proj_b.weight"] = untile(t[p + "ssm_beta.weight"], 0, 1)
            sd[la + "in_proj_a.weight"] = untile(t[p + "ssm_alpha.weight"], 0, 1)
            sd[la + "dt_bias"] = untile(t[p + "ssm_dt.bias"], 0, 1)
            sd[la + "A_log"] = torch.log(-untile(t[p + "ssm_a"], 0, 1))
            sd[la + "norm.weight"] = t[p + "ssm_norm.weight"]  # the one norm without a baked +1
            sd[la + "out_proj.weight"] = untile(t[p + "ssm_out.weight"], 1, dv)
    hf = Qwen3_5ForCausalLM(conf).float().eval()
    hf.load_state_dict(sd, strict=True)
    return hf


# ---------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (path, given weights, loaded cfg, loaded weights, our model, HF oracle)."""
    d = tmp_path_factory.mktemp("qwen35")
    out = {}
    for name, cfg in CONFIGS.items():
        path = d / f"{cfg.name}.gguf"
        given = random_weights(cfg, seed=SEEDS[name])
        write_gguf(path, cfg, given, weight_type="f32")
        lcfg, w, _ = load_gguf(path, progress=False)
        out[name] = (path, given, lcfg, w, build_model(lcfg, w), hf_from_gguf(path))
    return out


def cache(cfg, slots=1, ctx=64, **kw):
    return HybridCache.create(cfg, slots, ctx, torch.float32, "cpu", **kw)


def run_chunks(model, kv, ids: list[int], width: int, slot: int = 0) -> torch.Tensor:
    """Prefill `ids` into `slot` in forwards of `width` tokens; return the last logits [V]."""
    for s in range(0, len(ids), width):
        chunk = ids[s:s + width]
        logits = model.forward(torch.tensor([chunk]), torch.arange(s, s + len(chunk)).view(1, -1),
                               torch.tensor([slot]), kv)
    return logits[0]


def greedy(model, kv, ids: list[int], n: int, width: int | None = None, slot: int = 0) -> list[int]:
    logits = run_chunks(model, kv, ids, width or len(ids), slot)
    out = [int(logits.argmax())]
    for p in range(len(ids), len(ids) + n - 1):
        logits = model.forward(torch.tensor([[out[-1]]]), torch.tensor([[p]]), torch.tensor([slot]), kv)[0]
        out.append(int(logits.argmax()))
    return out


# ---------------------------------------------------------------------------------------------------
# loading and the file layout


@pytest.mark.parametrize("name", CONFIGS)
def test_config_round_trip_and_layer_kinds(tiny, name):
    path, _, lcfg, _, _, _ = tiny[name]
    cfg = CONFIGS[name]
    assert lcfg == cfg
    meta = read_metadata(gguf.GGUFReader(path))
    assert meta["qwen35.block_count"] == cfg.n_layers + cfg.mtp_layers  # MTP counted in block_count
    assert meta.get("qwen35.nextn_predict_layers", 0) == cfg.mtp_layers
    assert meta["qwen35.rope.dimension_count"] == 8 and meta["qwen35.ssm.inner_size"] == cfg.gdn_value_dim
    attn = [i for i, k in enumerate(lcfg.layer_kinds) if k == LAYER_ATTENTION]
    assert attn == ([1, 3] if name == "equal-heads" else [3])
    assert lcfg.gdn_layers == tuple(i for i in range(4) if i not in attn)
    assert set(lcfg.layer_kinds) == {LAYER_ATTENTION, LAYER_GDN}


@pytest.mark.parametrize("name", CONFIGS)
def test_file_holds_converter_layout_and_loader_undoes_it(tiny, name):
    path, given, lcfg, w, _, _ = tiny[name]
    _, raw, types = read_file(path)
    assert set(raw) == set(lcfg.tensor_shapes())  # exact tensor set: no ffn_norm, ssm_a without .weight
    assert "blk.0.ssm_a" in raw and "blk.0.ssm_a.weight" not in raw and "blk.0.ssm_dt.bias" in raw
    assert all(types[n] == QT.F32 for n in raw if n.endswith(("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias")))
    assert lcfg.tensor_shapes()["blk.3.attn_q.weight"] == (2 * lcfg.q_dim, lcfg.dim)  # q and gate packed
    hk, hv, dv, kd = lcfg.gdn_k_heads, lcfg.gdn_v_heads, lcfg.gdn_v_dim, 2 * lcfg.gdn_key_dim
    for n in given:  # f32: what we load is exactly what we gave (the file's reorder undone)
        assert torch.equal(w[n], given[n]), n
    for n in ("blk.0.attn_gate.weight", "blk.0.ssm_out.weight", "blk.0.ssm_a", "blk.0.attn_qkv.weight"):
        dim, hd = (1, dv) if "ssm_out" in n else (0, 1 if n.endswith("ssm_a") else dv)
        file_v = raw[n][kd:] if "attn_qkv" in n else raw[n]
        given_v = given[n][kd:] if "attn_qkv" in n else given[n]
        assert torch.equal(tiled_to_hf(file_v, dim, hk, hv, hd), given_v), n
        assert torch.equal(file_v, given_v) == (hv == hk), n  # reordered in the file only when Hv != Hk


def test_mtp_tensors_present_after_load(tiny):
    _, given, lcfg, w, model, _ = tiny["3x-value-heads"]
    assert lcfg.mtp_layers == 1 and lcfg.n_layers == 4
    mtp = {n for n in w if n.startswith("blk.4.")}
    assert len(mtp) == 15  # a full-attention block (11) + eh_proj, enorm, hnorm, shared_head_norm
    assert w["blk.4.nextn.eh_proj.weight"].shape == (lcfg.dim, 2 * lcfg.dim)
    assert set(model.mtp_weights) == mtp
    assert all(torch.equal(w[n], given[n]) for n in mtp)
    assert not any(n.startswith("blk.4.") for n in tiny["equal-heads"][3])


# ---------------------------------------------------------------------------------------------------
# against HF transformers


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_state_match_transformers(tiny, name):
    _, _, cfg, _, model, hf = tiny[name]
    ids = prompt(1, 24)
    kv = cache(cfg)
    got = model.forward(torch.tensor([ids]), torch.arange(24).view(1, -1), torch.tensor([0]), kv, last_only=False)[0]
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
    assert (got - out.logits[0]).abs().max().item() <= LOGIT_ATOL
    assert torch.equal(got.argmax(-1), out.logits[0].argmax(-1))
    hf_cache = getattr(out, "cache", None) or out.past_key_values
    K = cfg.gdn_conv_kernel
    for j, layer in enumerate(cfg.gdn_layers):  # our state layout and head order are HF's
        assert rel_err(kv.state.ssm[j][0], hf_cache.get_recurrent_state(layer)[0]) <= STATE_RTOL
        assert rel_err(kv.state.conv[j][0], hf_cache.get_conv_state(layer)[0, :, -(K - 1):]) <= STATE_RTOL


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_16_tokens_match_transformers(tiny, name):
    _, _, cfg, _, model, hf = tiny[name]
    prompts = [prompt(2, 9), prompt(3, 9)]
    kv = cache(cfg, slots=2)
    mine = reference_generate(model, kv, prompts, 16, SamplingParams()).outputs  # the reference loop, unchanged
    for p, m in zip(prompts, mine):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                 pad_token_id=0)[0, len(p):].tolist()
        assert m == theirs


def test_quantized_file_matches_transformers(tmp_path):
    """Q8_0 matrices: the reorder is undone after dequantization, so we hold exactly the file's values
    in HF order, and the model still matches the oracle built from the same (dequantized) file."""
    cfg = CONFIGS["3x-value-heads"]
    path = tmp_path / "q8.gguf"
    write_gguf(path, cfg, random_weights(cfg, seed=5), weight_type="q8_0")
    lcfg, w, _ = load_gguf(path, progress=False)
    _, raw, types = read_file(path)
    assert types["blk.0.ssm_out.weight"] == QT.Q8_0 and types["blk.0.ssm_conv1d.weight"] == QT.F32
    assert torch.equal(w["blk.0.ssm_out.weight"], tiled_to_hf(raw["blk.0.ssm_out.weight"], 1, 2, 6, 16))
    ids = prompt(13, 16)
    got = build_model(lcfg, w).forward(
        torch.tensor([ids]), torch.arange(16).view(1, -1), torch.tensor([0]), cache(lcfg), last_only=False)[0]
    with torch.no_grad():
        ref = hf_from_gguf(path)(torch.tensor([ids])).logits[0]
    assert (got - ref).abs().max().item() <= LOGIT_ATOL


# ---------------------------------------------------------------------------------------------------
# the per-slot state


@pytest.mark.parametrize("name", CONFIGS)
def test_chunked_prefill_widths_give_same_state_and_tokens(tiny, name):
    _, _, cfg, _, model, _ = tiny[name]
    ids = prompt(4, 19)
    ref = cache(cfg)
    ref_last = run_chunks(model, ref, ids, 1)  # token by token, as decode walks it
    attn = [i for i, k in enumerate(cfg.layer_kinds) if k == LAYER_ATTENTION]
    for width in (3, 8, 19):
        kv = cache(cfg)
        last = run_chunks(model, kv, ids, width)
        for a, b in zip(kv.state.ssm + kv.state.conv, ref.state.ssm + ref.state.conv):
            assert rel_err(a, b) <= CHUNK_RTOL, width
        for i in attn:
            assert rel_err(kv.kv.k[i], ref.kv.k[i]) <= CHUNK_RTOL and rel_err(kv.kv.v[i], ref.kv.v[i]) <= CHUNK_RTOL
        assert rel_err(last, ref_last) <= CHUNK_RTOL, width
        assert kv.state.seen[0] == 19
    tokens = {w: greedy(model, cache(cfg), ids, 8, width=w) for w in (1, 3, 8, 19)}
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens


def test_token_and_batched_prefill_modes_agree(tiny):
    _, _, cfg, _, model, _ = tiny["3x-value-heads"]
    prompts = [prompt(5, 7), prompt(6, 7)]
    a = reference_generate(model, cache(cfg, slots=2), prompts, 10, SamplingParams(), prefill="token").outputs
    b = reference_generate(model, cache(cfg, slots=2), prompts, 10, SamplingParams(), prefill="batched").outputs
    assert a == b


def test_slots_are_independent(tiny):
    """Two sequences in slots 2 and 0 of a 3-slot pool, started at different steps (so each forward mixes
    rows at different positions), produce exactly what each produces alone in a fresh pool."""
    _, _, cfg, _, model, _ = tiny["3x-value-heads"]
    p = {2: prompt(7, 10), 0: prompt(8, 6)}
    start = {2: 0, 0: 4}
    alone = {s: greedy(model, cache(cfg), p[s], 8) for s in p}
    kv = cache(cfg, slots=3)
    fed = {s: list(p[s]) for s in p}  # tokens to feed per slot (prompt, then its own samples)
    out = {s: [] for s in p}
    for step in range(30):
        rows = [s for s in p if step >= start[s] and len(out[s]) < 8]
        if not rows:
            break
        pos = [step - start[s] for s in rows]
        tok = [fed[s][q] for s, q in zip(rows, pos)]
        logits = model.forward(torch.tensor(tok).view(-1, 1), torch.tensor(pos).view(-1, 1), torch.tensor(rows), kv)
        for r, s in enumerate(rows):
            if pos[r] >= len(p[s]) - 1:  # past the prompt: the logits sample this slot's next token
                nxt = int(logits[r].argmax())
                out[s].append(nxt)
                fed[s].append(nxt)
    assert out == alone
    assert kv.state.ssm[0][1].abs().max() == 0  # slot 1 untouched


def test_slot_reuse_resets_state(tiny):
    _, _, cfg, _, model, _ = tiny["3x-value-heads"]
    a, b = prompt(9, 11), prompt(10, 6)
    fresh = cache(cfg)
    want = greedy(model, fresh, b, 6)
    kv = cache(cfg)
    greedy(model, kv, a, 5)  # slot 0 holds a's state through 15 tokens
    assert kv.state.seen[0] == 15
    assert greedy(model, kv, b, 6) == want  # a forward at position 0 starts a new sequence
    for x, y in zip(kv.state.ssm + kv.state.conv, fresh.state.ssm + fresh.state.conv):
        assert torch.equal(x, y)
    kv.reset([0])
    assert all(t[0].abs().max() == 0 for t in kv.state.ssm + kv.state.conv) and kv.state.seen[0] == 0


def test_state_continuity_is_checked(tiny):
    _, _, cfg, _, model, _ = tiny["equal-heads"]
    kv = cache(cfg, slots=2)
    run_chunks(model, kv, prompt(11, 5), 5)
    with pytest.raises(ConfigError, match="slot 0: a forward starts at position 7 but .* holds 5 tokens"):
        model.forward(torch.tensor([[5]]), torch.tensor([[7]]), torch.tensor([0]), kv)
    with pytest.raises(ConfigError, match="consecutive positions"):
        model.forward(torch.tensor([[5, 6]]), torch.tensor([[5, 7]]), torch.tensor([0]), kv)
    with pytest.raises(ConfigError, match="twice"):
        model.forward(torch.tensor([[5], [6]]), torch.tensor([[0], [0]]), torch.tensor([1, 1]), kv)
    with pytest.raises(ConfigError, match="StatePool"):
        model.forward(torch.tensor([[5]]), torch.tensor([[0]]), torch.tensor([0]),
                      ContiguousKVCache(cfg, 1, 8, torch.float32, "cpu"))
    # the same pool passed explicitly works with a plain KV cache
    plain = ContiguousKVCache(cfg, 2, 64, torch.float32, "cpu")
    state = StatePool(cfg, 2)
    assert torch.equal(model.forward(torch.tensor([prompt(11, 5)]), torch.arange(5).view(1, -1), torch.tensor([0]),
                                     plain, state=state),
                       model.forward(torch.tensor([prompt(11, 5)]), torch.arange(5).view(1, -1), torch.tensor([0]),
                                     cache(cfg)))


def test_state_pool_layout_and_bf16_option(tiny):
    _, _, cfg, _, model, _ = tiny["3x-value-heads"]
    pool = StatePool(cfg, 3, "cpu")
    assert len(pool.ssm) == len(pool.conv) == 3 and pool.layers == (0, 1, 2)
    assert pool.ssm[0].shape == (3, 6, 8, 16) and pool.ssm[0].dtype == torch.float32  # [slots, Hv, Dk, Dv]
    assert pool.conv[0].shape == (3, cfg.gdn_conv_dim, 3)  # [slots, 2*Hk*Dk + Hv*Dv, K-1]
    assert pool.nbytes == 3 * 3 * 4 * (6 * 8 * 16 + cfg.gdn_conv_dim * 3)
    ids = prompt(12, 12)
    kv16 = cache(cfg, state_dtype=torch.bfloat16)
    assert kv16.state.ssm[0].dtype == torch.bfloat16
    lo = run_chunks(model, kv16, ids, 12)
    hi = run_chunks(model, cache(cfg), ids, 12)
    assert (lo - hi).abs().max().item() < 0.1  # bf16 state: close, not equal
    kv16b = cache(cfg, state_dtype=torch.bfloat16)
    run_chunks(model, kv16b, ids, 1)  # rounded after every token either way
    for x, y in zip(kv16.state.ssm, kv16b.state.ssm):
        assert (x.float() - y.float()).abs().max().item() <= 1e-2


def test_conv_ring_in_activation_dtype_is_exact(tiny):
    """HybridCache.create keeps the conv rings in the activations' dtype. They hold projection outputs, which are
    already that dtype, so a bf16 model gives the same logits and ring contents as with fp32 rings."""
    _, _, cfg, w, _, _ = tiny["3x-value-heads"]
    wb = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in w.items()}
    model = build_model(cfg, wb)
    narrow = HybridCache.create(cfg, 1, 64, torch.bfloat16, "cpu")
    wide = HybridCache(drop_recurrent_kv(ContiguousKVCache(cfg, 1, 64, torch.bfloat16, "cpu"), cfg), StatePool(cfg, 1))
    assert narrow.state.conv[0].dtype == torch.bfloat16 and wide.state.conv[0].dtype == torch.float32
    ids = prompt(12, 13)
    assert torch.equal(run_chunks(model, narrow, ids, 5), run_chunks(model, wide, ids, 5))
    for x, y in zip(narrow.state.conv, wide.state.conv):
        assert torch.equal(x.float(), y)


# ---------------------------------------------------------------------------------------------------
# loader errors


def _write(tmp_path, cfg, weights, name="bad.gguf"):
    path = tmp_path / name
    write_gguf(path, cfg, weights, weight_type="f32")
    return path


def test_missing_tensor_is_named(tmp_path):
    cfg = CONFIGS["3x-value-heads"]
    w = random_weights(cfg, seed=1)
    del w["blk.0.ssm_a"]
    path = _write(tmp_path, cfg, w)
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor blk\.0\.ssm_a is missing .*layer 0 is a Gated DeltaNet"):
        load_gguf(path, progress=False)
    w = random_weights(cfg, seed=1)
    del w["blk.4.nextn.eh_proj.weight"]
    with pytest.raises(GGUFError, match=r"blk\.4\.nextn\.eh_proj\.weight is missing .*MTP block 0"):
        load_gguf(_write(tmp_path, cfg, w, "mtp.gguf"), progress=False)


def test_wrong_shape_is_named(tmp_path):
    cfg = CONFIGS["3x-value-heads"]
    w = random_weights(cfg, seed=1)
    w["blk.1.ssm_conv1d.weight"] = w["blk.1.ssm_conv1d.weight"][:, :3].contiguous()
    with pytest.raises(GGUFError, match=r"tensor blk\.1\.ssm_conv1d\.weight has shape \(128, 3\), expected \(128, 4\)"):
        load_gguf(_write(tmp_path, cfg, w), progress=False)
    w = random_weights(cfg, seed=1)
    w["blk.3.attn_q.weight"] = w["blk.3.attn_q.weight"][: cfg.q_dim].contiguous()  # q without the packed gate
    with pytest.raises(GGUFError, match=r"blk\.3\.attn_q\.weight has shape \(128, 64\), expected \(256, 64\)"):
        load_gguf(_write(tmp_path, cfg, w, "q.gguf"), progress=False)


@pytest.mark.parametrize("key, value, message", [
    ("ssm.inner_size", 50, "(50) is not a multiple of ssm.time_step_rank (6)"),
    ("ssm.time_step_rank", 5, "(5 value heads) is not a multiple of ssm.group_count (2)"),
    ("ssm.state_size", None, "is missing"),
    ("ssm.conv_kernel", "4", "has value '4'; expected an integer"),
    ("full_attention_interval", 0, "is 0; must be >= 1"),
    ("nextn_predict_layers", 5, "is 5 but block_count is 5"),
    ("rope.dimension_count", 7, "is 7; must be even"),
    ("rope.dimension_count", 64, "is 64; must be even and <= head_dim 32"),
    ("rope.dimension_sections", [2, -1], "is [2, -1]; expected up to 4 non-negative integers"),
    ("attention.layer_norm_rms_epsilon", [1e-6, 1e-6], "is per-layer"),
    ("attention.recurrent_layers", [True] * 5, "only the full_attention_interval pattern"),
])
def test_bad_metadata_names_key_and_file(tiny, key, value, message):
    path = tiny["3x-value-heads"][0]
    meta = read_metadata(gguf.GGUFReader(path))
    if value is None:
        del meta[f"qwen35.{key}"]
    else:
        meta[f"qwen35.{key}"] = value
    with pytest.raises(GGUFError,
                       match="^" + re.escape(f"{path}: metadata key qwen35.{key} ") + ".*" + re.escape(message)):
        config_from_metadata(meta, str(path))


def test_bad_metadata_through_load_gguf(tmp_path, monkeypatch):
    cfg = CONFIGS["equal-heads"]
    monkeypatch.setattr(gguf.GGUFWriter, "add_ssm_inner_size",
                        lambda self, v: self.add_uint32("qwen35.ssm.inner_size", v + 1))
    path = _write(tmp_path, cfg, random_weights(cfg, seed=1))
    with pytest.raises(GGUFError, match=r"bad\.gguf: metadata key qwen35\.ssm\.inner_size \(33\) is not a multiple"):
        load_gguf(path, progress=False)


def test_recurrent_layers_key_accepted_when_consistent(tiny):
    path = tiny["3x-value-heads"][0]
    meta = read_metadata(gguf.GGUFReader(path))
    meta["qwen35.attention.recurrent_layers"] = [True, True, True, False, False]
    shapes = {"output.weight": (256, 64)}
    assert config_from_metadata(meta, str(path), shapes) == CONFIGS["3x-value-heads"]
