"""What a request to the OpenAI-compatible API may ask (harness/server_api.py): its body parsed strictly (a field OpenAI
does not have is refused by name, a wrong type names the field), the fields this server takes only at their defaults,
and the one sampling setting it serves. Every refusal is an `APIError`: OpenAI's error shape and a 4xx."""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from onepass.engine.sampler import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# -- request bodies: a field OpenAI does not have is refused by name, a wrong type names the field ------------------

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class Common(Strict):
    model: str | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False        # vLLM's extension: exactly max_tokens tokens, whatever the model samples
    return_token_ids: bool = False  # vLLM's extension: each choice (each chunk's) also holds its tokens' ids
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None        # vLLM's extension; -1 or 0: the whole vocabulary
    n: int = 1
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionBody(Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatBody(Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None


# fields OpenAI has and this server takes only at their default: (accepted, why not otherwise)
UNSUPPORTED = {
    "n": (lambda v: v == 1, "one completion per request: send n requests"),
    "best_of": (lambda v: v in (None, 1), "one completion per request"),
    "logprobs": (lambda v: v in (None, False), "log probabilities are not returned"),
    "top_logprobs": (lambda v: v in (None, 0), "log probabilities are not returned"),
    "echo": (lambda v: not v, "the prompt is not echoed"),
    "suffix": (lambda v: v is None, "there is no insertion mode"),
    "presence_penalty": (lambda v: v == 0, "penalties are not applied"),
    "frequency_penalty": (lambda v: v == 0, "penalties are not applied"),
    "logit_bias": (lambda v: not v, "logits are not biased"),
    "seed": (lambda v: v is None, "a request's seed comes from the server's sampling.seed and the request's id"),
    "tools": (lambda v: not v, "there are no tool calls"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "there are no tool calls"),
    "response_format": (lambda v: v in (None, {"type": "text"}), "the output is plain text"),
}


def describe(s: SamplingParams) -> str:
    return "greedy (temperature=0)" if s.greedy else f"temperature={s.temperature}, top_p={s.top_p}, top_k={s.top_k}"


def check_sampling(body: Common, server: SamplingParams) -> None:
    """One sampling setting serves every request: a request may repeat it or leave it out, nothing else."""
    asked = {"temperature": body.temperature, "top_p": body.top_p,
             "top_k": 0 if body.top_k == -1 else body.top_k}
    temperature = server.temperature if body.temperature is None else body.temperature
    for name, value in asked.items():
        if value is None or value == getattr(server, name):
            continue
        if name != "temperature" and temperature == 0 and server.greedy:
            continue   # greedy: top_p and top_k change nothing
        raise APIError(400, f"{name}={value} differs from this server's sampling, {describe(server)}: the engine "
                            f"samples every request alike. Leave {name} out, or start a server for it: "
                            f"onepass-serve ... sampling.{name}={value}", param=name)


def parse(raw: bytes, model: type[Strict]) -> Strict:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body is a JSON {type(data).__name__}; send an object")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param, where = str(first["loc"][0]), ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {where}", param=param) from None
        if first["type"] == "missing":
            raise APIError(400, f"{where} is required", param=param) from None
        if param == "prompt":   # each member of the union has its say otherwise
            raise APIError(400, "prompt is text or a list of token ids (or a list of one of those)",
                           param=param) from None
        raise APIError(400, f"{where}: {first['msg']}", param=param) from None
    for name, (ok, why) in UNSUPPORTED.items():
        value = getattr(body, name, None)
        if not ok(value):
            raise APIError(400, f"{name}={json.dumps(value)} is not supported by onepass-serve: {why}", param=name)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    return body
