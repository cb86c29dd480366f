"""Runs over models that load but cannot be trusted, and runs that cannot fit: a verdict that fails with its reason,
a refusal before allocation with the batch that would fit, clear errors for impossible synthetic shapes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from onepass.engine import memory
from onepass.engine.config import ModelConfig
from onepass.engine.engine import Engine
from onepass.engine.gguf_writer import random_weights, write_gguf
from onepass.engine.kv_cache import ContiguousKVCache
from onepass.engine.state_pool import HybridCache
from onepass.harness.app import CONF_DIR
from onepass.harness.checks import check_decode
from onepass.harness.synth import synthetic_config
from onepass.kernels.errors import ConfigError

LLAMA = ModelConfig(arch="llama", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                    vocab_size=256, name="tiny", eos_ids=(2,))
QWEN35 = ModelConfig(arch="qwen35", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                     vocab_size=256, qk_norm=True, full_attention_interval=2, rotary_dim=8, attn_output_gate=True,
                     gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=8, gdn_v_dim=8, gdn_conv_kernel=4, name="tiny-hybrid")


def test_a_run_whose_logits_overflow_records_a_failed_verdict(tmp_path):
    """Finite weights whose logits overflow float32: the loader's finiteness check passes them, the run must not."""
    w = random_weights(LLAMA, seed=1)
    w["output.weight"] = torch.full_like(w["output.weight"], 3e38)   # every logit is 3e38 x (sum of h): past fp32
    path = tmp_path / "overflow.gguf"
    write_gguf(path, LLAMA, w, weight_type="f32")
    env = {**os.environ, "ONEPASS_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "onepass.harness", "model=tiny-llama", f"model.path={path}",
                          "batch.size=2", "workload.max_new_tokens=6", "progress=false", "tracking.enabled=false",
                          f"hydra.run.dir={tmp_path}/out"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[verify] mode=greedy" in out.stdout and ": false (degenerate reference: the reference run produced " \
        "non-finite logits)" in out.stdout
    record = json.loads((tmp_path / "out" / "run_record.json").read_text())
    assert record["metrics"]["verify_ok"] == 0
    assert record["tags"]["verify_reason"] == "the reference run produced non-finite logits"


@pytest.mark.parametrize("cfg", [LLAMA, QWEN35], ids=["llama", "qwen35"])
@pytest.mark.parametrize("slots,ctx", [(1, 16), (5, 48)])
def test_the_estimate_counts_the_caches_the_engine_allocates(cfg, slots, ctx):
    real = (HybridCache.create(cfg, slots, ctx, torch.float32, "cpu") if cfg.arch == "qwen35"
            else ContiguousKVCache(cfg, slots, ctx, torch.float32, "cpu"))
    assert memory.cache_bytes(cfg, slots, ctx, torch.float32) == real.nbytes > 0


def test_the_estimate_counts_what_speculation_allocates():
    """Draft logs of k + 1 rows a slot in every GDN layer and the MTP head's own KV (engine/mtp_drafts.py), as a
    verify run reserves and binds them; and k + 1 step rows a sequence, twice over with the head's own buffers."""
    from dataclasses import replace

    from onepass.engine.mtp_drafts import _HeadCache

    cfg = replace(QWEN35, mtp_layers=1)
    slots, ctx, k = 3, 32, 3
    cache = HybridCache.create(cfg, slots, ctx, torch.float32, "cpu")
    cache.state.reserve_drafts(k + 1)
    head = _HeadCache(cfg.n_layers, slots, ctx, cfg, torch.float32, "cpu")
    assert memory.cache_bytes(cfg, slots, ctx, torch.float32, spec_k=k, mtp=True) == cache.nbytes + head.nbytes
    assert cache.nbytes > HybridCache.create(cfg, slots, ctx, torch.float32, "cpu").nbytes
    need = memory.estimate(cfg, 0, 8, ctx, torch.float32, spec_k=k, mtp=True)
    assert need.rows == 2 * 8 * (k + 1) and need.largest_batch(need.total) == 8
    assert memory.estimate(cfg, 0, 8, ctx, torch.float32, spec_k=k).rows == 8 * (k + 1)


def test_a_batch_that_cannot_fit_is_refused_before_loading(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, LLAMA, random_weights(LLAMA, seed=1), weight_type="f32")
    free = 64 * 2**20
    monkeypatch.setattr(memory, "free_bytes", lambda device: free)
    need = memory.estimate(LLAMA, LLAMA.param_count() * 4, 1, 512, torch.float32)
    fits = need.largest_batch(int(free * memory.HEADROOM))
    assert fits > 1
    with monkeypatch.context() as m:   # refused from the header, before a weight is read
        m.setattr("onepass.engine.engine.load_gguf", _must_not_load)
        with pytest.raises(ConfigError, match=rf"tiny.gguf at batch {fits + 1} needs about .* MiB free .*the largest "
                                              rf"batch that fits is {fits}: set batch.size={fits}"):
            Engine.from_gguf(path, device="cpu", batch=fits + 1, ctx=512)
    assert Engine.from_gguf(path, device="cpu", batch=fits, ctx=512).spec.batch == fits


def _must_not_load(*args, **kwargs):
    raise AssertionError("the weights were loaded before the memory check refused the batch")


def test_not_even_one_sequence_fits(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, LLAMA, random_weights(LLAMA, seed=1), weight_type="f32")
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**16)   # less than the weights alone
    with pytest.raises(ConfigError, match="not even one sequence fits"):
        Engine.from_gguf(path, device="cpu", batch=1)


def cfg_of(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("override,match", [
    ("model.synthetic.dim=-4", "dim -4 < 1"),
    ("model.synthetic.head_dim=0", "head_dim 0 < 1"),
    ("model.synthetic.n_layers=0", "n_layers 0 < 1"),
    ("model.synthetic.n_heads=3", "n_kv_heads 2 does not divide n_heads 3"),
    ("model.synthetic.norm_eps=0", "norm_eps 0.0 must be finite and > 0"),
    ("model.synthetic.rope_theta=-1", "rope_theta -1.0 must be finite and > 0"),
])
def test_impossible_synthetic_shapes_are_config_errors(override, match):
    cfg = cfg_of("model=tiny-llama", override)
    with pytest.raises(ConfigError, match=match):
        synthetic_config(cfg.model.name, cfg.model.synthetic)


def test_a_prompt_of_no_tokens_is_refused():
    with pytest.raises(ConfigError, match="workload.synthetic_prompt_len=-3; a prompt needs at least one token"):
        check_decode(cfg_of("model=tiny-llama", "workload.synthetic_prompt_len=-3"), "torch")


def test_a_synthetic_prompt_needs_ids_beyond_the_special_tokens():
    from onepass.harness.workload import prompt_ids

    w = cfg_of("model=tiny-llama").workload
    with pytest.raises(ConfigError, match="vocab_size is 2"):
        prompt_ids(w, None, 2)
    assert all(3 <= t < 5 for t in prompt_ids(w, None, 5))
