"""The HTTP server: an OpenAI-compatible FastAPI app in front of an `Engine`.

Routes: POST /v1/chat/completions and /v1/completions (JSON or SSE streaming, a chunk per resolved
block), GET /v1/models, /health, /metrics, and the playground page at / (page.py). A request is read
(JSON only, size- and time-limited), parsed (strict types), tokenized and checked (prompts.py: in a
thread, or for a large body in a worker process, bodies.py) and validated here, so malformed input never
reaches the engine and is a 4xx, never a 5xx; the engine gets token ids and `GenerationSettings` and
sends back token ids, which `TextStream` turns into text; `logprobs` / `echo` are scored by the engine
once the completion is written (logprobs.py). A client that disconnects cancels its
request. Optional guards in front of every route: an API key and a Host allow-list (`Guard`). At
shutdown, requests still running when the grace period ends get a final shutting_down error. The
server never touches tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..cache import PoolFull
from ..engine import Engine, EngineClosed, QueueFull
from ..generation.settings import GenerationSettingsError
from ..tokenization import CloverTokenizer
from .protocol import APIError, ChatRequest, CompletionRequest, bad_request, setting_param, settings_overrides
from .bodies import BodyWorker
from .chat_tools import ChatOutput
from .logprobs import chat_logprobs, completion_logprobs
from .structured import StructuredOutput
from .openapi import document_request_bodies
from .page import FILES as PLAYGROUND_FILES, add_playground
from . import step_events
from .prompts import PREPARE, ServedModel
from .text import CONTENT, TextStream
from .text import inside_thinking as prompt_ends_thinking
from .transport import (OFF_LOOP_BYTES, CountRequests, Guard, SSEResponse, collect, off_loop, outputs, read_body,
                        silence, sse)

log = logging.getLogger("clover.server")

ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}


def create_app(engine: Engine, tokenizer: CloverTokenizer, model_name: str = "clover", *,
               max_body_bytes: int = 1 << 20, shutdown_engine: bool = True,
               shutdown_timeout: float = 30.0, max_block_size: int | None = None, api_key: str | None = None,
               allowed_hosts: list[str] | None = None, body_timeout: float | None = 30.0,
               stream_buffer_tokens: int | None = 64, stream_idle_timeout: float | None = 60.0) -> FastAPI:
    """The app. `shutdown_engine`: stop the engine (gracefully) when the app shuts down.
    `api_key`: required as a Bearer token on every route but /health (None: no authentication).
    `allowed_hosts`: Host header names accepted ("*.example.com" and "*" allowed; None: any).
    `body_timeout`: seconds a request body may take to arrive (408 after; None: no limit).
    `stream_buffer_tokens`: a stream's request stops being computed while this many of its tokens
    wait for its client (backpressure; None: never); `stream_idle_timeout`: a stream whose client
    reads nothing for this long is closed and its request cancelled (None: never).
    `max_block_size`: the largest block_size a request may ask for (None: the model's
    generation_config.json, else GenerationSettings' default)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            body_worker.close()
        if shutdown_engine:
            await asyncio.to_thread(engine.shutdown, True, shutdown_timeout)

    app = FastAPI(title="Clover", lifespan=lifespan)
    app.state.engine, app.state.tokenizer, app.state.model_name = engine, tokenizer, model_name
    # Set by begin_drain() (limits.DrainingServer calls it just before uvicorn's grace period ends):
    # every open request then ends with a 503 shutting_down error (streams: an error event and
    # [DONE]) instead of being cut off at the HTTP level.
    drain = asyncio.Event()
    app.state.begin_drain = drain.set
    app.state.api_key = api_key
    metrics = engine.metrics
    created = int(time.time())
    structured = StructuredOutput(tokenizer, engine.vocab_size)
    served = ServedModel(model_name, engine.context_limit, tokenizer.max_token_bytes)
    # Bodies over OFF_LOOP_BYTES are parsed, templated and tokenized in a worker process (bodies.py),
    # spawned on the first (`clover serve` starts it at once: app.state.body_worker.start()).
    body_worker = app.state.body_worker = BodyWorker(tokenizer, served)

    # ---- errors --------------------------------------------------------------------------------
    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       "invalid_request_error", None, kind, exc.headers))   # 405 keeps Allow

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(bad_request(str(exc.errors()[0].get("msg", exc)), None, "invalid_request"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}", "server_error",
                                       None, "internal_error"))

    app.add_middleware(Guard, api_key=api_key, allowed_hosts=allowed_hosts,
                       open_paths=("/health", *PLAYGROUND_FILES))   # the page asks for the key itself
    app.add_middleware(CountRequests, counter=metrics.http_requests, routes=ROUTES)     # outermost: counts refusals

    # ---- helpers -------------------------------------------------------------------------------
    async def prepare(request: Request, kind: str):
        """The request's body read, parsed, checked and turned into prompt ids (prompts.py): a large
        body in the worker process, so that this process only moves its bytes; a small one in a thread."""
        body = await read_body(request, max_body_bytes, body_timeout)
        if len(body) > OFF_LOOP_BYTES:
            return await body_worker.prepare(kind, body)
        return await asyncio.to_thread(PREPARE[kind], body, tokenizer, served)

    def validated(req, extra: dict, prompt_ids: list[int], prompt_param: str):
        """The request's settings resolved and checked with its prompt (`Engine.validate`, once), before a
        grammar is built for it; a refusal as a 400 naming the field."""
        over, asked = settings_overrides(req, extra)
        if max_block_size is not None:
            over["max_block_size"] = max_block_size
        max_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        try:
            settings = engine.settings(**over)
            if asked is None:
                # No max_tokens: the model's default, cut to what fits in the context.
                room = (engine.context_limit - len(prompt_ids)) // settings.block_size * settings.block_size
                if 1 <= room < settings.max_new_tokens:
                    settings = settings.replace(max_new_tokens=room)
            return engine.validate(prompt_ids, settings)
        except GenerationSettingsError as exc:
            message = str(exc)
            if "context" in message and "exceeds" in message:
                raise bad_request(message, prompt_param, "context_length_exceeded") from None
            param = setting_param(message, max_param)
            raise bad_request(message, prompt_param if param == "prompt" else param, "invalid_value") from None

    def submit(request, checked, grammar=None, stream=False, steps=False):
        # the client, for fair turns: its address (behind a proxy, every request shares the proxy's)
        client = request.client.host if request.client else None
        try:
            return engine.submit(checked, grammar=grammar, client=client, step_events=steps,
                                 buffer_tokens=(stream_buffer_tokens or None) if stream else None)
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", None, "queue_full", {"Retry-After": "1"}) from None
        except EngineClosed as exc:
            raise APIError(503, str(exc), "service_unavailable", None, "shutting_down", {"Retry-After": "5"}) from None

    def engine_error(event) -> APIError:
        if event.error_code == "shutdown":
            return APIError(503, event.error, "service_unavailable", None, "shutting_down")
        return APIError(500, event.error or "internal error", "server_error", None, "internal_error")

    def scored_prompt_error(exc: GenerationSettingsError) -> APIError:
        return bad_request(str(exc), "prompt", "context_length_exceeded" if "exceeds" in str(exc) else "invalid_value")

    async def score(ids: list[int], top_k: int):
        """Causal log-probabilities of `ids` from the engine (logprobs.py), its refusals as HTTP errors."""
        try:
            future = engine.score(ids, top_k)
        except QueueFull as exc:
            raise APIError(429, str(exc), "rate_limit_error", None, "queue_full", {"Retry-After": "1"}) from None
        except EngineClosed as exc:
            raise APIError(503, str(exc), "service_unavailable", None, "shutting_down", {"Retry-After": "5"}) from None
        except GenerationSettingsError as exc:
            raise scored_prompt_error(exc) from None
        try:
            return await asyncio.wrap_future(future)
        except EngineClosed as exc:
            raise APIError(503, str(exc), "service_unavailable", None, "shutting_down") from None
        except PoolFull as exc:        # the state pool has no room to score this many tokens now
            raise APIError(503, f"cannot score {len(ids)} tokens now: {exc}", "service_unavailable", None,
                           "cache_full", {"Retry-After": "1"}) from None
        except Exception as exc:
            raise APIError(500, f"scoring failed: {type(exc).__name__}: {exc}", "server_error", None,
                           "internal_error") from None

    def usage(handle, text: TextStream) -> dict:
        n = text.n_tokens
        return {"prompt_tokens": handle.prompt_len, "completion_tokens": n, "total_tokens": handle.prompt_len + n}

    # ---- chat ----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        prompt = await prepare(request, "chat")           # parsed, checked, templated, tokenized
        req, top_k, extra, stop, thinking, skip, steps, prompt_ids, plan = (
            prompt.req, prompt.top_k, prompt.extra, prompt.stop, prompt.thinking, prompt.skip, prompt.steps,
            prompt.ids, prompt.plan)
        output = ChatOutput(plan)
        checked = validated(req, extra, prompt_ids, "messages")
        settings = checked.settings
        inside_thinking = prompt_ends_thinking(prompt_ids, tokenizer)
        grammar = None
        constraint = structured.lark(req, plan, inside_thinking)    # response_format, tool calls
        if constraint is not None:
            grammar = await off_loop(request, structured.matcher, *constraint, settings)
        handle = submit(request, checked, grammar, req.stream, steps)
        text = TextStream(tokenizer, stop=stop, split_thinking=True, inside_thinking=inside_thinking,
                          skip_special_tokens=skip, eos_ids=settings.eos_token_id)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if not req.stream:
            reasoning, content, finish, error = await collect(request, handle, text, drain)
            if error is not None:
                raise engine_error(error)
            message = output.message(reasoning, content)
            logprobs = None
            if top_k is not None:
                ids = prompt_ids + handle.tokens[: text.n_tokens]
                logprobs = chat_logprobs(tokenizer, ids, await score(ids, top_k), len(prompt_ids))
            return {"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                    "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                 "finish_reason": output.finish_reason(finish)}],
                    "usage": usage(handle, text), "clover": handle.stats or {}}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict, finish=None) -> bytes:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

        def clover_chunk(payload: dict) -> bytes:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                        "choices": [], "clover": payload})

        async def stream():
            yield chunk(output.first_delta())
            if steps:
                yield clover_chunk(step_events.settings_echo(settings, engine.config.block_expert_top_p,
                                                             enable_thinking=thinking))
            written = 0                          # tokens the bytes sent so far stand for
            async for delta, finish, error, traced in outputs(handle, text, drain):
                if traced:
                    yield clover_chunk(step_events.steps_payload(traced, tokenizer))
                d = output.feed(delta, last=bool(finish))
                if d:
                    yield chunk(d)
                elif text.n_tokens > written and not (finish or error):
                    yield silence(text.n_tokens - written)
                written = text.n_tokens
                if error is not None:
                    yield sse(engine_error(error).body())
                    break
                if finish:
                    yield chunk({}, output.finish_reason(finish))
            if include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                           "choices": [], "usage": usage(handle, text)})
            yield b"data: [DONE]\n\n"

        return SSEResponse(stream(), handle.cancel, stream_idle_timeout)

    # ---- completions ---------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        prompt = await prepare(request, "completion")     # parsed, checked, tokenized
        req, top_k, extra, stop, skip, steps, prompt_ids = (
            prompt.req, prompt.top_k, prompt.extra, prompt.stop, prompt.skip, prompt.steps, prompt.ids)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.max_tokens == 0:        # scoring only: the prompt's log-probabilities (lm-eval's loglikelihood)
            if not req.echo:
                raise bad_request("max_tokens 0 generates nothing: it needs echo: true (the prompt, scored with "
                                  "logprobs)", "max_tokens", "invalid_value")
            logprobs = None
            if top_k is not None:                          # (score() checks the ids)
                logprobs = completion_logprobs(tokenizer, prompt_ids, [], await score(prompt_ids, top_k), echo=True)
            else:
                try:
                    engine.check_scored(prompt_ids)
                except GenerationSettingsError as exc:
                    raise scored_prompt_error(exc) from None
            n = len(prompt_ids)
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": 0, "text": tokenizer.decode(prompt_ids), "logprobs": logprobs,
                                 "finish_reason": "length"}],
                    "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}, "clover": {}}
        checked = validated(req, extra, prompt_ids, "prompt")
        settings = checked.settings
        handle = submit(request, checked, stream=req.stream, steps=steps)
        text = TextStream(tokenizer, stop=stop, skip_special_tokens=skip, eos_ids=settings.eos_token_id)

        if not req.stream:
            _, content, finish, error = await collect(request, handle, text, drain)
            if error is not None:
                raise engine_error(error)
            logprobs = None
            if top_k is not None:
                completion = handle.tokens[: text.n_tokens]
                logprobs = completion_logprobs(tokenizer, prompt_ids, completion,
                                               await score(prompt_ids + completion, top_k), echo=bool(req.echo),
                                               content=content, skip_special_tokens=skip,
                                               eos_ids=settings.eos_token_id)
            shown = (tokenizer.decode(prompt_ids) if req.echo else "") + content
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": 0, "text": shown, "logprobs": logprobs, "finish_reason": finish}],
                    "usage": usage(handle, text), "clover": handle.stats or {}}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(text_delta: str, finish=None) -> bytes:
            return sse({"id": rid, "object": "text_completion", "created": now, "model": model_name,
                        "choices": [{"index": 0, "text": text_delta, "logprobs": None, "finish_reason": finish}]})

        def clover_chunk(payload: dict) -> bytes:
            return sse({"id": rid, "object": "text_completion", "created": now, "model": model_name,
                        "choices": [], "clover": payload})

        async def stream():
            if steps:
                yield clover_chunk(step_events.settings_echo(settings, engine.config.block_expert_top_p))
            written = 0                          # tokens the bytes sent so far stand for
            async for delta, finish, error, traced in outputs(handle, text, drain):
                if traced:
                    yield clover_chunk(step_events.steps_payload(traced, tokenizer))
                if error is not None:
                    if delta[CONTENT]:
                        yield chunk(delta[CONTENT])
                    yield sse(engine_error(error).body())
                    break
                if delta[CONTENT] or finish:
                    yield chunk(delta[CONTENT], finish)
                elif text.n_tokens > written:
                    yield silence(text.n_tokens - written)
                written = text.n_tokens
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": now, "model": model_name,
                           "choices": [], "usage": usage(handle, text)})
            yield b"data: [DONE]\n\n"

        return SSEResponse(stream(), handle.cancel, stream_idle_timeout)

    # ---- the rest ------------------------------------------------------------------------------
    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "clover",
                "max_model_len": engine.context_limit}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        served.check_model(name)
        return model_card()

    @app.get("/health")
    async def health():
        body = {"status": "ok" if engine.accepting else "unavailable", "queue_depth": engine.queue_depth,
                "batch_size": engine.batch_size}
        return JSONResponse(body, status_code=200 if engine.accepting else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)

    add_playground(app)
    document_request_bodies(app, {
        "/v1/chat/completions": (ChatRequest, {"messages": [{"role": "user", "content": "What is 17+25?"}]}),
        "/v1/completions": (CompletionRequest, {"prompt": "17+25=", "max_tokens": 8})}, model_name)
    return app
