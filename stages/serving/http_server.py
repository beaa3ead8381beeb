"""The HTTP side of the server: routes, the API key, JSON answers and server-sent events.

Python's ThreadingHTTPServer (one thread per connection, HTTP/1.1 keep-alive); each model runs
only in its Scheduler's thread (stages.serving.model_set: one per model, the request's `model`
field picks it). Routes:
  GET  /                       the chat page (stages/serving/chat_page.html)
  GET  /health                 {"status": "ok", "waiting_or_running", "finished", "models": {id: ...}}
                               (and "model": id with one model, as before several)
  GET  /v1/models              the models this server answers with
  POST /v1/chat/completions    OpenAI chat completions, streamed or not
  POST /v1/completions         OpenAI (legacy) completions, streamed or not
Errors are OpenAI's JSON error objects: 400 (not JSON, prompt or max_tokens past the context),
401 (missing or wrong API key when the server has one), 404 (unknown path or model), 411/413
(no or too large a body), 422 (a field of the wrong type or value), 503 (the queue is full), 500
(generation failed; the server goes on). A client that disconnects mid-stream cancels its row.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import select
import socket
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from stages.serving import openai_api
from stages.serving.model_set import ModelSet, Route
from stages.serving.openai_api import RequestError
from stages.serving.scheduler import Completion, QueueFull, Sampling, Scheduler
from stages.serving.served_model import ServedModel
from stages.serving.text_stream import TextStream

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt the context can hold
READ_TIMEOUT_S = 30  # a client that stops sending its request mid-body is dropped, not waited on
POLL_S = 0.25  # while a request waits for its tokens, how often its connection is checked for a client that left
# A stream sends what arrived in this interval as one write: one wake-up of the handler thread per
# interval instead of per token, which on a 2-core machine costs the model's threads ~20% (bench/serve.py)
STREAM_INTERVAL_S = 0.02


class ModelServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that carries what the handlers share: `models`, a ModelSet, or one
    ServedModel with its Scheduler (the one-model form)."""

    daemon_threads = True  # open keep-alive connections do not block shutdown
    # connections the kernel queues before accept(): socketserver's default of 5 reset one of 192
    # connections when 16 bench clients reconnected at once under load; --max-queue answers excess with 503
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], models: ModelSet | ServedModel, scheduler: Scheduler | None = None,
                 api_key: str | None = None):
        if isinstance(models, ServedModel):
            if scheduler is None:
                raise ValueError("ModelServer(address, served, scheduler): a ServedModel needs its Scheduler")
            models = ModelSet([Route(models, scheduler)])
        if ":" in address[0]:  # an IPv6 address such as ::1
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)
        self.models, self.api_key = models, api_key
        self.chat_page = resources.files("stages.serving").joinpath("chat_page.html").read_bytes()

    def _only(self) -> Route:
        if len(self.models) != 1:
            raise ValueError(f"this server answers as {len(self.models)} models ({', '.join(self.models.ids)}); "
                             "pick one with server.models.route(model_id)")
        return next(iter(self.models))

    @property
    def served(self) -> ServedModel:
        """The model of a one-model server."""
        return self._only().served

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of a one-model server."""
        return self._only().scheduler

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S
    server: ModelServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        log.info("%s %s", self.address_string(), format % args)

    # -- routes ----------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 (BaseHTTPRequestHandler's naming)
        path = self.path.split("?", 1)[0]
        if path in ("/", "/chat"):
            self._send(200, self.server.chat_page, "text/html; charset=utf-8")
        elif path == "/health":
            self._json(200, self.server.models.health())
        elif path == "/v1/models":
            if self._authorized():
                self._json(200, openai_api.model_list([(r.served.model_id, r.served.created)
                                                       for r in self.server.models]))
        else:
            self._error(RequestError(404, f"no route GET {path}; see /v1/models, /v1/chat/completions, "
                                          "/v1/completions"))

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(path)
        if endpoint is None:
            self._drain()
            self._error(RequestError(404, f"no route POST {path}; see /v1/chat/completions, /v1/completions"))
            return
        if not self._authorized():
            return
        try:
            request = openai_api.parse_request(openai_api.parse_body(self._body()), endpoint)
            completion, prompt_tokens = self._submit(request, self.server.models.route(request.model))
        except RequestError as e:
            self._error(e)
            return
        except QueueFull as e:
            self._error(RequestError(503, str(e)))
            return
        except Exception as e:  # e.g. a chat template the SFT encoder cannot cut (SftDataError): answer, don't drop
            log.exception("request failed before generation")
            self._error(RequestError(500, f"{type(e).__name__}: {e}"))
            return
        if request.stream:
            self._stream(request, completion, prompt_tokens)
        else:
            self._answer(request, completion, prompt_tokens)

    # -- generation ------------------------------------------------------------------------------
    def _submit(self, request: openai_api.Request, route: Route) -> tuple[Completion, int]:
        served = route.served
        prompt = served.prompt_ids(request)
        budget = served.answer_budget(request, len(prompt))
        sampling = None if request.greedy else Sampling(request.temperature, request.top_p, request.seed)
        stream = TextStream(served.tokenizer, request.stops, served.eos_token_id)
        completion = Completion(prompt=prompt, max_tokens=budget, stream=stream, sampling=sampling,
                                streaming=request.stream)
        return route.scheduler.submit(completion), len(prompt)

    def _next_event(self, completion: Completion) -> tuple[str, str]:
        """The completion's next event; a client that closed its connection meanwhile cancels it
        (the scheduler drops it from the queue or ends its row at the next step)."""
        while True:
            try:
                return completion.events.get(timeout=POLL_S)
            except queue.Empty:
                if self._client_gone():
                    completion.cancelled.set()
                    raise ConnectionResetError("the client closed its connection") from None

    def _client_gone(self) -> bool:
        poller = select.poll()  # not select.select: it refuses a socket numbered 1024 or above (FD_SETSIZE)
        poller.register(self.connection, select.POLLIN)
        try:
            return bool(poller.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _next_events(self, completion: Completion) -> list[tuple[str, str]]:
        """The next event, and with a delta whatever else arrives within STREAM_INTERVAL_S."""
        events = [self._next_event(completion)]
        if events[0][0] == "delta":
            time.sleep(STREAM_INTERVAL_S)
            while True:
                try:
                    events.append(completion.events.get_nowait())
                except queue.Empty:
                    return events
        return events

    def _answer(self, request, completion: Completion, prompt_tokens: int) -> None:
        try:
            kind, value = self._next_event(completion)  # not streaming: only ("done", reason) or ("error", message)
        except ConnectionResetError:
            self.close_connection = True
            return
        if kind == "error":
            self._error(RequestError(500, value))
            return
        body = openai_api.response(request, openai_api.new_id(request.endpoint), int(time.time()),
                                   completion.stream.text, value, prompt_tokens, completion.completion_tokens)
        self._json(200, body)

    def _stream(self, request, completion: Completion, prompt_tokens: int) -> None:
        rid, created = openai_api.new_id(request.endpoint), int(time.time())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if request.endpoint == "chat":
                self._event(openai_api.chunk(request, rid, created, text="", role=True))
            ended = False
            while not ended:
                out = []
                for kind, value in self._next_events(completion):
                    if kind == "delta":
                        out.append(openai_api.chunk(request, rid, created, text=value))
                    elif kind == "error":
                        out.append(RequestError(500, value).body())
                        ended = True
                    else:
                        out.append(openai_api.chunk(request, rid, created, finish_reason=value))
                        if request.include_usage:
                            out.append(openai_api.chunk(request, rid, created, usage_=openai_api.usage(
                                prompt_tokens, completion.completion_tokens)))
                        ended = True
                self._events(out)
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")  # the chunked body's end
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            completion.cancelled.set()  # the scheduler ends the row at its next step
            self.close_connection = True

    # -- plumbing --------------------------------------------------------------------------------
    def _authorized(self) -> bool:
        key = self.server.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return True
        self._drain()
        self._error(RequestError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'"))
        return False

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise RequestError(411, "the request needs a Content-Length header (chunked bodies are not accepted)")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(413, f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}")
        return self.rfile.read(int(length))

    def _drain(self) -> None:
        """Read and drop the body of a request refused before its body was read (keep-alive)."""
        length = self.headers.get("Content-Length")
        if length is None:
            return
        if length.isdigit() and int(length) <= MAX_BODY_BYTES:
            self.rfile.read(int(length))
        else:
            self.close_connection = True

    def _event(self, obj: dict[str, Any]) -> None:
        self._events([obj])

    def _events(self, objs: list[dict[str, Any]]) -> None:
        """Server-sent events, one `data:` line each, in one chunk (one write)."""
        self._chunk(b"".join(b"data: " + json.dumps(o, ensure_ascii=False).encode() + b"\n\n" for o in objs))

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _error(self, error: RequestError) -> None:
        if error.status >= 500:
            log.error("%s", error)
        self._json(error.status, error.body())

    def _json(self, status: int, obj: dict[str, Any]) -> None:
        self._send(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        try:
            self.send_response(status, HTTPStatus(status).phrase)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
