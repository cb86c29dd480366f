"""Untrusted GGUF headers, chat templates and vocabularies (issue 65: unbounded work, tracebacks): every hostile
input ends in a GGUFError that names it, in bounded time and memory, and real inputs still give what they gave."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import datetime

import gguf
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from onepass.engine.config import ModelConfig
from onepass.engine.gguf_loader import load_gguf, read_config
from onepass.engine import gguf_meta
from onepass.engine.gguf_meta import check_header, open_reader, read_metadata
from onepass.engine.gguf_writer import random_weights, write_gguf
from onepass.engine.tokenizer import Tokenizer, spm_merges
from onepass.kernels.errors import ConfigError, GGUFError
from tests.test_untrusted_gguf import mutant

# seconds: every refusal below is milliseconds of work (a recursion to the limit about 0.3 s); the unbounded versions
# took seconds to hours. Room for a loaded 2-core CI machine, where the recursion took 1.05 s under a third worker
FAST = 3.0

LLAMA = ModelConfig(arch="llama", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                    vocab_size=128, name="tiny", eos_ids=(2,))
QWEN3 = ModelConfig(arch="qwen3", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                    vocab_size=128, name="tiny3", qk_norm=True, eos_ids=(2,))
QWEN35 = ModelConfig(arch="qwen35", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
                     vocab_size=128, norm_eps=1e-6, rope_theta=1e7, context_length=256, qk_norm=True, rotary_dim=8,
                     rope_sections=(2, 1, 1, 0), attn_output_gate=True, gdn_conv_kernel=4, bos_id=1, eos_ids=(2,),
                     name="tiny35", full_attention_interval=2, gdn_k_heads=2, gdn_v_heads=2, gdn_k_dim=16,
                     gdn_v_dim=16, tie_embeddings=True)
# a byte-level vocabulary of 128 tokens, so the tokenizer builds from the file too
_CHARS = [chr(c) for c in range(33, 127)]
TOKENIZER = {
    "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
    "tokenizer.ggml.tokens": _CHARS + ["ab", "abc"] + [f"<pad{i}>" for i in range(128 - len(_CHARS) - 2)],
    "tokenizer.ggml.token_type": [1] * (len(_CHARS) + 2) + [3] * (128 - len(_CHARS) - 2),
    "tokenizer.ggml.merges": ["a b", "ab c"],
}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = tmp_path_factory.mktemp("header")
    out = {}
    for cfg in (LLAMA, QWEN3, QWEN35):
        out[cfg.arch] = d / f"{cfg.arch}.gguf"
        write_gguf(out[cfg.arch], cfg, random_weights(cfg, seed=3), weight_type="f32",
                   tokenizer_meta=TOKENIZER if cfg.arch == "llama" else None)
    return out


def parts(reader, key):
    """A key's parts: [key length, key bytes, value type, ...]; an array goes on [element type, count, ...], each
    string element as [length, bytes]."""
    return reader.fields[key].parts


def value(reader, key):
    return parts(reader, key)[reader.fields[key].data[0]]


def refused(call, *args, match: str) -> GGUFError:
    """call(*args) raises a GGUFError matching `match`, within FAST seconds."""
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match=match) as e:
        call(*args)
    assert time.perf_counter() - t0 < FAST
    return e.value


def test_the_clean_files_load(clean):
    for arch, path in clean.items():
        check_header(str(path))
        assert read_config(path).arch == arch
    assert Tokenizer.from_gguf(clean["llama"]).encode("abc") == [len(_CHARS) + 1]


# ---------------------------------------------------------------- the header walk, before gguf-py reads it
# The walk is called directly: it is bounded by construction, where gguf-py on these files reads for minutes (or, when
# its reads past the end come back empty, forever); test_both_entry_points_walk_the_header_first ties it to the loaders.

_CHILD_PRELUDE = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
t0 = time.perf_counter()
def report(run):
    try:
        run()
        out = ["finished", ""]
    except Exception as e:
        out = [type(e).__name__, str(e)]
    print(json.dumps(out + [time.perf_counter() - t0]))
"""


def in_child(code: str, *args: str) -> tuple[str, str, float]:
    """Run code (after _CHILD_PRELUDE; it calls report(fn)) in a child process with 4 GB of address space and 30 s:
    (exception type or 'finished', message, seconds). The unbounded versions hang or take GBs, and must not take
    the test run with them."""
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD_PRELUDE + code, *args], capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("did not stop within 30 s")
    assert run.returncode == 0, run.stderr[-2000:]
    kind, message, seconds = json.loads(run.stdout.strip().splitlines()[-1])
    return kind, message, seconds


@pytest.mark.parametrize("arch,key,count", [
    ("llama", "tokenizer.ggml.token_type", 2**33),
    ("qwen35", "qwen35.rope.dimension_sections", 10**12),
])
def test_inflated_array_count_is_refused_before_it_is_read(clean, tmp_path, arch, key, count):
    def edit(r):
        parts(r, key)[4][0] = count
    path = mutant(clean[arch], tmp_path, edit)
    err = refused(check_header, path, match=re.escape(f"metadata key {key} claims {count} INT32 elements"))
    assert path in str(err) and "bytes are left in the file" in str(err)


def test_the_issue_file_fails_fast_where_the_engine_opens_it(clean, tmp_path):
    """The issue's file (token_type count 2**33: killed at 150 s), opened by the tokenizer as the engine opens it."""
    def edit(r):
        parts(r, "tokenizer.ggml.token_type")[4][0] = 2**33
    path = mutant(clean["llama"], tmp_path, edit)
    kind, message, seconds = in_child("from onepass.engine.tokenizer import Tokenizer\nt0 = time.perf_counter()\n"
                                      "report(lambda: Tokenizer.from_gguf(sys.argv[1]))", path)
    assert (kind, seconds < FAST) == ("GGUFError", True), message
    assert "metadata key tokenizer.ggml.token_type claims 8589934592 INT32 elements" in message


def test_both_entry_points_walk_the_header_first(clean, monkeypatch):
    class Walked(Exception):
        pass

    def walk(path):
        raise Walked(path)
    monkeypatch.setattr(gguf_meta, "check_header", walk)
    for load in (read_config, load_gguf, Tokenizer.from_gguf):
        with pytest.raises(Walked):
            load(clean["llama"])


def test_inflated_string_length(clean, tmp_path):
    def edit(r):
        parts(r, "general.name")[3][0] = 2**40
    refused(check_header, mutant(clean["llama"], tmp_path, edit),
            match=r"metadata key general\.name \(a string of 1099511627776 bytes\) needs 1099511627776 bytes")


def test_inflated_vocabulary_string(clean, tmp_path):
    def edit(r):
        parts(r, "tokenizer.ggml.tokens")[5 + 2 * 7][0] = 2**40   # token 7's length
    refused(check_header, mutant(clean["llama"], tmp_path, edit),
            match=r"tokenizer\.ggml\.tokens\[7\], a string, runs past the end of the file")


@pytest.mark.parametrize("field", ["GGUF.kv_count", "GGUF.tensor_count"])
def test_inflated_key_or_tensor_count(clean, tmp_path, field):
    def edit(r):
        value(r, field)[0] = 2**60
    refused(check_header, mutant(clean["llama"], tmp_path, edit), match=r"claims \d+ metadata keys and \d+ tensors")


def test_too_many_dimensions(clean, tmp_path):
    def edit(r):
        r.tensors[0].field.parts[2][0] = 5          # n_dims
    refused(check_header, mutant(clean["llama"], tmp_path, edit),
            match=r"tensor token_embd\.weight claims 5 dimensions; GGUF allows at most 4")


def test_nested_arrays_are_walked(tmp_path):
    path = tmp_path / "nested.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("test.nested", [[1, 2], [3, 4, 5]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    check_header(str(path))                          # a well-formed nested array passes

    def edit(r):
        parts(r, "test.nested")[6][0] = 2**40        # the first inner array's count
    refused(check_header, mutant(path, tmp_path, edit),
            match=r"metadata key test\.nested\[0\] claims 1099511627776 INT32 elements")


def test_text_that_is_not_utf8(clean, tmp_path):
    def key_name(r):
        parts(r, "general.name")[1][0] = 0xFF
    refused(check_header, mutant(clean["llama"], tmp_path, key_name), match=r"metadata key #\d+'s name .* is not UTF-8")

    def name_value(r):
        parts(r, "general.name")[4][0] = 0xFF
    refused(read_config, mutant(clean["llama"], tmp_path, name_value),
            match=r"metadata key general\.name holds a string that is not UTF-8")


def test_real_header_walk_is_fast(smollm2_path):
    t0 = time.perf_counter()
    check_header(str(smollm2_path))                  # 49k tokens and 48k merges: about 15 ms
    assert time.perf_counter() - t0 < 0.5


# ---------------------------------------------------------------- hyperparameters sized before anything uses them


@pytest.mark.parametrize("arch,layers", [("llama", 2), ("qwen35", 4)])
def test_block_count_beyond_the_layers_present(clean, tmp_path, arch, layers):
    """block_count 2**31 used to size per-layer tables (4.6 GB and growing) before a missing tensor was noticed."""
    def edit(r):
        value(r, f"{arch}.block_count")[0] = 2**31
    path = mutant(clean[arch], tmp_path, edit)
    match = re.escape(f"{arch}.block_count is {2**31}, but the file holds tensors for {layers} layers")
    refused(read_config, path, match=match)
    refused(load_gguf, path, match=match)


def test_a_stray_high_layer_does_not_vouch_for_block_count(tmp_path):
    weights = random_weights(LLAMA, seed=3)
    weights["blk.2147483647.attn_norm.weight"] = weights["blk.1.attn_norm.weight"]
    path = tmp_path / "stray.gguf"
    write_gguf(path, LLAMA, weights, weight_type="f32")

    def edit(r):
        value(r, "llama.block_count")[0] = 2**31
    refused(read_config, mutant(path, tmp_path, edit),
            match=re.escape(f"llama.block_count is {2**31}, but the file holds tensors for 3 layers (blk.0 to "
                            "blk.2147483647)"))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen35"])
def test_head_count_zero(clean, tmp_path, arch):
    """Once a ZeroDivisionError in the loader."""
    def edit(r):
        value(r, f"{arch}.attention.head_count")[0] = 0
    refused(read_config, mutant(clean[arch], tmp_path, edit), match=rf"{arch}\.attention\.head_count is 0")


# ---------------------------------------------------------------- chat templates: bounded, refusals named

def _meta(template: str) -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.chat_template": template}


@pytest.mark.parametrize("template,match", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "within 0.3 s"),
    ("{% set xs = range(100000)|list %}{% for a in xs %}{% for b in xs %}{% endfor %}{% endfor %}", "within 0.3 s"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}", "within 0.3 s"),
    ("{{ 'x' * 2**33 }}", "8589934592 characters or items in \\*"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "in ~"),
    ("{{ ('a' * 1000000).replace('', 'b' * 1000) }}", "in str.replace"),
    ("{{ '{:>999999999}'.format(1) }}", "in str.format"),
    ("{{ 'x'|center(2**33) }}", "passes 8589934592 to filter center"),
    ("{{ 2 ** (2 ** 40) }}", "an integer of about 1099511627776 bits"),
    ("{% for a in range(100000) %}{% for b in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
     "in the rendered text|within 0.3 s"),
    ("{{ lipsum(1000000) }}", "'lipsum' is undefined"),   # a million paragraphs in one call: no longer offered
], ids=["nested-range", "nested-list", "macro-2^60", "mul-2^33", "concat-doubling", "replace", "format-width",
        "center", "pow", "output", "lipsum"])
def test_template_bombs_are_bounded(template, match):
    kind, message, seconds = in_child(
        "from onepass.engine import tokenizer\n"
        "tokenizer._RENDER_SECONDS = 0.3\n"
        "tok = tokenizer.Tokenizer.from_metadata(json.loads(sys.argv[1]), 'hostile.gguf')\n"
        "t0 = time.perf_counter()\n"
        "report(lambda: tok.apply_chat_template([{'role': 'user', 'content': 'hi'}]))", json.dumps(_meta(template)))
    assert kind == "GGUFError", message
    assert message.startswith("hostile.gguf: tokenizer.chat_template ") and re.search(match, message), message
    assert seconds < FAST


@pytest.mark.parametrize("template,match", [
    ("{{ ''.__class__.__mro__ }}", r"forbids \(access to attribute '__class__' of 'str' object is unsafe"),
    ("{{ nothing.here }}", r"uses something that is not defined \('nothing' is undefined\)"),
    ("{% for %}", r"does not parse as jinja2 \(line 1"),
    ("{{ 1 + 'a' }}", r"failed \(TypeError: unsupported operand"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", r"failed \(RecursionError"),
])
def test_template_refusals_are_gguf_errors(template, match):
    tok = Tokenizer.from_metadata(_meta(template), "t.gguf")
    err = refused(tok.apply_chat_template, [{"role": "user", "content": "hi"}], match=match)
    assert str(err).startswith("t.gguf: tokenizer.chat_template ") and "give a raw prompt" in str(err)


def test_large_integers_as_data_still_render():
    """Only integers that size something are capped: a sentinel, a default or a printed number is data."""
    template = ("{% set ns = namespace(best=999999999) %}{{ ns.best }} {{ nothing|default(10**12) }} "
                "{{ '%d' % 10**12 }} {{ '{}'.format(-(10**12)) }} {{ 'x'.find('x', 0, 10**10) }}")
    tok = Tokenizer.from_metadata(_meta(template), "t.gguf")
    assert tok.apply_chat_template([]) == "999999999 1000000000000 1000000000000 -1000000000000 0"


def test_raise_exception_stays_a_config_error():
    tok = Tokenizer.from_metadata(_meta("{{ raise_exception('no tools here') }}"), "t.gguf")
    with pytest.raises(ConfigError, match="no tools here"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# written for this test in the shape of Qwen3's template (reverse scan with a namespace, <think> splitting, tool calls
# as JSON, grouped tool responses), plus the operators, filters and loop forms the bounds wrap
QWEN3_STYLE = r"""
{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- else -%}{%- for p in c if p.type == 'text' -%}{{ p.text }}
{%- endfor -%}{%- endif -%}{%- endmacro -%}
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' ~ text(messages[0].content) ~ '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=messages|length - 1, searching=true) %}
{%- for m in messages[::-1] %}
    {%- set i = (messages|length - 1) - loop.index0 %}
    {%- if ns.searching and m.role == 'user' and not text(m.content).startswith('<tool_response>') %}
        {%- set ns.searching = false %}{%- set ns.last_user = i %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- set content = text(m.content) %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user and reasoning %}
            {{- '<|im_start|>assistant\n<think>\n' ~ reasoning|trim ~ '\n</think>\n\n' ~ content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' ~ content }}
        {%- endif %}
        {%- for call in m.tool_calls or [] %}
            {{- '\n<tool_call>\n{"name": "%s", "arguments": '|format(call.name) ~ call.arguments|tojson ~ '}' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' ~ content|replace('\r\n', '\n') ~ '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- set roles %}{{ messages|map(attribute='role')|join(', ') }}{% endset %}
{{- '<!-- %s; %-9s| %d -->' % (roles, messages[0].role, (messages|length) ** 2) }}
{{- '{}/{}'.format(messages|length, [1, 2] + [3]) ~ ('ab' * 3)|center(12) ~ (content|default('x'))|indent(2) }}
{%- for x in [[1, [2]], 3] recursive %}{{ x if x is number else loop(x) }}{{ loop.cycle('.', ':') }}{% endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\na1"}, {"role": "user", "content": "q2"},
     {"role": "assistant", "content": "<think>plan</think>calling",
      "tool_calls": [{"name": "f", "arguments": {"x": 1, "y": ["é", None]}}]},
     {"role": "tool", "content": "r1\r\nr2"}, {"role": "tool", "content": "r3"},
     {"role": "assistant", "content": "<think>\nlast\n</think>done"}],
]


def _unbounded_render(template: str, messages: list[dict], bos: str, eos: str) -> str:
    """The renderer before the bounds: jinja2's immutable sandbox with HF transformers' settings."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token=bos,
                                            eos_token=eos)


@pytest.fixture(scope="module")
def smol_meta(smollm2_path):
    return read_metadata(open_reader(smollm2_path))


@pytest.mark.parametrize("messages", CHATS, ids=["user", "system-parts", "tools-and-thinking"])
def test_qwen3_style_template_renders_as_before(messages):
    tok = Tokenizer.from_metadata({**_meta(QWEN3_STYLE), "tokenizer.ggml.bos_token_id": 0}, "q.gguf")
    assert tok.apply_chat_template(messages) == _unbounded_render(QWEN3_STYLE, messages, "a", "")
    if len(messages) > 2:
        assert '<tool_call>\n{"name": "f", "arguments": {"x": 1' in tok.apply_chat_template(messages)


@pytest.mark.slow
def test_smollm2_template_renders_as_before(smol_meta):
    tok = Tokenizer.from_metadata(smol_meta, "smollm2.gguf")
    for messages in CHATS[:1] + CHATS[2:]:   # its template takes string contents only
        assert tok.apply_chat_template(messages) == _unbounded_render(tok.chat_template, messages, "<|im_start|>",
                                                                      "<|im_end|>")


# ---------------------------------------------------------------- vocabularies


def _spm_meta(tokens: list[str], scores: list[float] | None = None) -> dict:
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores if scores is not None else [0.0] * len(tokens)}


def _every_split(vocab: dict[str, int], score: dict[str, float]) -> list[tuple[str, str]]:
    """The definition, quadratic in a piece's length: every split of every piece into two pieces."""
    ranked = [(score[p], k, len(p) - k, p[:k], p[k:]) for p in vocab for k in range(1, len(p))
              if p[:k] in vocab and p[k:] in vocab]
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)
    return [(r[3], r[4]) for r in ranked]


def test_long_piece_builds_in_linear_time():
    """Pieces (ab)^1, (ab)^2, (ab)^4, ..., (ab)^65536: the old build sliced every piece at every point, 8 s here for
    a longest piece of 131k characters (37 s for one of 300k)."""
    pieces = ["ab" * 2**k for k in range(17)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["a", "b"] + pieces
    t0 = time.perf_counter()
    tok = Tokenizer.from_metadata({**_spm_meta(tokens), "tokenizer.ggml.add_space_prefix": False}, "long.gguf")
    assert time.perf_counter() - t0 < FAST
    assert tok.encode(pieces[-1] + pieces[3], add_bos=False) == [len(tokens) - 1, tokens.index(pieces[3])]


def _same_merges(tokens: list[str], scores: list[float]) -> None:
    vocab, score = {t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores))
    assert spm_merges(vocab, score, "v.gguf") == _every_split(vocab, score)


def test_merges_are_the_every_split_definition():
    """Same pairs, same order: tied scores, a duplicate piece (its last score counts) and an empty piece."""
    toy = ["", "a", "b", "ab", "ba", "aba", "bab", "abab", "a", "▁", "▁a", "▁ab", "▁aba", "b▁", "ab▁", "b▁a"]
    _same_merges(toy, [0.0, -1.0, -1.0, -2.0, -2.0, -3.0, -3.0, -3.0, -9.0, -1.0, -2.0, -2.0, -4.0, -2.0, -3.0, -3.0])


@pytest.mark.slow
def test_merges_are_the_every_split_definition_on_a_real_vocabulary(smol_meta):
    """SmolLM2's 49k tokens taken as SentencePiece pieces, with scores that tie often."""
    tokens = smol_meta["tokenizer.ggml.tokens"]
    _same_merges(tokens, [-float(i % 97) for i in range(len(tokens))])


def test_merge_blowup_is_refused():
    """Pieces a, aa, ..., a^1000: 0.5M characters whose splits make 0.33G characters of merge pairs."""
    tokens = ["a" * n for n in range(1, 1001)]
    refused(Tokenizer.from_metadata, _spm_meta(tokens), "blowup.gguf",
            match=r"blowup\.gguf: the vocabulary's pieces split into more than 64x its own 500500 characters")


def test_unusable_merge_is_a_gguf_error():
    """`tokenizers` panics on a merge whose join is not a token (a PanicException, not even an Exception)."""
    meta = {**_meta("x"), "tokenizer.ggml.tokens": ["a", "b"]}
    refused(Tokenizer.from_metadata, meta, "m.gguf", match=r"tokenizer\.ggml\.merges\[0\] = 'a b' is not two tokens")


@pytest.mark.parametrize("key,bad", [("tokenizer.ggml.tokens", [1, 2, 3]), ("tokenizer.ggml.model", ["gpt2"]),
                                     ("tokenizer.ggml.token_type", ["1", "1", "1"])])
def test_tokenizer_key_of_the_wrong_type(key, bad):
    refused(Tokenizer.from_metadata, {**_meta("x"), key: bad}, "w.gguf", match=rf"metadata key {re.escape(key)} is not")
