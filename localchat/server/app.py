"""The ASGI application of ``localchat serve``: routes, keys, limits, errors, one log line each.

Routes: ``POST /v1/chat/completions`` (OpenAI), ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (Anthropic), ``GET /v1/models``, ``GET /health``. Every
answer that is not a reply is the API's own error shape with its status (400 malformed or
wrong types, 401 key, 404 model or route, 413 body too large, 429 queue full, 400
``context_length_exceeded``); a bug answers 500 in that shape, its traceback in a crash log.
With a key (``--api-key``), every route but ``/health`` wants it as ``Authorization: Bearer``
or ``x-api-key``.

Each request becomes a turn of a stored conversation (``stateless.place``), run on the model
thread (``worker.py``); streaming answers are server-sent events. A client that disconnects
mid-stream gets its generation stopped at the next token. A reasoning model's thinking
(``ReasoningChunk`` events, then ``TurnFinished.reasoning``) is answered apart from the reply,
in each API's own field or block; the request's switch (``ChatRequest.thinking``) goes to the
turn, which renders the template with it. A reply's shape (``ChatRequest.constraint``, checked
by ``structured.py`` before the request is queued) goes to the turn as its constraint; so
does the grammar of strict tools' calls and ``tool_choice`` (``_tool_constraint``). A
request's images (``images.py``) are refused for a text model before it is queued; on the
model thread the model's processor sees them, then they are stored by content hash
(``store/images.py``) and the messages name them; a request refused there leaves none of its
new images stored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import secrets
import sys
import time
import uuid

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import crashlog
from ..errors import BadInput, ContextFull, LocalchatError
from ..events import ReasoningChunk, ReplyChunk, TurnFinished
from ..model.replies import ToolHold, tool_markers
from ..model.toolcalls import NAME as TOOLS_CONSTRAINT
from ..session import stateless
from ..session.images import keep
from ..session.session import TurnOptions
from . import anthropic_api, openai_api
from .chat import MAX_BODY, ApiError, ChatRequest, bad
from .worker import DONE, Job, QueueFull, Worker


class Service:
    """What the routes share: the worker (and its session), the names the model answers
    to, the key, and where the log lines go."""

    def __init__(self, worker: Worker, api_key: str | None = None, log=None,
                 context_overflow: str = "stop"):
        self.worker = worker
        self.api_key = api_key
        # A request longer than the context: "stop" answers 400 context_length_exceeded (the
        # APIs' own semantics); "truncate" leaves its oldest turns out (``session/window.py``).
        self.context_overflow = context_overflow
        info = worker.session.engine.info()
        self.model = info.name
        short = self.model.rstrip("/").rsplit("/", 1)[-1]
        self.names = {self.model, short, "localchat", "default"}
        self.context_length = info.context_length
        self.sampling = worker.session.engine.sampling()
        self.defaults = {name: {"value": getattr(self.sampling, name),
                                "source": self.sampling.sources[name]}
                         for name in self.sampling.sources}
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.told_free_tools = False  # the log said strict tools run free on this model

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise ApiError(404, "not_found", f"model {name!r} is not served here (this server "
                           f"has {self.model!r}; GET /v1/models)", param="model")

    def check_images(self, req: ChatRequest) -> None:
        """A 400 naming the first image of ``req`` when the model takes none."""
        if req.images and not self.worker.session.engine.takes_images():
            where = req.images[0].where
            raise bad(f"{where}: {self.model} is a text model: it cannot take images (serve "
                      "a vision model: docs/images.md)", where)


def make_app(service: Service) -> Starlette:
    async def chat_completions(request: Request) -> Response:
        return await _chat(service, request, "openai")

    async def messages(request: Request) -> Response:
        return await _chat(service, request, "anthropic")

    async def count_tokens(request: Request) -> Response:
        try:
            _authorize(service, request)
            req = await run_in_threadpool(anthropic_api.parse, await _json(request),
                                          counting=True)
            service.check_model(req.model)
            service.check_images(req)
            # On the model thread (the session's): aligned as the turn would render it.
            n = await run_in_threadpool(service.worker.call, _count, req)
            return JSONResponse({"input_tokens": n})
        except ApiError as err:
            return _error(err, "anthropic")
        except LocalchatError as err:  # the template refuses the messages
            return _error(bad(str(err)), "anthropic")

    async def models(request: Request) -> Response:
        try:
            _authorize(service, request)
        except ApiError as err:
            return _error(err, "openai")
        return JSONResponse({"object": "list", "data": [
            {"id": service.model, "object": "model", "created": 0, "owned_by": "localchat",
             "context_length": service.context_length,
             # What a request that names none of them gets (``model/defaults.py``).
             "max_tokens": service.sampling.max_tokens,
             "defaults": service.defaults}]})

    async def health(request: Request) -> Response:
        sched = service.worker.scheduler
        return JSONResponse({"status": "ok", "model": service.model,
                             "waiting": service.worker.waiting,
                             "running": len(sched.running), "max_batch": sched.max_batch,
                             "widest_batch": sched.widest})

    async def not_found(request: Request, exc) -> Response:
        api = "anthropic" if request.url.path.startswith("/v1/messages") else "openai"
        status = getattr(exc, "status_code", 404)
        kind = "not_found" if status == 404 else "invalid_request"
        return _error(ApiError(status, kind, f"{request.method} {request.url.path}: "
                               f"{'no such route' if status == 404 else 'not allowed'}"), api)

    return Starlette(routes=[
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/messages", guarded(messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", guarded(count_tokens), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/health", guarded(health), methods=["GET"]),
    ], exception_handlers={404: not_found, 405: not_found})


def guarded(route):
    """``route``, answering a bug with 500 in the API's error shape and its traceback in a
    crash log (Starlette's own last resort would print the traceback as well)."""
    async def run(request: Request) -> Response:
        try:
            return await route(request)
        except Exception as err:  # noqa: BLE001 - a bug: one answer, one log file
            log = crashlog.write(err, "localchat serve")
            api = "anthropic" if request.url.path.startswith("/v1/messages") else "openai"
            return _error(ApiError(500, "server", "internal error; the server's log has "
                                   f"the details ({log})"), api)

    return run


# -- a chat request ------------------------------------------------------------------------


async def _chat(service: Service, request: Request, api: str) -> Response:
    t0 = time.perf_counter()
    spec = openai_api if api == "openai" else anthropic_api
    try:
        _authorize(service, request)
        # Off the event loop: a large schema takes up to ~0.5 s to check (``structured.py``),
        # and the other clients' streams go on meanwhile.
        req = await run_in_threadpool(spec.parse, await _json(request))
        service.check_model(req.model)
        service.check_images(req)
        req = await run_in_threadpool(_tool_constraint, service, req)
    except ApiError as err:
        service.log(f"localchat serve: {api} {err.status} {err.message}")
        return _error(err, api)
    loop = asyncio.get_running_loop()
    job, events = Job.for_loop(lambda session, emit: _turn(
        session, req, job.cancel, service.context_overflow), loop)
    job.cost = _cost(service, req)
    try:
        service.worker.submit(job)
    except QueueFull as err:
        return _error(ApiError(429, "rate_limit", f"the server is busy ({err}); try again"),
                      api)
    rid = ("chatcmpl-" if api == "openai" else "msg_") + uuid.uuid4().hex[:24]
    if req.stream:
        stream = _openai_stream if api == "openai" else _anthropic_stream
        return StreamingResponse(
            _watched(service, job, stream(service, req, rid, events), request, req, t0),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    watch = asyncio.create_task(_disconnect(request, job))
    try:
        reply, finished = await _collect(events)
    except ApiError as err:
        return _error(err, api)
    finally:
        watch.cancel()
    _log(service, req, finished, t0)
    if api == "openai":
        return JSONResponse(openai_api.completion(rid, int(time.time()), service.model, reply,
                                                  finished.usage, _finish(finished),
                                                  finished.tool_calls, finished.reasoning))
    return JSONResponse(anthropic_api.message(
        rid, service.model, reply, finished.usage, finished.usage.bytes_written > 0,
        _finish(finished), finished.stop_sequence, finished.tool_calls, finished.reasoning))


def _tool_constraint(service: Service, req: ChatRequest) -> ChatRequest:
    """``req`` with its strict tools' and ``tool_choice``'s grammar as its constraint, in the
    model's own tool-call syntax (``model/toolcalls.py``). A model whose calls that grammar
    cannot write runs free, said once in the log (a template without tools is ``_turn``'s)."""
    engine = service.worker.session.engine
    rules = req.tool_rules
    if not req.tools or rules is None or not rules.constrains or tool_markers(engine) is None:
        return req
    from ..model.constraint import BadConstraint, tokenizer_for
    from ..model.toolcalls import tool_grammar

    try:
        spec, why = tool_grammar(engine.tokenizer, req.tools, rules,
                                 lambda: tokenizer_for(engine.tokenizer, engine.eos_ids))
    except BadConstraint as err:
        raise bad(str(err), "tool_choice" if rules.name else "tools") from None
    if spec is None:
        if not service.told_free_tools:
            service.told_free_tools = True
            service.log(f"localchat serve: strict tools and tool_choice are not enforced for "
                        f"{service.model}: {why}")
        return req
    return dataclasses.replace(req, constraint=spec)


def _cost(service: Service, req: ChatRequest) -> int:
    """An upper bound of the K/V bytes the request's turn holds in memory: a token is at
    least one byte of text (plus the template's few per message), the reply at most its cap,
    the cache in the compute dtype (float32 on the CPU path: twice the disk's float16)."""
    info = service.worker.session.engine.info()
    text = sum(len(m["content"].encode()) + 16 for m in req.messages)
    cap = req.max_tokens or service.sampling.max_tokens
    # (an image's tokens are the model's processor's to say: the whole context bounds them)
    tokens = info.context_length if req.images else min(info.context_length, text + 64 + cap)
    return 2 * info.kv_bytes_per_token * tokens + info.state_bytes


def _turn(session, req: ChatRequest, cancel, overflow: str = "stop"):
    """On the model thread: place the request in a conversation and answer it; the turn's
    events, for the scheduler to drive (``worker.py``)."""
    if req.tools and tool_markers(session.engine) is None:
        raise bad(f"{session.model_name}'s chat template has no tool calling; send the "
                  "request without tools", "tools")
    # What the request leaves out: the model's generation_config.json, then localchat's
    # defaults; a request without max_tokens still gets the reply cap /v1/models states.
    fields = session.engine.sampling().turn_fields(
        max_tokens=req.max_tokens, temp=req.temperature, top_p=req.top_p, top_k=req.top_k,
        min_p=req.min_p, repetition_penalty=req.repetition_penalty)
    options = TurnOptions(**fields, seed=req.seed, stop=req.stop, tools=req.tools,
                          context_overflow=overflow, thinking=req.thinking,
                          constraint=req.constraint)
    fresh = _store_images(session, req)
    conv, new, made = stateless.place(session, req.messages, req.api)
    try:
        # Every event goes to the scheduler: prefill chunks and decode steps are where it
        # interleaves turns; the answers read the reply's (the rest they pass over).
        yield from session.answer(conv, new, options, cancel)
    except (ContextFull, BadInput):
        if made:  # refused before anything was added: leave no trace of the request
            session.delete(conv)
        session.conversations.drop_unheld(fresh)  # (stored by this request, held by none)
        raise


def _store_images(session, req: ChatRequest) -> list[str]:
    """On the model thread: the request's images seen by the model (its processor may still
    refuse one: a 400, nothing stored), then stored once by content hash
    (``session.images.keep``); the hashes this request stored first."""
    return keep(session, [(i.data, i.picture, i.info) for i in req.images])[1]


def _count(session, req: ChatRequest) -> int:
    """``count_tokens`` on the model thread: the request's images seen (never stored)."""
    for image in req.images:
        session.engine.see(image.digest, image.picture)
    return stateless.count(session, req.messages, list(req.tools) or None)


async def _collect(events: asyncio.Queue) -> tuple[str, TurnFinished]:
    """The whole reply of a job (non-streaming answers)."""
    finished = None
    while (ev := await events.get()) is not DONE:
        if isinstance(ev, BaseException):
            raise _api_error(ev)
        if isinstance(ev, TurnFinished):
            finished = ev
    if finished is None:
        raise ApiError(500, "server", "the reply was stopped before it started")
    return finished.reply, finished


def _finish(finished: TurnFinished) -> str:
    """stop, length, stop_sequence or tool_calls (a reply cut by the client counts as stop).
    A constrained reply whose shape was complete when its cap came is whole: stop (so that a
    client that parses it, as ``openai``'s ``parse`` does, takes it); its "length" means a
    shape left incomplete."""
    if finished.finish == "length" and finished.complete and finished.usage.constrained \
            != TOOLS_CONSTRAINT:  # (free text is complete for a tools grammar: not whole)
        return "stop"
    return finished.finish if finished.finish in ("length", "stop_sequence", "tool_calls") \
        else "stop"


async def _openai_stream(service: Service, req: ChatRequest, rid: str, events: asyncio.Queue):
    created = int(time.time())
    first = True  # the first delta, whatever it holds, names the role
    hold = _hold(service, req)

    def delta(fields: dict) -> bytes:
        nonlocal first
        fields = ({"role": "assistant"} if first else {}) | fields
        first = False
        return _sse(None, openai_api.chunk(rid, created, service.model, fields))

    while (ev := await events.get()) is not DONE:
        if isinstance(ev, BaseException):
            yield _sse(None, openai_api.error(_api_error(ev)))
            return
        if isinstance(ev, ReasoningChunk):
            yield delta({"reasoning_content": ev.text})
            continue
        text = hold.add(ev.text) if isinstance(ev, ReplyChunk) else \
            hold.end() if isinstance(ev, TurnFinished) and not ev.tool_calls else ""
        if text:
            yield delta({"content": text})
        if isinstance(ev, TurnFinished):
            if first:
                yield delta({"content": ""})
            if ev.tool_calls:
                yield delta({"tool_calls": openai_api.calls(ev.tool_calls, streaming=True)})
            finish = _finish(ev)
            finish = finish if finish in ("length", "tool_calls") else "stop"
            yield _sse(None, openai_api.chunk(rid, created, service.model, {}, finish))
            if req.include_usage:
                yield _sse(None, openai_api.chunk(rid, created, service.model, {}, u=ev.usage))
            yield b"data: [DONE]\n\n"
            yield ev  # for the log line (not sent)


async def _anthropic_stream(service: Service, req: ChatRequest, rid: str,
                            events: asyncio.Queue):
    yield _sse("message_start", anthropic_api.started(rid, service.model))
    yield _sse("ping", {"type": "ping"})
    hold = _hold(service, req)
    blocks = anthropic_api.Blocks()
    while (ev := await events.get()) is not DONE:
        if isinstance(ev, BaseException):
            yield _sse("error", anthropic_api.error(_api_error(ev)))
            return
        if isinstance(ev, ReasoningChunk):
            for name, data in blocks.add("thinking", ev.text):
                yield _sse(name, data)
            continue
        text = hold.add(ev.text) if isinstance(ev, ReplyChunk) else \
            hold.end() if isinstance(ev, TurnFinished) and not ev.tool_calls else ""
        for name, data in blocks.add("text", text) if text else ():
            yield _sse(name, data)
        if isinstance(ev, TurnFinished):
            for name, data in blocks.end(ev.usage, ev.usage.bytes_written > 0, _finish(ev),
                                         ev.stop_sequence, ev.tool_calls):
                yield _sse(name, data)
            yield ev


def _hold(service: Service, req: ChatRequest) -> ToolHold:
    """The streamed text's filter: with tools offered, a call's markup is never streamed (it
    comes as the API's tool calls at the end)."""
    markers = tool_markers(service.worker.session.engine) if req.tools else None
    return ToolHold(markers[0] if markers else None)


async def _watched(service: Service, job: Job, stream, request: Request, req: ChatRequest,
                   t0: float):
    """``stream``'s bytes; a client gone (the response is cancelled) stops the turn."""
    finished = None
    try:
        async for item in stream:
            if isinstance(item, TurnFinished):
                finished = item
                continue
            yield item
    finally:
        job.cancel.set()  # (a no-op once the turn has ended)
        _log(service, req, finished, t0)


async def _disconnect(request: Request, job: Job) -> None:
    """A non-streaming request whose client goes away stops its turn."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    job.cancel.set()


# -- plumbing --------------------------------------------------------------------------------


def _authorize(service: Service, request: Request) -> None:
    if service.api_key is None:
        return
    given = request.headers.get("x-api-key") or ""
    auth = request.headers.get("authorization") or ""
    if auth.lower().startswith("bearer "):
        given = given or auth[7:].strip()
    if not given:
        raise ApiError(401, "authentication", "an API key is required (Authorization: Bearer "
                       "KEY or x-api-key: KEY)")
    if not hmac.compare_digest(given.encode(), service.api_key.encode()):
        raise ApiError(401, "authentication", "invalid API key")


async def _json(request: Request) -> object:
    """The request body as JSON, at most ``MAX_BODY`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
        raise ApiError(413, "invalid_request", f"the request body is over {MAX_BODY} bytes")
    data = bytearray()
    try:
        async for part in request.stream():
            data += part
            if len(data) > MAX_BODY:
                raise ApiError(413, "invalid_request",
                               f"the request body is over {MAX_BODY} bytes")
    except ClientDisconnect:
        raise ApiError(400, "invalid_request", "the client went away") from None
    try:
        return json.loads(bytes(data).decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:
        raise bad(f"the request body is not valid JSON ({str(err)[:80]})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _api_error(err: BaseException) -> ApiError:
    """A failure on the model thread, as an answer."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ContextFull):
        return ApiError(400, "invalid_request", f"prompt is too long: {err}",
                        param="messages", code="context_length_exceeded")
    if isinstance(err, BadInput):
        return bad(str(err))
    if isinstance(err, LocalchatError):
        return ApiError(503, "overloaded", str(err))
    log = crashlog.write(err, "localchat serve")
    return ApiError(500, "server", f"internal error; details in the server's log ({log})")


def _error(err: ApiError, api: str) -> JSONResponse:
    body = openai_api.error(err) if api == "openai" else anthropic_api.error(err)
    return JSONResponse(body, status_code=err.status)


def _sse(event: str | None, data: dict) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _log(service: Service, req: ChatRequest, finished: TurnFinished | None, t0: float) -> None:
    if finished is None:
        service.log(f"localchat serve: {req.api} stopped before the reply ended "
                    f"({time.perf_counter() - t0:.2f} s)")
        return
    u = finished.usage
    service.log(f"localchat serve: {req.api} {'stream' if req.stream else 'json'} "
                f"cached {u.cached_tokens} / prefilled {u.prefilled_tokens} · gen "
                f"{u.completion_tokens} · TTFT {u.ttft_s:.2f}s · decode {u.decode_tps:.1f} "
                f"tok/s" + (f" · {u.constrained} ({u.forced_tokens} forced)" if u.constrained
                            else "") + (f" · {u.miss_reason}" if u.miss_reason else ""))


def new_key() -> str:
    return secrets.token_urlsafe(24)
