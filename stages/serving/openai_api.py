"""The OpenAI API's request bodies, checked, and its response and chunk objects.

Requests (https://platform.openai.com/docs/api-reference): `/v1/chat/completions` takes
`messages` (optional leading `system` messages, then `user` and `assistant` turns alternating,
ending with `user`; `content` a string or a list of `{"type": "text", "text": ...}` parts);
`/v1/completions` takes `prompt` (a string, or a list of one string). Both take `model`,
`max_tokens` (chat also `max_completion_tokens`), `temperature` (0 = greedy; OpenAI's default 1.0
samples), `top_p`, `seed`, `stop` (a string or up to 4), `stream`, `stream_options.include_usage`,
and `n` = 1. A field we cannot honour (n > 1, logprobs, penalties, echo, suffix, tools, ...) is an
error naming it, never silently ignored; other fields (`user`, `metadata`, `store`, ...) do not
change the answer and are accepted.

`RequestError(status, message, param)` carries the HTTP status the handler answers with: 400 for
a body that is not JSON or a prompt too long for the context, 404 for an unknown model, 422 for a
field of the wrong type or value.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_STOPS = 4  # OpenAI's limit on `stop` strings
ROLES = ("system", "user", "assistant")
# Fields that change the answer in ways this server does not implement: refused unless at their
# neutral value (the value OpenAI's own default gives).
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "top_logprobs": None,
            "logit_bias": None, "echo": False, "suffix": None, "best_of": 1, "tools": None, "tool_choice": None,
            "functions": None, "function_call": None, "response_format": None}


class RequestError(ValueError):
    """A request the server refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict[str, Any]:
        kind = {404: "not_found_error", 401: "authentication_error", 503: "server_overloaded"}.get(
            self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Request:
    """A checked request of either endpoint."""

    endpoint: str  # "chat" or "completions"
    model: str
    max_tokens: int | None  # None: up to the end of the context window
    temperature: float
    top_p: float
    seed: int | None
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    messages: tuple[tuple[str, str], ...] = ()  # chat: (role, content), system first
    prompt: str = ""  # completions

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _number(body, key, default, low, high, *, low_open=False) -> float:
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(422, f"'{key}' must be a number, got {value!r}", key)
    if value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(422, f"'{key}'={value} is outside {bounds}", key)
    return float(value)


def _optional_int(body, key, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(422, f"'{key}' must be an integer >= {low}, got {value!r}", key)
    return value


def _stops(body) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise RequestError(422, f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them, "
                                f"got {stop!r}", "stop")
    return tuple(stops)


def _content(message: dict, where: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(422, f"{where}.content must be a string or a list of text parts "
                            '({"type": "text", "text": "..."}); images and audio are not supported', where)


def _messages(body) -> tuple[tuple[str, str], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(422, "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}", "messages")
    parsed = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(422, f"{where} needs a role, one of {', '.join(ROLES)}", where)
        parsed.append((m["role"], _content(m, where)))
    turns = [role for role, _ in parsed if role != "system"]
    system_first = all(role == "system" for role, _ in parsed[:len(parsed) - len(turns)])
    alternating = all(role == ("user" if i % 2 == 0 else "assistant") for i, role in enumerate(turns))
    if not system_first or not turns or not alternating or turns[-1] != "user":
        raise RequestError(422, "'messages' must be optional system messages first, then user and assistant turns "
                                f"alternating, ending with a user turn; got roles {[r for r, _ in parsed]}",
                           "messages")
    return tuple(parsed)


def _prompt(body) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError(422, "'prompt' must be a string (or a list of one string; token-id prompts and "
                                "several prompts per request are not supported)", "prompt")
    return prompt


def parse_request(body: dict[str, Any], endpoint: str) -> Request:
    """Check every field this server reads; RequestError (422) names the first bad one."""
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and value != neutral and value != []:
            raise RequestError(422, f"'{key}' is not supported by this server (only its default, {neutral!r})", key)
    if not isinstance(body.get("model"), str):
        raise RequestError(422, "'model' must be a string: the id /v1/models lists", "model")
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError(422, f"'n'={n!r}: this server returns one choice per request (n=1)", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(422, f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(422, "'stream_options' must be an object", "stream_options")
    max_tokens = _optional_int(body, "max_tokens", 1)
    if endpoint == "chat" and max_tokens is None:
        max_tokens = _optional_int(body, "max_completion_tokens", 1)
    return Request(
        endpoint=endpoint, model=body["model"], max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=_optional_int(body, "seed", 0), stops=_stops(body), stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        messages=_messages(body) if endpoint == "chat" else (),
        prompt=_prompt(body) if endpoint == "completions" else "")


# -- responses -----------------------------------------------------------------------------------
def new_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(request: Request, rid: str, created: int, text: str, finish_reason: str,
             prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The whole answer of a request that did not stream."""
    if request.endpoint == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                  "logprobs": None}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": request.model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(request: Request, rid: str, created: int, *, text: str | None = None, role: bool = False,
          finish_reason: str | None = None, usage_: dict[str, int] | None = None) -> dict[str, Any]:
    """One server-sent event of a stream: a delta, the finish reason, or (choices empty) the usage."""
    if usage_ is not None:
        choices = []
    elif request.endpoint == "chat":
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]
    kind = "chat.completion.chunk" if request.endpoint == "chat" else "text_completion"
    out = {"id": rid, "object": kind, "created": created, "model": request.model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def model_list(models: Sequence[tuple[str, int | None]]) -> dict[str, Any]:
    """/v1/models: one model object per (id, created), in the order given."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created or int(time.time()),
                                        "owned_by": "llm-lifecycle"} for model_id, created in models]}
