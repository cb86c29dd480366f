"""Text <-> token ids from a GGUF's tokenizer metadata, built on HuggingFace `tokenizers`.

Two llama.cpp vocabulary kinds are supported: "gpt2" (byte-level BPE with merges; the split
regex is picked by `tokenizer.ggml.pre`) and "llama" (SentencePiece pieces with scores and
<0xNN> byte fallback). Chat templates are rendered with sandboxed jinja2.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property
from typing import Any, Callable, Iterable

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from onepass.kernels.errors import ConfigError, GGUFError
from onepass.engine.gguf_meta import open_reader, read_metadata

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # llama.cpp token types
_STOP_NAMES = frozenset({"<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>"})

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's built-in regex is exactly GPT-2's.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm"/"starcoder" split every digit off first, then apply the GPT-2 regex
    # (the same as these models' own tokenizer.json: Digits(individual) + ByteLevel).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _regex_split(regex: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    return lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> pre-tokenizer factory (names as llama.cpp writes them)
_PRE: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2_split,
    "gpt-2": _gpt2_split,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "llama-bpe": _regex_split(_LLAMA3_SPLIT),
    "llama3": _regex_split(_LLAMA3_SPLIT),
    "llama-v3": _regex_split(_LLAMA3_SPLIT),
    "smaug-bpe": _regex_split(_LLAMA3_SPLIT),
    "dbrx": _regex_split(_LLAMA3_SPLIT),
    "qwen2": _regex_split(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _regex_split(_QWEN2_SPLIT),
}
# llama.cpp takes a whole pre-token that is in the vocab without merging, and adds BOS by default.
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3"})


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], source: str) -> tuple[_Backend, bool]:
    """(backend, default add_bos) for tokenizer.ggml.model == "gpt2"."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        raise GGUFError(f"{source}: tokenizer.ggml.pre = {pre!r} is not supported; supported: {sorted(_PRE)}")
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(f"{source}: tokenizer.ggml.model is 'gpt2' but tokenizer.ggml.merges is missing; "
                        "a byte-level BPE vocabulary needs its merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = _Backend(BPE(vocab, pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE))
    backend.pre_tokenizer = _PRE[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend, pre in _LLAMA3_PRE


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], source: str) -> tuple[_Backend, bool]:
    """(backend, default add_bos) for tokenizer.ggml.model == "llama"."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        found = "missing" if scores is None else f"{len(scores)} scores"
        raise GGUFError(f"{source}: tokenizer.ggml.scores is {found}; a 'llama' (SentencePiece) vocabulary "
                        f"needs one score per token ({len(tokens)})")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    score = dict(zip(tokens, scores))
    # SentencePiece merges the adjacent pair whose joined piece scores highest; as BPE merges
    # that is every (left, right) split of a piece, ranked by the piece's score.
    ranked = [(score[piece], len(piece[:k]), len(piece[k:]), piece[:k], piece[k:])
              for piece in vocab for k in range(1, len(piece))
              if piece[:k] in vocab and piece[k:] in vocab]
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)  # stable: ties keep vocab order
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = _Backend(BPE(vocab, [(r[3], r[4]) for r in ranked], unk_token=unk, fuse_unk=True, byte_fallback=True))
    # Spaces become "▁"; add_space_prefix prepends one to each text run (as llama.cpp does).
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    undo = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(undo + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return backend, True


_MODELS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _token_id(meta: dict[str, Any], key: str, n: int, source: str) -> int | None:
    value = meta.get(key)
    if value is not None and not (isinstance(value, int) and 0 <= value < n):
        raise GGUFError(f"{source}: {key} = {value!r} is not a token id of this {n}-token vocabulary")
    return value


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes <, >, & and '; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ConfigError(f"chat template rejected the messages: {message}")


class Tokenizer:
    """A GGUF's tokenizer: encode/decode, special ids and its chat template."""

    def __init__(self, backend: _Backend, *, vocab_size: int, bos_id: int | None, eos_id: int | None,
                 stop_ids: tuple[int, ...], add_bos: bool, chat_template: str | None,
                 bos_text: str | None, eos_text: str | None, source: str) -> None:
        self._backend = backend
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._bos_text = bos_text
        self._eos_text = eos_text
        self._source = source

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer | None:
        return cls.from_metadata(read_metadata(open_reader(path)), source=os.fspath(path))

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], source: str = "<gguf>") -> Tokenizer | None:
        model, tokens = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.tokens")
        if model is None or not tokens:
            return None
        if model not in _MODELS:
            raise GGUFError(f"{source}: tokenizer.ggml.model = {model!r} is not supported; "
                            f"supported: {sorted(_MODELS)}")
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type") or [1] * n
        if len(types) != n:
            raise GGUFError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        backend, default_bos = _MODELS[model](meta, tokens, source)
        # Control/unknown tokens are special (skippable in decode); user-defined ones are plain added
        # tokens. Both match whole in raw text, before any normalizer or split.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty in (_UNKNOWN, _CONTROL)])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

        bos_id = _token_id(meta, "tokenizer.ggml.bos_token_id", n, source)
        eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", n, source)
        stops = [eos_id] + [_token_id(meta, f"tokenizer.ggml.{k}_token_id", n, source) for k in ("eot", "eom")]
        stops += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL and t in _STOP_NAMES]
        return cls(
            backend,
            vocab_size=n,
            bos_id=bos_id,
            eos_id=eos_id,
            stop_ids=tuple(dict.fromkeys(i for i in stops if i is not None)),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
            chat_template=meta.get("tokenizer.chat_template"),
            bos_text=None if bos_id is None else tokens[bos_id],
            eos_text=None if eos_id is None else tokens[eos_id],
            source=source,
        )

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise GGUFError(f"{self._source}: no tokenizer.chat_template in this GGUF; "
                            "give a raw prompt instead of chat messages")
        # Same environment settings as HF transformers, so templates render identically.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise GGUFError(f"{self._source}: tokenizer.chat_template does not parse as jinja2 "
                            f"(line {e.lineno}: {e.message})") from e

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self._bos_text or "", eos_token=self._eos_text or "")

    def encode_chat(self, user_text: str, system: str | None = None) -> list[int]:
        messages = [{"role": "system", "content": system}] if system is not None else []
        text = self.apply_chat_template(messages + [{"role": "user", "content": user_text}])
        # Templates that write the BOS text themselves must not get a second BOS id.
        has_bos = self._bos_text is not None and text.startswith(self._bos_text)
        return self.encode(text, add_bos=False if has_bos else None)
