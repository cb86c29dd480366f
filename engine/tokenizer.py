"""Text <-> token ids from a GGUF's tokenizer metadata, built on HuggingFace `tokenizers`.

Two llama.cpp vocabulary kinds are supported: "gpt2" (byte-level BPE with merges; the split
regex is picked by `tokenizer.ggml.pre`) and "llama" (SentencePiece pieces with scores and
<0xNN> byte fallback). Chat templates are rendered with sandboxed jinja2, bounded in time and size
(_BoundedSandbox): the template comes from the file, and a file is untrusted input.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import threading
import time
from datetime import datetime
from functools import cached_property
from typing import Any, Callable, Iterable

import jinja2
from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer
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
    for i, pair in enumerate(pairs):   # `tokenizers` panics (no Python exception) on a merge it cannot use
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            raise GGUFError(f"{source}: tokenizer.ggml.merges[{i}] = {merges[i][:80]!r} is not two tokens of the "
                            "vocabulary, separated by one space, whose join is a token too; the tokenizer data is "
                            "damaged: use an intact file")
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
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    merges = spm_merges(vocab, dict(zip(tokens, scores)), source)
    backend = _Backend(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # Spaces become "▁"; add_space_prefix prepends one to each text run (as llama.cpp does).
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    undo = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(undo + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return backend, True


def _proper_prefixes(words: Iterable[str]) -> dict[str, list[str]]:
    """Each word -> the words of the set that are proper prefixes of it, shortest first. One pass in sorted order: the
    words starting with w follow w without a gap, so a stack holds exactly the current word's prefixes. Linear in the
    text: each word is pushed and popped once, and a word has at most one prefix per length below its own."""
    out: dict[str, list[str]] = {}
    stack: list[str] = []
    for w in sorted(words):
        while stack and not w.startswith(stack[-1]):
            stack.pop()
        out[w] = stack.copy()
        stack.append(w)
    return out


# merge pairs' text over the vocabulary's text: about 2 for real vocabularies (2.3 for SmolLM2's pieces); a
# vocabulary built so that every piece splits at every point reaches its longest piece's length
_MERGE_TEXT_RATIO = 64


def spm_merges(vocab: dict[str, int], score: dict[str, float], source: str) -> list[tuple[str, str]]:
    """SentencePiece merges the adjacent pair whose joined piece scores highest; as BPE merges that is every
    (left, right) split of a piece into two pieces, ranked by the piece's score, then by the left part's length, ties
    in vocabulary order. The splits come from the pieces' prefixes and suffixes that are pieces (_proper_prefixes, on
    the words and on the reversed words), not from slicing a piece at every point (quadratic in its length)."""
    prefixes = _proper_prefixes(vocab)
    suffixes = _proper_prefixes([w[::-1] for w in vocab])
    text = sum(map(len, vocab))
    budget = _MERGE_TEXT_RATIO * text + (1 << 20)
    ranked = []
    for piece in vocab:
        n = len(piece)
        ends = {len(s) for s in suffixes[piece[::-1]]}
        for left in prefixes[piece]:
            k = len(left)
            if k and n - k in ends:
                ranked.append((score[piece], k, n - k, left, piece[k:]))
                budget -= n
        if budget < 0:
            raise GGUFError(f"{source}: the vocabulary's pieces split into more than {_MERGE_TEXT_RATIO}x its own "
                            f"{text} characters of merge pairs (at {piece[:40]!r}, {n} characters); real "
                            "vocabularies need about 2x: the tokenizer data is damaged or hostile: use an intact file")
    ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)  # stable: ties keep vocab order
    return [(r[3], r[4]) for r in ranked]


_MODELS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
_TEMPLATE_FIX = "give a raw prompt instead of chat messages (workload.chat=false), or use a file whose template works"


# the tokenizer keys read here, with the types llama.cpp writes: (type, is an array, in words)
_KINDS: dict[str, tuple[Any, bool, str]] = {
    "tokenizer.ggml.model": (str, False, "a string"), "tokenizer.ggml.pre": (str, False, "a string"),
    "tokenizer.chat_template": (str, False, "a string"), "tokenizer.ggml.tokens": (str, True, "an array of strings"),
    "tokenizer.ggml.merges": (str, True, "an array of strings"),
    "tokenizer.ggml.token_type": (int, True, "an array of integers"),
    "tokenizer.ggml.scores": ((int, float), True, "an array of numbers"),
}


def _check_kinds(meta: dict[str, Any], source: str) -> None:
    """A damaged file's key of the wrong type would surface as a TypeError deep inside `tokenizers` or a dict lookup."""
    for key, (kind, array, words) in _KINDS.items():
        value = meta.get(key)
        if value is None:
            continue
        if array:
            ok = isinstance(value, list) and all(isinstance(x, kind) and not isinstance(x, bool) for x in value)
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise GGUFError(f"{source}: metadata key {key} is not {words}; the tokenizer data is damaged: use an "
                            "intact file")


def _token_id(meta: dict[str, Any], key: str, n: int, source: str) -> int | None:
    value = meta.get(key)
    if value is not None and not (isinstance(value, int) and 0 <= value < n):
        raise GGUFError(f"{source}: {key} = {value!r} is not a token id of this {n}-token vocabulary")
    return value


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes <, >, & and '; chat templates expect plain JSON. With an indent, every nested
    # item gets a line of `indent` spaces per level.
    _check_size("tojson", _text_size(value) * (1 + (indent if isinstance(indent, int) and indent > 0 else 0)))
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ConfigError(f"chat template rejected the messages: {message}")


# A chat template comes from the file, so its rendering is bounded. Real templates render in about a millisecond
# into text the size of the messages; the bounds leave room for a prompt of millions of characters.
_RENDER_SECONDS = 2.0
_RENDER_SIZE = 1 << 23        # characters of a string, items of a list, characters of the whole output
_INT_BITS = 1 << 16           # integers a template computes with are small; a 2**2**40 is an attack
# a printf / format width or precision of 8 digits: text of at least 10**7 characters from one field
_WIDE_FIELD = re.compile(r"%[-+ #0]*\d*\.?\d{8,}|\{[^{}]*\d{8,}[^{}]*\}")
# a width taken from the arguments (%*d, {:{}}): then the integer arguments are sizes
_ARG_WIDTH = re.compile(r"\*|\{[^{}]*\{")
# the filters and str methods whose integer arguments are sizes; elsewhere an integer is data (a default, a sentinel,
# a position) and may be large
_SIZED_BY_INTS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice", "ljust", "rjust", "zfill",
                            "expandtabs"})


class _RenderLimit(Exception):
    """A chat template went past a rendering bound."""


def _check_size(what: str, size: int) -> None:
    if size > _RENDER_SIZE:
        raise _RenderLimit(f"builds a result of {size} characters or items in {what}, over the limit of {_RENDER_SIZE}")


_CONTAINERS = (list, tuple, set, frozenset, dict)
_LONG = (str, *_CONTAINERS)


def _text_size(value: Any) -> int:
    """About len(str(value)), close enough to catch a blow-up before str() builds it: a container counts its
    brackets and about three characters per item, plus what its strings and containers hold; the walk stops once
    past the render limit (a list holding one list a million times would otherwise take as long to measure as to
    print)."""
    todo, total = [value], 0
    while todo and total <= _RENDER_SIZE:
        v = todo.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, _CONTAINERS):
            items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
            total += 2 + 3 * len(items)   # brackets, and per item a separator and at least one character
            if total <= _RENDER_SIZE:     # only what can print longer than that is visited
                todo.extend(x for x in items if isinstance(x, _LONG))
    return total


def _growth(name: str, value: Any, args: tuple, kwargs: dict[str, Any]) -> int:
    """An upper bound on the size of what str method or filter `name` builds (filter argument order: value first;
    a str method's self is its value), for the ones whose result can outgrow their inputs many times over: known
    before building it. 0 for the rest, whose result is measured after."""
    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    if not isinstance(value, str) and name not in ("join", "sum"):
        return 0
    if name == "replace":
        old, new = arg(0, "old"), arg(1, "new")
        if isinstance(old, str) and isinstance(new, str):
            return len(value) + (value.count(old) if old else len(value) + 1) * len(new)
    elif name == "join" and isinstance(value, str):          # str.join: value is the separator
        items = arg(0, "iterable")
        if isinstance(items, (list, tuple)):
            return len(items) * len(value) + _text_size(items)
    elif name == "join" and isinstance(value, (list, tuple)):  # the filter: value is the sequence
        sep = arg(0, "d", "")
        return len(value) * (len(sep) if isinstance(sep, str) else 0) + _text_size(value)
    elif name in ("indent", "expandtabs"):
        width = arg(0, "width" if name == "indent" else "tabsize", 4 if name == "indent" else 8)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return len(value) + (value.count("\n") + 1 if name == "indent" else value.count("\t")) * max(width, 0)
    elif name == "wordwrap":
        wrap = arg(2, "wrapstring")
        return len(value) * (1 + (len(wrap) if isinstance(wrap, str) else 1))
    elif name in ("format", "format_map"):   # the filter is value % args, the method value.format(*args)
        return _format_size(value, (args, kwargs))
    elif name == "sum" and isinstance(arg(1, "start"), (str, list, tuple)) and isinstance(value, (list, tuple)):
        return len(value) * _text_size(value)   # concatenating a growing sum: quadratic work, in one C call
    return 0


def _format_size(fmt: str, args: Any) -> int:
    """An upper bound on the size of fmt % args or fmt.format(...): each field can repeat all of args, and a width
    or precision of 8 digits asks for more than the limit on its own."""
    if _WIDE_FIELD.search(fmt):
        return _RENDER_SIZE + 1
    return len(fmt) + (fmt.count("%") + fmt.count("{")) * _text_size(args)


def _result_size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict, set, frozenset)) else 0


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with bounds on the work a template can ask for. Time: a deadline checked at every
    loop step (see _BoundLoops), call, operator, attribute lookup and output chunk. Size: every string or list an
    operator, call, filter, `~` or `{{ }}` builds is capped at _RENDER_SIZE, checked before it is built wherever
    the size is known from the inputs (str * n, a + b, ~, replace, join, indent, format widths, ...) and after
    otherwise; integer arguments are capped alike, so no width, count or range can ask for more."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(finalize=self._finalize, **kwargs)
        self._local = threading.local()
        del self.globals["lipsum"]   # n paragraphs of filler text in one uninterruptible call; no template uses it
        self.filters = {name: self.bounded_filter(name, f) for name, f in self.filters.items()}

    def start(self) -> None:
        self._local.deadline = time.monotonic() + _RENDER_SECONDS

    def tick(self) -> None:
        if time.monotonic() > getattr(self._local, "deadline", math.inf):
            raise _RenderLimit(f"did not finish rendering within {_RENDER_SECONDS:g} s (a loop or recursion "
                               "without end?)")

    @staticmethod
    def _check_sizes(what: str, args: Iterable[Any]) -> None:
        """Integer arguments that are widths or counts, capped like the results they size."""
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > _RENDER_SIZE:
                raise _RenderLimit(f"passes {a} to {what}, over the limit of {_RENDER_SIZE} for a count or width")

    def bounded_filter(self, name: str, f: Callable) -> Callable:
        skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0   # the context / environment argument

        @functools.wraps(f)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self.tick()
            value = args[skip] if len(args) > skip else None
            if name in _SIZED_BY_INTS or (name == "format" and isinstance(value, str) and _ARG_WIDTH.search(value)):
                self._check_sizes(f"filter {name}", list(args[skip:]) + list(kwargs.values()))
            if len(args) > skip:
                _check_size(f"filter {name}", _growth(name, args[skip], args[skip + 1:], kwargs))
            out = f(*args, **kwargs)
            _check_size(f"filter {name}", _result_size(out))
            return out
        return bounded

    def _finalize(self, value: Any) -> Any:
        _check_size("{{ }} output", _text_size(value))   # before str() turns a list into text
        return value

    def bounded_iter(self, iterable: Any) -> Iterable[Any]:
        for item in iterable:
            self.tick()
            yield item

    @jinja2.pass_eval_context
    def bounded_concat(self, eval_ctx: Any, *parts: Any) -> str:
        _check_size("~", sum(_text_size(p) for p in parts))
        return (markup_join if eval_ctx.autoescape else str_join)(parts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.tick()
        seqs = (str, list, tuple)
        if operator == "*" and isinstance(left, seqs) and isinstance(right, int):
            _check_size("*", len(left) * right)
        elif operator == "*" and isinstance(right, seqs) and isinstance(left, int):
            _check_size("*", len(right) * left)
        elif operator == "+" and isinstance(left, seqs) and isinstance(right, seqs):
            _check_size("+", len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            if _ARG_WIDTH.search(left):
                self._check_sizes("%", right if isinstance(right, tuple) else (right,))
            _check_size("%", _format_size(left, right))
        elif isinstance(left, int) and isinstance(right, int):
            bits = (right * max(left.bit_length() - 1, 0) if operator == "**" and right > 0
                    else left.bit_length() + right.bit_length() if operator == "*" else 0)
            if bits > _INT_BITS:
                raise _RenderLimit(f"computes an integer of about {bits} bits (with {operator}), over the limit of "
                                   f"{_INT_BITS}")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        __self.tick()
        given = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
        name = getattr(__obj, "__name__", "a function")
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)   # a str method's string
        if (__obj is __self.globals.get("range") or isinstance(owner, str) and (
                name in _SIZED_BY_INTS or name in ("format", "format_map") and _ARG_WIDTH.search(owner))):
            __self._check_sizes(name, list(args) + list(given.values()))
        if isinstance(owner, str):
            _check_size(f"str.{name}", _growth(name, owner, args, given))
        out = super().call(__context, __obj, *args, **kwargs)
        _check_size(name, _result_size(out))
        return out

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.tick()
        return super().getitem(obj, argument)


def _env_call(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None, lineno=lineno)


class _BoundLoops(NodeTransformer):
    """Routes every for-loop's sequence through environment.bounded_iter, so each step of every loop checks the
    deadline (nested loops with empty bodies call nothing else), and every `~` through environment.bounded_concat,
    so the joined size is checked before it is built."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = _env_call("bounded_iter", [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return _env_call("bounded_concat", node.nodes, node.lineno)


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
        _check_kinds(meta, source)
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
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = env.bounded_filter("tojson", _tojson)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.start()   # compiling folds constant filter calls: bounded too
        try:
            tree = _BoundLoops().visit(env.parse(self.chat_template))
            return env.from_string(tree)
        except jinja2.TemplateSyntaxError as e:
            raise GGUFError(f"{self._source}: tokenizer.chat_template does not parse as jinja2 "
                            f"(line {e.lineno}: {e.message}); {_TEMPLATE_FIX}") from None
        except Exception as e:   # a bound hit while folding constants, a parser recursion limit, ...
            raise self._template_error(e) from None

    def _template_error(self, e: Exception) -> GGUFError:
        if isinstance(e, _RenderLimit):
            what = str(e)
        elif isinstance(e, jinja2.exceptions.SecurityError):
            what = f"does something the sandbox forbids ({e})"
        elif isinstance(e, jinja2.UndefinedError):
            what = f"uses something that is not defined ({e})"
        else:
            what = f"failed ({type(e).__name__}: {e})"
        return GGUFError(f"{self._source}: tokenizer.chat_template {what}; {_TEMPLATE_FIX}")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The template rendered, within _RENDER_SECONDS and _RENDER_SIZE characters (see _BoundedSandbox): any
        failure of the template is a GGUFError naming the file; raise_exception (the template refusing the
        messages) stays a ConfigError."""
        template = self._template
        template.environment.start()
        out, size = [], 0
        try:
            for chunk in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=self._bos_text or "", eos_token=self._eos_text or ""):
                size += len(chunk)
                _check_size("the rendered text", size)
                template.environment.tick()
                out.append(chunk)
        except ConfigError:
            raise
        except Exception as e:   # every other failure is the template's: the messages are plain text
            raise self._template_error(e) from None
        return "".join(out)

    def encode_chat(self, user_text: str, system: str | None = None) -> list[int]:
        messages = [{"role": "system", "content": system}] if system is not None else []
        return self.encode_messages(messages + [{"role": "user", "content": user_text}])

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """A conversation through the chat template, ready for the assistant's turn."""
        text = self.apply_chat_template(messages)
        # Templates that write the BOS text themselves must not get a second BOS id.
        has_bos = self._bos_text is not None and text.startswith(self._bos_text)
        return self.encode(text, add_bos=False if has_bos else None)
