"""The engine as a library: Engine.from_gguf(...).generate(...) and .serve(...), the spec's checks, respec."""
import pytest
import torch

from onepass.engine import Engine, EngineSpec, Request, SamplingParams
from onepass.engine.gguf_loader import load_gguf
from onepass.kernels.errors import ConfigError
from tests.conftest import TINY_QWEN3


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from onepass.engine.gguf_writer import random_weights, write_gguf

    path = tmp_path_factory.mktemp("api") / "tiny-qwen3.gguf"
    write_gguf(path, TINY_QWEN3, random_weights(TINY_QWEN3, seed=3), weight_type="f32")
    return Engine.from_gguf(path, batch=4, ctx=96, device="cpu")


def test_generate_ids_equal_each_single_stream(tiny_engine):
    """Four equal prompts in one static batch give the single stream's tokens; ragged prompts (served through the
    continuous scheduler over a paged pool) give each prompt's own single-stream tokens."""
    g = torch.Generator().manual_seed(7)
    p = torch.randint(0, TINY_QWEN3.vocab_size, (3, 9), generator=g).tolist()
    single = [tiny_engine.generate([q], max_new_tokens=12, stop=False)[0] for q in p]
    assert all(len(s) == 12 for s in single)
    assert tiny_engine.generate([p[0]] * 4, max_new_tokens=12, stop=False) == [single[0]] * 4
    ragged = [p[0], p[1][:5], p[2][:7], p[1]]
    want = [tiny_engine.generate([q], max_new_tokens=12, stop=False)[0] for q in ragged]
    assert tiny_engine.generate(ragged, max_new_tokens=12, stop=False) == want


def test_serve_requests_and_the_pool(tiny_engine):
    reqs = [Request(i, [5, 6, 7, 8 + i], 6) for i in range(9)]   # more requests than slots: slots are refilled
    res = tiny_engine.serve(reqs, block_size=16)
    assert sorted(r.rid for r in res.finished) == list(range(9)) and not res.rejected
    for r in res.finished:
        assert r.output == tiny_engine.generate([r.prompt], max_new_tokens=6, stop=False)[0][:len(r.output)]
    with pytest.raises(ConfigError, match="kv_cache.prefix='cache'"):
        tiny_engine.serve(reqs, prefix="cache")


def test_text_in_text_out(smollm2_path):
    engine = Engine.from_gguf(smollm2_path, batch=2, ctx=64, device="cpu")
    texts = engine.generate(["The capital of France is"] * 2, max_new_tokens=6)
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0].strip()
    ids = engine.generate([engine.tokenizer.encode("The capital of France is")], max_new_tokens=6)[0]
    assert all(isinstance(t, int) for t in ids) and engine.tokenizer.decode(ids) == texts[0]


def test_spec_is_checked_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="unknown engine setting bach"):
        EngineSpec.of(bach=8)
    for bad, msg in [(dict(dtype="int8"), "engine.dtype='int8'"), (dict(weights="q4"), "engine.weights='q4'"),
                     (dict(batch=0), "batch.size=0"), (dict(int4="mma"), "engine.int4='mma'"),
                     (dict(state_dtype="float16"), "kv_cache.state_dtype='float16'")]:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
            Engine.from_gguf(tmp_path / "never-read.gguf", **bad)


def test_respec_keeps_the_model_and_refuses_load_settings(tiny_engine):
    model = tiny_engine.model
    same = tiny_engine.respec(EngineSpec(batch=2, ctx=96, device="cpu"))
    assert same is tiny_engine and same.model is model and same.int4.max_batch == 2
    with pytest.raises(ConfigError, match="respec cannot change ctx"):
        tiny_engine.respec(EngineSpec(batch=2, ctx=128, device="cpu"))
    tiny_engine.respec(EngineSpec(batch=4, ctx=96, device="cpu"))


def test_from_weights_without_tokenizer_refuses_text(tiny_ggufs):
    cfg, weights, _ = load_gguf(tiny_ggufs["llama"], dtype=torch.float32, device="cpu")
    engine = Engine.from_weights(cfg, weights, device="cpu", batch=1, ctx=32)
    assert len(engine.generate([[1, 2, 3]], max_new_tokens=4, sampling=SamplingParams(), stop=False)[0]) == 4
    with pytest.raises(ConfigError, match="a text prompt needs a tokenizer"):
        engine.generate(["hello"], max_new_tokens=2)
