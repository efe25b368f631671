"""An OpenAI-compatible HTTP server over the continuous-batching EAGLE-2 engine (eagle2_jax.serving).

    python -m infer.serve                               # SmolLM2-135M-Instruct + its head on 127.0.0.1:8000
    python -m infer.serve --max-batch 8 --max-model-len 2048 --port 8001
    python -m infer.serve --mode vanilla                # plain decoding only (a baseline)

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the
tokenizer's chat template; `stream: true` sends server-sent events ending with `data: [DONE]`),
GET /metrics (Prometheus). Sampling is per request (temperature, top_p, top_k, seed; temperature 0,
the default, is greedy). Requests are batched continuously, each slot freed as its request ends;
each dispatch drafts the tree the head's tree.json gives for the number of busy rows, or decodes
plainly where no tree pays. Bad requests get OpenAI-shaped JSON errors and
leave the other requests alone; a client that disconnects cancels its request.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from typing import Optional

import jax
import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from tqdm import tqdm

import eagle2_jax as e2
from eagle2_jax.decoding.programs import enable_compile_cache
from eagle2_jax.serving import Engine, compile_programs
from eagle2_jax.serving.detokenize import TextStream
from eagle2_jax.serving.plan import parse_plan
from eagle2_jax.serving.worker import EngineUnavailable, Worker
from infer.protocol import ChatRequest, CompletionRequest, error_param
from infer.cli import Parser, add_backend_args, add_model_args, fail, load_models, positive_float, positive_int


_XLA_COMPILES = [0]  # every XLA compile in this process (jax.monitoring): /metrics shows none after warm-up


def _count_compile(event: str, _seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _XLA_COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message.replace("\n", " "), param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


MAX_BODY_BYTES = 8 * 2 ** 20
CHARS_PER_TOKEN_BOUND = 16  # a prompt this many characters per allowed token is checked on a prefix first


async def read_body(req: HTTPRequest, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length before reading, else while reading)."""
    declared = req.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"the request body is larger than {limit} bytes", None, "request_too_large")
    parts, size = [], 0
    async for part in req.stream():
        size += len(part)
        if size > limit:
            raise OpenAIError(413, f"the request body is larger than {limit} bytes", None, "request_too_large")
        parts.append(part)
    return b"".join(parts)


async def disconnected(req: HTTPRequest) -> None:
    """Returns once the client has gone (the server's receive channel says http.disconnect)."""
    while True:
        if (await req.receive())["type"] == "http.disconnect":
            return


def build_app(engine: Engine, tokenizer, model_name: str, queue_limit: int = 64,
              max_body_bytes: int = MAX_BODY_BYTES, on_fatal=None) -> FastAPI:
    """The ASGI app serving `engine` under the model id `model_name`. `on_fatal(reason)` is called once
    if the engine fails (the command line stops the server and exits non-zero)."""
    registry = CollectorRegistry()
    metrics = {
        "requests": Counter("eagle2_requests", "requests answered, by status", ["endpoint", "status"],
                            registry=registry),
        "tokens": Counter("eagle2_generated_tokens", "completion tokens returned", registry=registry),
        "queue": Gauge("eagle2_queue_depth", "requests waiting for a slot", registry=registry),
        "running": Gauge("eagle2_running_rows", "rows being decoded", registry=registry),
        "accept": Histogram("eagle2_accept_length", "tokens added per EAGLE-2 round", registry=registry,
                            buckets=(1, 2, 3, 4, 5, 6, 8)),
        "ttft": Histogram("eagle2_time_to_first_token_seconds", "time to first token", registry=registry),
        "compiles": Gauge("eagle2_xla_compiles", "XLA programs compiled by this process (warm-up included)",
                          registry=registry),
        "healthy": Gauge("eagle2_engine_healthy", "1 while the engine thread serves, 0 once it failed or stops",
                         registry=registry),
        "ended": Counter("eagle2_requests_ended", "requests the engine ended, by reason", ["reason"],
                         registry=registry),
    }
    metrics["compiles"].set_function(lambda: _XLA_COMPILES[0])

    def on_step(e: Engine):
        metrics["queue"].set(len(e.queue))
        metrics["running"].set(len(e.running))

    def on_ended(r):
        metrics["ended"].labels(r.finish_reason or "unknown").inc()
        for a in r.accept_lengths:
            metrics["accept"].observe(a)

    def fatal(reason: str):  # the engine is gone: a server run by serve() stops and exits non-zero
        server = getattr(app.state, "server", None)
        if server is not None:
            server.should_exit = True
        if on_fatal is not None:
            on_fatal(reason)

    worker = Worker(engine, on_fatal=fatal, on_step=on_step, on_ended=on_ended)
    plan = Gauge("eagle2_plan_tokens", "tokens verified per round at each slot bucket now (1: plain rounds)",
                 ["rows"], registry=registry)
    for b in engine.buckets:
        plan.labels(str(b)).set_function(lambda b=b: 1 if engine.plan[b] is None else engine.plan[b].total_tokens)
    Gauge("eagle2_plan_moves", "times a slot bucket moved to another tree (auto plan)", registry=registry
          ).set_function(lambda: engine.planner.moves if engine.planner is not None else 0)
    metrics["healthy"].set_function(lambda: float(worker.healthy))
    eos = tokenizer.eos_token_id

    @contextlib.asynccontextmanager
    async def lifespan(_):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)  # every live request ends; the engine thread is joined

    app = FastAPI(title="eagle2-jax", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions decoded with EAGLE-2.")

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(Exception)
    async def _internal_error(_, e: Exception):  # a bug of ours: still an OpenAI-shaped body, one line
        return error_response(OpenAIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error"))

    @app.get("/health")
    async def health():
        if worker.healthy:
            return {"status": "ok"}
        return JSONResponse({"status": "error", "error": worker.error or "the server is shutting down"},
                            status_code=503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "eagle2-jax"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    max_len = engine.max_len

    def prompt_ids(text: str, param: str) -> list:
        """Token ids of `text`, refused as too long from a prefix when the text is far longer than
        max_len tokens could be (so a huge body is not tokenised whole)."""
        bound = max_len * CHARS_PER_TOKEN_BOUND
        if len(text) > bound and len(tokenizer.encode(text[:bound], add_special_tokens=False)) > max_len + 16:
            raise OpenAIError(400, f"the prompt is longer than this server's {max_len} tokens "
                                   f"(--max-model-len)", param)
        return tokenizer.encode(text, add_special_tokens=False)

    def prepare(raw: bytes, endpoint: str):
        """(checked request model, prompt ids, engine request) from a body, or OpenAIError. Runs in a
        worker thread: JSON, the chat template and the tokenizer never block the event loop."""
        model = ChatRequest if endpoint == "chat" else CompletionRequest
        try:
            body = model.model_validate_json(raw)
        except ValidationError as e:
            raise OpenAIError(400, *error_param(e)) from None
        if body.model not in (None, model_name):
            raise OpenAIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                              "model", "not_found_error")
        if endpoint == "chat":
            msgs = [{"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})} for m in body.messages]
            try:
                text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - the template's own rule (e.g. roles must alternate)
                raise OpenAIError(400, f"messages: the chat template refused them: {e}", "messages") from None
            ids, param = prompt_ids(text, "messages"), "messages"
        else:
            p = body.one_prompt
            ids, param = (prompt_ids(p, "prompt") if isinstance(p, str) else list(p)), "prompt"
        if not ids:
            raise OpenAIError(400, f"{param}: the prompt is empty", param)
        m = body.max_tokens if endpoint == "completions" else (body.max_completion_tokens or body.max_tokens)
        m_param = "max_completion_tokens" if endpoint == "chat" and body.max_completion_tokens else "max_tokens"
        if m is None:  # OpenAI's defaults, within what the context leaves
            m = max(1, min(16 if endpoint == "completions" else 256, max_len - len(ids)))
        if len(ids) >= max_len:
            raise OpenAIError(400, f"{param}: the prompt has {len(ids)} tokens; this server takes at most "
                                   f"{max_len - 1} (--max-model-len {max_len})", param)
        V = engine.target.config.vocab_size
        if param == "prompt" and max(ids) >= V:
            raise OpenAIError(400, f"prompt: token ids must be below the vocabulary size {V}", "prompt")
        try:
            r = engine.request(ids, m, [eos] if eos is not None else [], temperature=body.temperature,
                               top_p=body.top_p, top_k=max(body.top_k, 0), seed=body.seed)
        except ValueError as e:
            raise OpenAIError(400, str(e), m_param if "max_new_tokens" in str(e) else None) from None
        return body, ids, r

    async def complete(req: HTTPRequest, endpoint: str):
        try:
            raw = await read_body(req, max_body_bytes)
            body, ids, r = await asyncio.to_thread(prepare, raw, endpoint)
            if worker.waiting >= queue_limit:
                raise OpenAIError(429, "the request queue is full; retry later", None, "rate_limit_error")
            loop = asyncio.get_running_loop()
            chunks: asyncio.Queue = asyncio.Queue()
            r.on_tokens = lambda new: loop.call_soon_threadsafe(chunks.put_nowait, list(new))
            r.on_done = lambda: loop.call_soon_threadsafe(chunks.put_nowait, None)
            try:
                worker.submit(r)
            except EngineUnavailable as e:
                raise OpenAIError(503, str(e), None, "service_unavailable") from None
        except OpenAIError as e:
            metrics["requests"].labels(endpoint, str(e.status)).inc()
            raise
        t0 = time.perf_counter()
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        text = TextStream(tokenizer, body.stops)
        gone = asyncio.ensure_future(disconnected(req))

        async def pieces():
            """The answer's text as it becomes safe to send; ends when the request does. A client that
            goes away cancels the request (taken before the engine's next dispatch)."""
            first = True
            try:
                while True:
                    get = asyncio.ensure_future(chunks.get())
                    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()
                        worker.cancel(r)
                        return
                    new = get.result()
                    if new is None:
                        break
                    if first:
                        metrics["ttft"].observe(time.perf_counter() - t0)
                        first = False
                    fresh = "".join(text.push(t) for t in new if not text.stopped)
                    if text.stopped:  # a stop string: the text ends before it (as OpenAI cuts), the request stops
                        worker.cancel(r)
                        if fresh:
                            yield fresh
                        return
                    if fresh:
                        yield fresh
                if r.finish_reason == "error":
                    raise OpenAIError(500 if worker.healthy else 503, r.error or "the request failed", None,
                                      "internal_error" if worker.healthy else "service_unavailable")
                fresh = text.finish()
                if fresh:
                    yield fresh
            finally:
                if not r.finished:
                    worker.cancel(r)

        def finish_reason():
            return "stop" if text.stopped or r.finish_reason == "stop" else "length"

        def usage():
            return {"prompt_tokens": len(ids), "completion_tokens": text.used,
                    "total_tokens": len(ids) + text.used}

        def count_done(status: int):
            metrics["requests"].labels(endpoint, str(status)).inc()
            metrics["tokens"].inc(text.used)

        if not body.stream:
            try:
                answer = "".join([p async for p in pieces()])
            except OpenAIError as e:
                count_done(e.status)
                raise
            finally:
                gone.cancel()
            count_done(200)
            if endpoint == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": answer},
                          "finish_reason": finish_reason()}
            else:
                choice = {"index": 0, "text": answer, "logprobs": None, "finish_reason": finish_reason()}
            return {"id": rid, "object": "chat.completion" if endpoint == "chat" else "text_completion",
                    "created": created, "model": model_name, "choices": [choice], "usage": usage()}

        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"

        def event(payload: dict) -> str:
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                          **payload}) + "\n\n"

        def delta(piece=None, finish=None) -> str:
            if endpoint == "chat":
                choice = {"index": 0, "delta": {"content": piece} if piece is not None else {},
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            return event({"choices": [choice]})

        async def stream():
            status = 200
            try:
                if endpoint == "chat":
                    yield event({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
                async for piece in pieces():
                    yield delta(piece)
                if gone.done():
                    status = 499  # the client closed the connection
                    return
                yield delta(None, finish_reason())
                if body.include_usage:  # OpenAI's last chunk: usage only
                    yield event({"choices": [], "usage": usage()})
            except OpenAIError as e:  # the headers are out: the error travels as an event
                status = e.status
                yield "data: " + json.dumps(e.body()) + "\n\n"
            finally:
                gone.cancel()
                count_done(status)
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest),
              responses={200: {"description": "a text_completion object, or server-sent events when stream is true"},
                         400: {"description": "an OpenAI-shaped error naming the field"}})
    async def completions(req: HTTPRequest):
        return await complete(req, "completions")

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatRequest),
              responses={200: {"description": "a chat.completion object, or server-sent events when stream is true"},
                         400: {"description": "an OpenAI-shaped error naming the field"}})
    async def chat(req: HTTPRequest):
        return await complete(req, "chat")

    _openapi_components(app, (CompletionRequest, ChatRequest))
    app.state.worker = worker
    return app


_REF = "#/components/schemas/{model}"


def _request_body(model) -> dict:
    """The OpenAPI request body of an endpoint that validates `model` itself (off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def _openapi_components(app: FastAPI, models) -> None:
    """Add the request models (and the models they use) to the app's OpenAPI components."""
    build = app.openapi

    def openapi():
        if app.openapi_schema is None:
            spec = build()
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                s = m.model_json_schema(ref_template=_REF)
                schemas.update(s.pop("$defs", {}))
                schemas[m.__name__] = s
            app.openapi_schema = spec
        return app.openapi_schema
    app.openapi = openapi


class _Server(uvicorn.Server):
    """uvicorn's server that, on SIGINT / SIGTERM, also asks the engine to stop at once: its waiting
    clients are answered, so the graceful shutdown has no stream left to wait for."""

    def __init__(self, config, worker: Worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig, frame):
        self.worker.request_stop()
        super().handle_exit(sig, frame)


def serve(app: FastAPI, host: str, port: int, graceful_s: float = 10.0) -> int:
    """Run the app until SIGINT / SIGTERM or an engine failure; 0, or 1 when the engine failed."""
    worker: Worker = app.state.worker
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                    timeout_graceful_shutdown=graceful_s), worker)
    app.state.server = server
    server.run()
    if worker.error is not None:
        print(f"error: {worker.error}", file=sys.stderr)
        return 1
    return 0


def plan_arg(text: str):
    try:
        return parse_plan(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> Parser:
    ap = Parser(prog="python -m infer.serve", description=__doc__)
    add_model_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    ap.add_argument("--mode", choices=["eagle", "vanilla"], default="eagle",
                    help="eagle: EAGLE-2 rounds, the tree for each load from --plan (plain rounds where no tree "
                         "pays); vanilla: plain decoding only (default eagle)")
    ap.add_argument("--plan", type=plan_arg, default=None,
                    help="the tree per number of busy rows: 'auto' (time candidate trees and plain rounds at "
                         "warm-up on this device, adapt to the accept lengths seen), 'head' (the head's tree.json "
                         "table; auto where it has none: the default), or a table such as 1=5/10/60,4=plain")
    ap.add_argument("--max-batch", type=positive_int, default=4,
                    help="slots decoded together; a dispatch computes the power of two covering the busy ones "
                         "(default 4)")
    ap.add_argument("--max-model-len", type=positive_int, default=1024,
                    help="longest prompt + max_tokens a request may ask for (default 1024)")
    ap.add_argument("--max-body-mb", type=positive_float, default=MAX_BODY_BYTES / 2 ** 20,
                    help="largest request body accepted, in MiB; larger ones get 413 before they are read "
                         f"(default {MAX_BODY_BYTES // 2 ** 20})")
    ap.add_argument("--rounds-per-dispatch", type=positive_int, default=4,
                    help="EAGLE-2 rounds per device dispatch before new arrivals are admitted and tokens are sent "
                         "(default 4)")
    ap.add_argument("--dispatch-ahead", action=argparse.BooleanOptionalAction, default=True,
                    help="launch the next dispatch before handing out the last one's tokens, so the device computes "
                         "while the host works (default on)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile every program the server runs for --model's shape without weights (random:<shape> "
                         "or a config.json: abstract params, nothing allocated) into the persistent compile cache, "
                         "then exit: warms a cache before a deployment")
    ap.add_argument("--mesh", default=None, help="device mesh, e.g. 'data=2,model=4' (default: one device)")
    add_backend_args(ap, attention=False, gpu_graphs=False)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    cache = enable_compile_cache()
    try:
        mesh = e2.parse_mesh(args.mesh)
    except ValueError as e:
        fail(str(e))
    if args.compile_only:
        try:
            target = e2.load_target(args.model, dtype=args.dtype, abstract=True, tokenizer=False, mesh=mesh,
                                    layers=None if args.layer_layout == "auto" else args.layer_layout)
            draft = e2.init_draft(target) if args.draft in ("auto", "random") else e2.load_draft(args.draft, target)
        except (e2.CheckpointError, ValueError) as e:
            fail(str(e))
        bar = tqdm(desc="compiling", unit="program")
        n = compile_programs(target, draft, slots=args.max_batch, max_len=args.max_model_len, mode=args.mode,
                             tree=args.plan, progress=lambda what: bar.update(1))
        bar.close()
        print(f"compiled {n} programs for {args.model}" + (f" into {cache}" if cache else ""))
        return
    target, draft = load_models(args, need_draft=True, mesh=mesh)
    if target.tokenizer is None:
        raise SystemExit("error: the model has no tokenizer: serve a named model, an HF directory or a .gguf")
    engine = Engine(target, draft, slots=args.max_batch, max_len=args.max_model_len, mode=args.mode, plan=args.plan,
                    eos_token_id=target.tokenizer.eos_token_id, rounds_per_dispatch=args.rounds_per_dispatch,
                    ahead=args.dispatch_ahead)
    bar = tqdm(desc="compiling" + (" and timing the plan's candidates" if engine.auto else ""), unit="program")
    engine.warmup(progress=lambda what: bar.update(1))
    bar.close()
    print("plan: " + engine.describe_plan(), flush=True)
    name = args.model if "/" not in args.model else args.model.rstrip("/").split("/")[-1]
    app = build_app(engine, target.tokenizer, name, max_body_bytes=int(args.max_body_mb * 2 ** 20))
    sys.exit(serve(app, args.host, args.port))


if __name__ == "__main__":
    main()
