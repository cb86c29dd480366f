"""A request's output as text, a few tokens at a time: decoded incrementally, so a character whose bytes span
tokens comes out whole, and cut at the first stop string, which a stream never shows even in part."""
from __future__ import annotations

from typing import Callable, Iterable

INCOMPLETE = "\ufffd"   # what decoding makes of a character whose last bytes have not come yet


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: Iterable[str] = (),
                 stop_ids: Iterable[int] = ()):
        """decode: token ids -> text (special tokens skipped); stops: strings that end the output, left out of it;
        stop_ids: tokens that end it (the model's end of turn), counted as completion tokens but not shown."""
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.stop_ids = frozenset(stop_ids)
        # the end of the text may be the start of a stop string: that much waits for the next tokens
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        # ids[prefix:read] were decoded already; decoding the next tokens together with them keeps what a tokenizer
        # does at a boundary (SentencePiece drops the space of a text's first word) out of the middle of the text
        self.prefix = self.read = 0
        self.text = ""
        self.shown = 0              # characters of text handed out
        self.tokens = 0             # completion tokens taken, a stop token included
        self.finish: str | None = None   # "stop" | "length" once the output has ended
        self.cut = False            # ended by a stop string: the text is final up to it

    def add(self, tokens: Iterable[int], done: bool = False) -> str:
        """Take the next tokens (done: the engine generated its last); returns the text that is final now."""
        if not self.finish:
            new, stop = [], False
            for tok in tokens:
                if tok in self.stop_ids:
                    stop = True
                    break
                new.append(tok)
            if not self._take(new):   # a stop string or a character cut short in them: token by token
                for tok in new:
                    if self.finish:
                        break
                    self.tokens += 1
                    self.ids.append(tok)
                    self._extend(final=False)
            if stop and not self.finish:
                self.tokens += 1
                self.finish = "stop"
        if done and not self.finish:
            self.finish = "length"
        if self.finish and not self.cut and len(self.ids) > self.read:
            self._extend(final=True)   # a character cut short by the end of the output, as the tokenizer shows it
        end = len(self.text) if self.finish else max(self.shown, len(self.text) - self.hold)
        out, self.shown = self.text[self.shown:end], end
        return out

    def _take(self, new: list[int]) -> bool:
        """All of `new` decoded at once (two decodes, not two a token), unless their text ends in a character cut
        short or holds a stop string: then nothing is taken (False), as which token ends it matters."""
        if len(new) < 2:
            return not new
        head = self.decode(self.ids[self.prefix:self.read])
        whole = self.decode(self.ids[self.prefix:] + new)
        if len(whole) <= len(head) or whole.endswith(INCOMPLETE):
            return False
        start = max(0, len(self.text) - self.hold)
        text = self.text + whole[len(head):]
        if any(text.find(s, start) >= 0 for s in self.stops):
            return False
        self.ids += new
        self.tokens += len(new)
        self.text, self.prefix, self.read = text, self.read, len(self.ids)
        return True

    def _extend(self, final: bool) -> None:
        head = self.decode(self.ids[self.prefix:self.read])
        whole = self.decode(self.ids[self.prefix:])
        if len(whole) > len(head) and (final or not whole.endswith(INCOMPLETE)):
            start = max(0, len(self.text) - self.hold)   # where a stop string ending in the new text can begin
            self.text += whole[len(head):]
            self.prefix, self.read = self.read, len(self.ids)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.finish, self.cut = "stop", True
