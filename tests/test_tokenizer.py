"""engine.tokenizer vs transformers' GGUF tokenizer (the oracle), on SmolLM2 and a synthetic SentencePiece vocab."""
import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from onepass.kernels.errors import GGUFError
from onepass.engine.tokenizer import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé — déjà vu; Ångström, Straße",
    "日本語のテキスト、中文字符，한국어",
    "emoji 😀🎉 👍🏽 done",
    "def f(x):\n    if x:\n        return [x, 'y']\n\treturn None\n",
    "a    b\t\tc\n\n\nd   ",
    "trailing spaces   ",
    "12345 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "don't I'll WE'RE it's",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
]


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def smol_ref(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_matches_transformers(smol, smol_ref, text):
    ids = smol.encode(text)
    assert ids == smol_ref.encode(text, add_special_tokens=False)
    assert smol.decode(ids) == text


@pytest.mark.slow
def test_smollm2_splits_digits_before_gpt2_regex(smol, smol_ref):
    # llama.cpp's "smollm" pre splits \p{N} first and then runs the GPT-2 regex on the rest, as
    # SmolLM2's tokenizer.json does (Digits(individual) + ByteLevel): "x  1" -> "x", "  ", "1".
    # transformers' GGUF loader uses plain GPT-2 ByteLevel here and gives "x", " ", " 1" -> Ġ Ġ 1.
    assert [smol_ref.convert_ids_to_tokens(i) for i in smol.encode("x  1")] == ["x", "ĠĠ", "1"]
    assert smol.decode(smol.encode("x  1")) == "x  1"


@pytest.fixture(scope="module")
def smol_oracle(smol_ref):
    """transformers' vocab, merges and special tokens with SmolLM2's own (tokenizer.json) pre-tokenizer."""
    oracle = HFTokenizer.from_str(smol_ref.backend_tokenizer.to_str())
    oracle.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return oracle


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(list("ab Zé日😀1234.,'\n\t") + [" ", "  ", "<|im_end|>", "<|im_start|>"]),
                max_size=20).map("".join))
def test_smollm2_random_text_matches_hf_pretokenizer(smol, smol_oracle, text):
    ids = smol.encode(text)
    assert ids == smol_oracle.encode(text, add_special_tokens=False).ids
    assert smol.decode(ids) == text


@pytest.mark.slow
@pytest.mark.parametrize("messages", CHATS)
def test_smollm2_chat_template_matches_transformers(smol, smol_ref, messages):
    text = smol.apply_chat_template(messages)
    assert text == smol_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    system = messages[0]["content"] if len(messages) == 2 else None
    assert smol.encode_chat(messages[-1]["content"], system=system) == smol_ref.encode(text, add_special_tokens=False)


def test_smollm2_special_ids(smol):
    im_end = smol.encode("<|im_end|>")
    assert len(im_end) == 1
    assert {2, im_end[0], smol.encode("<|endoftext|>")[0]} <= set(smol.stop_ids)
    assert (smol.vocab_size, smol.bos_id, smol.eos_id, smol.add_bos) == (49152, 1, 2, False)
    assert smol.decode(smol.encode("<|im_start|>user\nhi<|im_end|>"), skip_special=True) == "user\nhi"
    assert smol.encode("hi", add_bos=True)[0] == 1


# --- a synthetic SentencePiece ("llama") vocabulary -------------------------------------------------

WORDS = ("hello world the quick brown fox jumps over lazy dog token izer byte fall back sentence piece "
         "model small vocab with score").split()


def _spm_vocab() -> list[str]:
    pieces = list("▁abcdefghijklmnopqrstuvwxyz.,!?")
    for word in ("▁" + w for w in WORDS):  # every substring, so each piece has a split into two pieces
        for n in range(2, len(word) + 1):
            pieces += [word[i:i + n] for i in range(len(word) - n + 1) if word[i:i + n] not in pieces]
    return ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces


def _write_spm_gguf(path, add_space_prefix=None, chat_template=None):
    tokens = _spm_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    # the minimal llama.* keys transformers wants before it will read the tokenizer
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])  # distinct: no ties
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def _write_spm_gguf_at(tmp_path, **kw):
    path = tmp_path / "variant.gguf"
    _write_spm_gguf(path, **kw)
    return path


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return path, _write_spm_gguf(path), Tokenizer.from_gguf(path)


# No leading space and no text right after a special token: there llama.cpp and transformers differ
# (see test_spm_follows_llama_cpp_space_prefix).
SPM_TEXTS = ["hello world", "the quick brown fox", "thequickbrown", "double  space", "a\nb\tc",
             "Hello World!", "tokenizer byte fallback é 日本 😀", "trailing ", "hello</s>"]


@pytest.mark.slow
def test_spm_matches_transformers(spm):
    from transformers import AutoTokenizer

    path, tokens, tok = spm
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == ref.decode(ids) == text
    assert tok.encode("hello") == ref.encode("hello") == [1, tokens.index("▁hello")]


def test_spm_byte_fallback_and_ids(spm):
    _, tokens, tok = spm
    assert [tokens[i] for i in tok.encode("é", add_bos=False)] == ["▁", "<0xC3>", "<0xA9>"]
    assert [tokens[i] for i in tok.encode("Hello", add_bos=False)] == ["▁", "<0x48>", "ello"]
    assert (tok.bos_id, tok.eos_id, tok.stop_ids, tok.add_bos) == (1, 2, (2,), True)
    assert tok.decode(tok.encode("hello world"), skip_special=True) == "hello world"


def test_spm_follows_llama_cpp_space_prefix(spm, tmp_path):
    # llama.cpp prepends "▁" to every text run, including one that starts with a space or follows a
    # special token; transformers' GGUF loader (Metaspace prepend_scheme="first") does neither.
    _, tokens, tok = spm
    piece = tokens.index
    assert tok.encode(" hello", add_bos=False) == [piece("▁"), piece("▁hello")]
    assert tok.encode("<s>hello", add_bos=False) == [1, piece("▁hello")]
    no_prefix = Tokenizer.from_gguf(_write_spm_gguf_at(tmp_path, add_space_prefix=False))
    assert no_prefix.encode("hello world", add_bos=False) == [piece("hello"), piece("▁world")]
    assert no_prefix.decode([piece("hello"), piece("▁world")]) == "hello world"


def test_chat_template_helpers(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
                "{{ raise_exception('no tools') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = Tokenizer.from_gguf(_write_spm_gguf_at(tmp_path, chat_template=template))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user] hi\n[assistant]"
    # the rendered text already starts with "<s>", so no second BOS
    assert tok.encode_chat("hi").count(1) == 1
    with pytest.raises(ValueError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_chat_template(spm):
    with pytest.raises(GGUFError, match="chat_template"):
        spm[2].apply_chat_template([{"role": "user", "content": "hi"}])


# --- byte-level pre-tokenizers on a toy vocabulary, and bad metadata ------------------------------

def _byte_level_meta(pre: str) -> dict:
    alphabet = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    merges = ["1 2", "12 3", "4 5", "h i", "Ġ hi"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": alphabet + ["12", "123", "45", "hi", "Ġhi", "<|eot_id|>"],
            "tokenizer.ggml.token_type": [1] * (len(alphabet) + 5) + [3],
            "tokenizer.ggml.merges": merges}


@pytest.mark.parametrize("pre, digits", [("gpt-2", ["123", "45"]), ("llama-bpe", ["123", "45"]),
                                         ("qwen2", list("12345")), ("smollm", list("12345"))])
def test_byte_level_pre_tokenizers(pre, digits):
    tok = Tokenizer.from_metadata(_byte_level_meta(pre))
    ids = tok.encode("hi 12345 hi<|eot_id|>")
    text = [tok.decode([i]) for i in ids]
    assert text == ["hi", " "] + digits + [" hi", "<|eot_id|>"]
    assert tok.stop_ids == (ids[-1],) and tok.vocab_size == ids[-1] + 1
    assert tok.add_bos == (pre == "llama-bpe")  # llama.cpp defaults BOS on for the llama3 family


def test_bad_metadata():
    assert Tokenizer.from_metadata({"general.architecture": "llama"}) is None
    with pytest.raises(GGUFError, match="'rwkv'"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}, "m.gguf")
    with pytest.raises(GGUFError, match="'made-up-pre'.*smollm"):
        Tokenizer.from_metadata(_byte_level_meta("made-up-pre"), "m.gguf")
    spm_meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(GGUFError, match="scores"):
        Tokenizer.from_metadata(spm_meta, "m.gguf")
