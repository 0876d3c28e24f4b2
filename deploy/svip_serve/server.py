"""The Serve deployment: an OpenAI-compatible FastAPI ingress whose every replica drives one SVIP
pipeline (a target and a draft actor in the replica's placement group, over gRPC on the node's
loopback). Requests become GenerationRequests, tokens stream back as server-sent events."""


import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from svip_common.contracts import GenerationRequest
from svip_common.errors import InvalidRequest, Overloaded, SvipError, WorkerUnavailable
from svip_common.heap import freeze_heap
from svip_common.kv_sizes import whole_pages
from svip_common.randomness import choices
from svip_serve.admission import RETRY_AFTER_S, Admission, Slot
from svip_serve.auth import ApiKeys, sharing_scope
from svip_serve.compile_budget import CompileBudget
from svip_serve.draining import DrainWatch
from svip_serve.fresh_stats import WORKER_STATS_FRESH_S, FreshStats
from svip_serve.generation import Generation, merged
from svip_serve.protocol import (
    ApiError,
    ApiRequest,
    bad,
    choices_body,
    chunk_body,
    new_id,
    parse_chat,
    parse_completion,
    parse_json,
    usage,
    usage_chunk,
)
from svip_serve.settings import DRAFT_BUNDLE, TARGET_BUNDLE, ServeSettings
from svip_serve.shaping import RequestShaping
from svip_serve.tools import CallStream, finish_reason

# no /docs, /redoc or /openapi.json: the API faces the network, and its shape is OpenAI's
api = FastAPI(title="svip", summary="SVIP speculative decoding, OpenAI-compatible",
              docs_url=None, redoc_url=None, openapi_url=None)
log = logging.getLogger("svip_serve")


@api.exception_handler(ApiError)
async def _on_api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@api.exception_handler(HTTPException)
async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     type_="invalid_request_error" if exc.status_code < 500 else "server_error")
    return JSONResponse(error.body(), status_code=exc.status_code)


@api.exception_handler(Exception)
async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug answers 500 with a request id; the detail goes to the server's log, never the client."""
    return JSONResponse(_internal_error(exc, f"{request.method} {request.url.path}").body(), status_code=500)


def _internal_error(exc: BaseException, where: str) -> ApiError:
    request_id = uuid.uuid4().hex
    log.error("request %s (%s) failed", request_id, where, exc_info=exc)
    return ApiError(500, f"internal server error (request id {request_id}; the detail is in the server's log)",
                    type_="server_error", code="internal_error")


async def _json_body(request: Request, limit: int, deadline_s: float, parse_pool) -> object:
    """The body, read up to ``limit`` bytes (413 past it) within ``deadline_s`` (408 past it: a
    slow upload holds no place for long), parsed off the event loop (400 when it is not JSON)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    try:
        raw = await asyncio.wait_for(_read_body(request, limit), deadline_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body was not received within {deadline_s:g} s",
                       code="request_timeout") from None
    return await asyncio.get_running_loop().run_in_executor(parse_pool, parse_json, raw)


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"the request body is larger than this server's limit of {limit} bytes", code="request_too_large"
    )


async def _all_or_none(runs: list) -> list:
    """Every choice's text; one that fails cancels the others (their sessions end) and raises."""
    tasks = [asyncio.ensure_future(run) for run in runs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _deltas(kind: str, rid: str, model: str, created: int, index: int, text: str | None, calls: CallStream | None,
            logprobs: dict | None) -> list[dict]:
    """A choice's chunks for a piece of its text (None: its end), the text read for tool calls where
    the request has tools; the piece's logprobs on the first (on an empty delta where the reader
    holds the text back)."""
    if calls is None:
        return [] if text is None else [chunk_body(kind, rid, model, created, text, index=index, logprobs=logprobs)]
    parts = calls.finish() if text is None else calls.feed(text)
    if not parts and logprobs is not None:
        parts = [(None, None)]
    return [chunk_body(kind, rid, model, created, content, index=index, logprobs=logprobs if k == 0 else None,
                       calls=entries) for k, (content, entries) in enumerate(parts)]


def _usage(generations: list[Generation]) -> dict:
    """A request's usage: its prompt once, every choice's tokens."""
    return usage(len(generations[0].request.prompt_ids), sum(g.completion_tokens for g in generations))


def workers_body(stats: dict, restarts: int) -> dict:
    """/v1/svip/workers' answer from the workers' WorkerStats (role -> stats): their load alone."""
    out = {role: {"open_sessions": s.open_sessions, "cached_tokens": s.cached_tokens,
                  "tokens_processed": s.tokens_processed, "kv_pages_used": s.kv_pages_used,
                  "kv_pages_total": s.kv_pages_total, "kv_page_tokens": s.kv_page_tokens,
                  "test_hooks": list(s.test_hooks) or None}  # never set in production: seen if they are
           for role, s in stats.items()}
    target = stats["target"]
    out["target"].update(restarts=restarts, draft_replacements=target.draft_replacements,
                         draft_lost=target.draft_lost or None)
    return out


def _sse_text(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _api_error(exc: BaseException, where: str) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return bad(str(exc))
    if isinstance(exc, Overloaded):  # the workers' own admission (a request that passed the replica's)
        log.warning("%s: %s", where, exc)
        return ApiError(
            429,
            "server busy: the model workers have no room for this request now; retry later",
            type_="rate_limit_error",
            code="server_busy",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, WorkerUnavailable):
        log.warning("%s: %s", where, exc)
        return ApiError(
            503,
            "the model workers are unavailable; retry shortly",
            type_="server_error",
            code="worker_unavailable",
            headers={"Retry-After": "5"},
        )
    return _internal_error(exc, where)


class _SlotStreamingResponse(StreamingResponse):
    """A stream that gives back its admission slot however it ends, even if never started."""

    def __init__(self, content, slot: Slot):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._slot = slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()


# Serve pickles the class when the decorator runs: every helper it uses is defined above.
@serve.deployment(name="SVIPServer")
@serve.ingress(api)
class SVIPServer:
    def __init__(self, settings: ServeSettings):
        from ray.util import get_current_placement_group

        from coordinator.cluster import WorkerPair, keep_serve_grpc_on_loopback
        from coordinator.distributed import DistributedEngine
        from svip_serve.metrics import ServeMetrics

        keep_serve_grpc_on_loopback()
        self.settings = settings
        config = settings.pair_config()
        self.pair = WorkerPair(config, placement=get_current_placement_group(), bundles=(TARGET_BUNDLE, DRAFT_BUNDLE))
        self.api_keys = ApiKeys(settings.api_key_sha256)
        # parsing a body and tokenizing a long prompt take a while: never on the event loop that
        # streams every session, and each on a thread of its own, so that bodies queued for parsing
        # never wait behind a long prompt's tokenizing (review M6)
        self._parse_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="parse")
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.info = self.pair.target_info
        self.target_path, self.draft_path = config.target, config.draft
        self.engine = DistributedEngine.for_pair(self.pair, settings.pipeline)
        self.shaping = RequestShaping(settings, self.info.tokenizer, self.pair.limits.positions,
                                      self.pair.limits.kv_tokens, self.engine.resolve)
        self._connected = False
        self._connect_lock = asyncio.Lock()
        self.metrics = ServeMetrics(settings.served_name)
        self.admission = Admission(
            settings.max_in_flight,
            settings.max_waiting,
            self.pair.limits.kv_tokens,
            self.metrics.set_load,
            max_wait_s=settings.max_wait_s,
            max_per_key=settings.max_requests_per_key,
            max_kv_per_key=settings.max_kv_tokens_per_key,
        )
        self.created = int(time.time())
        self.policy_defaults = settings.policy_defaults()
        self._parse_chat = functools.partial(parse_chat, tool_parser=settings.tool_call_parser)
        self.compile_budget = CompileBudget(settings.max_grammar_compile_ms / 1000)
        self._health: str | None = None  # the last health check's finding: ok, recovering, unavailable
        self._worker_stats = FreshStats(WORKER_STATS_FRESH_S)
        self._health_lock = asyncio.Lock()
        # `svip serve` given SIGTERM or SIGINT asks its replicas to drain (svip_serve/draining.py)
        replica = serve.get_replica_context().replica_id.unique_id
        self.drain = DrainWatch(replica, lambda: self.admission.running + self.admission.waiting)
        freeze_heap()  # the tokenizer's tables and the modules: never traversed again mid-stream (svip_common/heap.py)

    async def _engine(self):
        if not self._connected:
            async with self._connect_lock:
                if not self._connected:
                    await self.engine.connect()
                    self._connected = True
        return self.engine

    async def check_health(self) -> None:
        """Serve's replica health check: a lost worker fails it, and Serve replaces the replica
        (its worker actors go with it). What it finds is stored: /health answers from it."""
        self.drain.ensure_started()
        try:
            self._health = await self._check_workers()
        except BaseException:
            self._health = "unavailable"
            raise

    async def _check_workers(self) -> str:
        """The workers' state, "ok" or "recovering" (an exception: unavailable), and their gauges."""
        engine = await self._engine()
        if (why := await engine.unavailable()) is not None:  # a lost target's replacement runs in the background;
            raise RuntimeError(why)  # this: it could not be had
        if engine.recovering:
            return "recovering"  # healthy while a replacement target loads (its own deadline ends it either way)
        stats = await engine.worker_stats()
        self.metrics.set_workers(stats)  # the KV-cache gauges, every health period
        self.metrics.set_restarts({"target": engine.recoveries.restarts, "draft": stats["target"].draft_replacements})
        self.metrics.set_draft_lost(self.draft_path is not None and bool(stats["target"].draft_lost))
        self.metrics.set_auto(stats["target"])
        return "ok"

    async def _stored_health(self) -> str:
        """The last health check's finding; before Serve's first check, one check (shared by the
        calls that come meanwhile)."""
        if self._health is None:
            async with self._health_lock:
                if self._health is None:
                    try:
                        await self.check_health()
                    except Exception as exc:  # noqa: BLE001 - stored as unavailable; the reason goes to the log
                        log.warning("health: %s", exc)
        return self._health

    # --- endpoints ------------------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """Open to anyone: the status and the load, never why (that is logged: it names workers).
        The status is the last health check's (every health_check_period_s), so a call costs no
        worker any work (review N4: each waited on the target's compute thread)."""
        self.drain.ensure_started()
        status = await self._stored_health()
        if status == "unavailable":
            return JSONResponse({"status": "unavailable"}, status_code=503)
        if self.drain.draining:  # a balancer stops routing here; the requests in flight go on
            return JSONResponse({"status": "draining", "running": self.admission.running,
                                 "waiting": self.admission.waiting}, status_code=503)
        return JSONResponse(
            {
                "status": status,
                "model": self.settings.served_name,
                "running": self.admission.running,
                "waiting": self.admission.waiting,
            }
        )

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self.api_keys.check(request.headers.get("authorization"))
        card = {
            "id": self.settings.served_name,
            "object": "model",
            "created": self.created,
            "owned_by": "svip",
            "speculative": self.draft_path is not None,
            "max_model_len": self.engine.limits.positions,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @api.get("/v1/svip/workers")
    async def workers(self, request: Request) -> JSONResponse:
        """This replica's workers: open sessions, cached tokens and KV pages (none used when idle).
        Counted against the key as a request is; concurrent calls share one probe of the workers,
        and a probe serves every call within WORKER_STATS_FRESH_S of it. What tells of other
        tenants' sessions (the prompt tokens sessions shared, the pair's learnt `auto` state) is
        the operator's: on the metrics port only (review H-1)."""
        key = self.api_keys.check(request.headers.get("authorization"))
        ticket = self.admission.enter(key)
        try:
            stats = await self._worker_stats.get(await self._engine())
        finally:
            ticket.release()
        return JSONResponse(workers_body(stats, self.engine.recoveries.restarts))

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, parse_completion)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, self._parse_chat)

    # --- one request ----------------------------------------------------------------------------

    async def _serve(self, http: Request, parse):
        arrived = time.monotonic()
        key = self.api_keys.check(http.headers.get("authorization"))
        self.drain.ensure_started()
        if self.drain.draining:
            self.metrics.record_rejected("busy")
            raise ApiError(503, "the server is shutting down: it takes no new requests; retry on another",
                           type_="server_error", code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            ticket = self.admission.enter(key)  # counted from here: parsing and tokenizing count too
        except ApiError:
            self.metrics.record_rejected("busy")
            raise
        try:
            req, request = await self._read_request(http, parse, key)
            request = dataclasses.replace(request, cache_scope=sharing_scope(key, req.cache_salt))
            try:
                engine = await self._engine()
            except SvipError as exc:
                raise _api_error(exc, "connect") from None
            try:
                prompt = len(request.prompt_ids)  # by use: the prompt's pages; its key's share counts all of it
                slot = self.admission.reserve(req.n * whole_pages(prompt + 1), ticket,  # each choice its own
                                              worst_kv_tokens=req.n * whole_pages(prompt + request.max_new_tokens))
            except ApiError:
                self.metrics.record_rejected("busy")
                raise
        except BaseException:
            ticket.release()
            raise
        try:
            await slot.admitted()  # a stream too: a 429 after waiting is a status, not an event
        except ApiError:
            self.metrics.record_rejected("busy")
            raise
        echo = None
        if req.echo:
            echo = req.prompt if isinstance(req.prompt, str) else self.info.tokenizer.decode(req.prompt)
        generations = [Generation(engine, r, self.info.tokenizer, req.stop, echo, score_only=req.max_tokens == 0)
                       for r in choices(request, req.n)]
        rid = new_id(req.kind)
        if req.stream:
            return _SlotStreamingResponse(self._stream(req, generations, rid, slot, arrived), slot)
        try:
            async with slot:
                texts = await _all_or_none([g.run() for g in generations])
        except (SvipError, ApiError) as exc:
            raise _api_error(exc, rid) from None
        for generation in generations:
            self._record(generation, arrived)
        return JSONResponse(
            choices_body(
                req.kind,
                rid,
                self.settings.served_name,
                [(text, g.finish_reason, g.stats(), g.logprobs(req.kind)) for text, g in zip(texts, generations)],
                _usage(generations),
                req.tools,
            )
        )

    async def _read_request(self, http: Request, parse, key: str | None) -> tuple[ApiRequest, GenerationRequest]:
        """The body read, parsed and checked, the prompt tokenized: the request as the client sent
        it and as it runs. ApiError for whatever this deployment refuses."""
        try:
            body = await _json_body(
                http, self.settings.max_request_bytes, self.settings.body_read_timeout_s, self._parse_pool
            )
            loop = asyncio.get_running_loop()  # off the event loop: compiling a request's grammar takes a while
            req = await loop.run_in_executor(self._parse_pool, self.compile_budget.parse, key, parse, body,
                                             self.policy_defaults)
            self.shaping.check_model(req.model)
            self.shaping.check(req)
            request = await loop.run_in_executor(self._tokenizer_pool, self.shaping.generation_request, req)
        except ApiError as exc:
            self.metrics.record_rejected("invalid")
            raise exc
        return req, request

    async def _stream(self, req: ApiRequest, generations: list[Generation], rid: str, slot: Slot, arrived: float):
        """Each choice's text as it settles, tagged with its index; a choice's last chunk carries its
        finish reason and svip stats. The usage of all is sent once: with stream_options'
        include_usage as OpenAI sends it (``usage: null`` on every chunk, the counts in a last chunk
        whose choices are empty), so clients that add chunks up count each token once; without it,
        on the last choice's last chunk."""
        model, created, ended = self.settings.served_name, int(time.time()), 0

        def sse(obj: dict) -> str:
            if req.include_usage:
                obj.setdefault("usage", None)
            return _sse_text(obj)

        calls = [None if req.tools is None else CallStream(req.tools) for _ in generations]
        try:
            async with slot:  # admitted already: this only releases the place at the end
                if req.kind == "chat":
                    for index, stream in enumerate(calls):
                        yield sse(chunk_body(req.kind, rid, model, created, "", first=True, index=index,
                                              calls=stream and stream.opening()))
                unechoed = {i for i, g in enumerate(generations) if g.echo}  # a completion's echo: the prompt first,
                async for index, delta in merged(generations):  # once its prefill scored it (with logprobs)
                    if index in unechoed:
                        unechoed.discard(index)
                        generation = generations[index]
                        yield sse(chunk_body(req.kind, rid, model, created, generation.echo, index=index,
                                              logprobs=generation.echo_logprobs(req.kind)))
                    if delta is not None and generations[index].score_only:
                        continue  # max_tokens 0: the one token the prefill settles is not the answer's
                    if delta is not None:
                        for chunk in _deltas(req.kind, rid, model, created, index, delta, calls[index],
                                             generations[index].logprobs_chunk(req.kind)):
                            yield sse(chunk)
                        continue
                    for chunk in _deltas(req.kind, rid, model, created, index, None, calls[index], None):
                        yield sse(chunk)
                    generation, ended = generations[index], ended + 1
                    reason = finish_reason(generation.finish_reason, calls[index] is not None and calls[index].called)
                    last = chunk_body(req.kind, rid, model, created, None, reason, index=index,
                                      logprobs=generation.logprobs_chunk(req.kind, final=True))
                    if ended == len(generations) and not req.include_usage:
                        last["usage"] = _usage(generations)
                    last["svip"] = generation.stats()
                    yield sse(last)
                if req.include_usage:
                    yield sse(usage_chunk(req.kind, rid, model, created, _usage(generations), generations[0].stats()))
                for generation in generations:
                    self._record(generation, arrived)
        except asyncio.CancelledError:  # the client went away: nobody to tell
            raise
        except Exception as exc:  # after the text already sent: an error event, then the end
            yield _sse_text(_api_error(exc, rid).body())
        yield "data: [DONE]\n\n"

    def _record(self, generation: Generation, arrived: float) -> None:
        ttft = generation.first_token_at - arrived if generation.first_token_at is not None else None
        self.metrics.record_generation(
            generation.result.stats,
            len(generation.request.prompt_ids),
            generation.completion_tokens,
            generation.finish_reason,
            time.monotonic() - arrived,
            ttft,
        )
