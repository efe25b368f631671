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

import asyncio
import contextlib
import json
import threading
import time
import uuid
from typing import Optional

import jax
import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from tqdm import tqdm

import eagle2_jax as e2
from eagle2_jax.programs import enable_compile_cache
from eagle2_jax.serving import Engine, compile_programs
from infer.cli import Parser, add_backend_args, add_model_args, fail, load_models, positive_int


_XLA_COMPILES = [0]  # every XLA compile in this process (jax.monitoring): /metrics shows none after warm-up


def _count_compile(event: str, _seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _XLA_COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": None}},
                        status_code=e.status)


class Worker:
    """The engine's host loop in a thread of its own; HTTP handlers submit and cancel through it."""

    def __init__(self, engine: Engine, metrics: dict):
        self.engine, self.metrics = engine, metrics
        self.live: set = set()  # submitted requests whose waiters have not been told they ended
        self.lock = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        self.thread.join(timeout=30)

    def submit(self, prompt, max_tokens, stop_ids, on_tokens, on_done, **sampling):
        with self.lock:
            r = self.engine.submit(prompt, max_tokens, stop_ids=stop_ids, on_tokens=on_tokens, on_done=on_done,
                                   **sampling)
            self.live.add(r)
            self.lock.notify_all()
            return r

    def cancel(self, r):
        with self.lock:
            self.engine.cancel(r)
            self._tell_ended()

    def _tell_ended(self):
        for r in [r for r in self.live if r.finished]:
            self.live.discard(r)
            for a in r.accept_lengths:
                self.metrics["accept"].observe(a)
            r.on_done()

    def _loop(self):
        while True:
            with self.lock:
                while self.engine.idle and not self.stopping:
                    self.lock.wait()
                if self.stopping:
                    return
                self.engine.step()
                self.metrics["queue"].set(len(self.engine.queue))
                self.metrics["running"].set(len(self.engine.running))
                self._tell_ended()


def build_app(engine: Engine, tokenizer, model_name: str, queue_limit: int = 64) -> FastAPI:
    """The ASGI app serving `engine` under the model id `model_name`."""
    registry = CollectorRegistry()
    metrics = {
        "requests": Counter("eagle2_requests", "requests received", ["endpoint", "status"], registry=registry),
        "tokens": Counter("eagle2_generated_tokens", "completion tokens generated", registry=registry),
        "queue": Gauge("eagle2_queue_depth", "requests waiting for a slot", registry=registry),
        "running": Gauge("eagle2_running_rows", "rows being decoded", registry=registry),
        "accept": Histogram("eagle2_accept_length", "tokens added per EAGLE-2 round", registry=registry,
                            buckets=(1, 2, 3, 4, 5, 6, 8)),
        "ttft": Histogram("eagle2_time_to_first_token_seconds", "time to first token", registry=registry),
        "compiles": Gauge("eagle2_xla_compiles", "XLA programs compiled by this process (warm-up included)",
                          registry=registry),
    }
    metrics["compiles"].set_function(lambda: _XLA_COMPILES[0])
    worker = Worker(engine, metrics)
    eos = tokenizer.eos_token_id

    @contextlib.asynccontextmanager
    async def lifespan(_):
        worker.start()
        yield
        worker.stop()  # SIGINT / SIGTERM: uvicorn stops taking requests, then the engine thread ends

    app = FastAPI(title="eagle2-jax", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, e: OpenAIError):
        return error_response(e)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "eagle2-jax"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    async def parse(req: HTTPRequest, endpoint: str) -> dict:
        try:
            body = json.loads(await req.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise OpenAIError(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        if body.get("model", model_name) != model_name:
            raise OpenAIError(404, f"the model {body.get('model')!r} does not exist; this server serves "
                                   f"{model_name!r}", "model", "not_found_error")
        n = body.get("n", 1)
        if n != 1:
            raise OpenAIError(400, "only n=1 is supported", "n")
        t = body.get("temperature", 0)
        if not isinstance(t, (int, float)) or t < 0:
            raise OpenAIError(400, f"temperature must be a number >= 0, got {t!r}", "temperature")
        p = body.get("top_p", 1)
        if not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise OpenAIError(400, f"top_p must be in (0, 1], got {p!r}", "top_p")
        k = body.get("top_k", 0)  # not OpenAI's; vLLM and SGLang take it (-1 or 0: off)
        if not isinstance(k, int) or isinstance(k, bool) or k < -1:
            raise OpenAIError(400, f"top_k must be an integer >= -1, got {k!r}", "top_k")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 32):
            raise OpenAIError(400, f"seed must be an integer in [0, 2**32), got {seed!r}", "seed")
        m = body.get("max_tokens", body.get("max_completion_tokens", 16 if endpoint == "completions" else 256))
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise OpenAIError(400, f"max_tokens must be a positive integer, got {m!r}", "max_tokens")
        # the values as checked, whichever field or default gave them
        return {**body, "max_tokens": m, "sampling": dict(temperature=float(t), top_p=float(p), top_k=max(k, 0),
                                                          seed=seed)}

    def encode(body: dict, endpoint: str) -> list:
        if endpoint == "chat":
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(x, dict) and isinstance(x.get("content"), str) and "role" in x for x in msgs):
                raise OpenAIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            text = body.get("prompt")
            if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
                text = text[0]
            if not isinstance(text, str) or not text:
                raise OpenAIError(400, "prompt must be a non-empty string", "prompt")
        return tokenizer.encode(text, add_special_tokens=False)

    def stop_strings(body) -> list:
        s = body.get("stop") or []
        s = [s] if isinstance(s, str) else s
        if not isinstance(s, list) or not all(isinstance(x, str) and x for x in s) or len(s) > 4:
            raise OpenAIError(400, "stop must be a string or a list of up to 4 strings", "stop")
        return s

    async def complete(req: HTTPRequest, endpoint: str):
        try:
            body = await parse(req, endpoint)
            ids = encode(body, endpoint)
            stops = stop_strings(body)
            if len(engine.queue) >= queue_limit:
                raise OpenAIError(429, "the request queue is full; retry later", None, "rate_limit_error")
        except OpenAIError as e:
            metrics["requests"].labels(endpoint, str(e.status)).inc()
            raise
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        t0 = time.perf_counter()

        def on_tokens(new):
            loop.call_soon_threadsafe(chunks.put_nowait, list(new))
        try:  # in a thread: the engine holds its lock for a whole dispatch, the event loop must not wait
            r = await asyncio.to_thread(worker.submit, ids, body["max_tokens"],
                                        [eos] if eos is not None else [], on_tokens,
                                        lambda: loop.call_soon_threadsafe(chunks.put_nowait, None),
                                        **body["sampling"])
        except ValueError as e:
            metrics["requests"].labels(endpoint, "400").inc()
            raise OpenAIError(400, str(e), "max_tokens")
        metrics["requests"].labels(endpoint, "200").inc()
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        state = {"tokens": [], "text": "", "sent": 0, "finish": None, "first": True}

        async def advance():
            """Wait for the next tokens; returns the new text (cut at a stop string) or None at the end."""
            new = await chunks.get()
            if new is None:
                state["finish"] = state["finish"] or ("stop" if r.finish_reason == "stop" else "length")
                return None
            if state["first"]:
                metrics["ttft"].observe(time.perf_counter() - t0)
                state["first"] = False
            metrics["tokens"].inc(len(new))
            state["tokens"].extend(new)
            text = tokenizer.decode(state["tokens"], skip_special_tokens=True)
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:  # a stop string: the text ends before it (as OpenAI cuts), the request stops
                await asyncio.to_thread(worker.cancel, r)
                text, state["finish"] = text[:cut], "stop"
            fresh = text[state["sent"]:] if not text.endswith("\ufffd") else ""
            state["sent"] += len(fresh)
            state["text"] = text[:state["sent"]]
            return fresh

        def usage():
            return {"prompt_tokens": len(ids), "completion_tokens": len(r.tokens),
                    "total_tokens": len(ids) + len(r.tokens)}

        if not body.get("stream"):
            try:
                while state["finish"] is None:
                    if await advance() is None:
                        break
            except asyncio.CancelledError:
                await asyncio.to_thread(worker.cancel, r)
                raise
            if endpoint == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": state["text"]},
                          "finish_reason": state["finish"]}
            else:
                choice = {"index": 0, "text": state["text"], "logprobs": None, "finish_reason": state["finish"]}
            return {"id": rid, "object": "chat.completion" if endpoint == "chat" else "text_completion",
                    "created": created, "model": model_name, "choices": [choice], "usage": usage()}

        def event(delta_text, finish=None):
            if endpoint == "chat":
                choice = {"index": 0, "delta": {"content": delta_text} if delta_text is not None else {},
                          "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
                obj = "text_completion"
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                          "choices": [choice]}) + "\n\n"

        async def stream():
            try:
                if endpoint == "chat":
                    yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                                 "model": model_name, "choices": [{"index": 0, "delta": {
                                                     "role": "assistant"}, "finish_reason": None}]}) + "\n\n"
                while state["finish"] is None:
                    fresh = await advance()
                    if fresh is None:
                        break
                    if fresh:
                        yield event(fresh)
                    if await req.is_disconnected():
                        await asyncio.to_thread(worker.cancel, r)
                        return
                yield event(None, state["finish"])
                if (body.get("stream_options") or {}).get("include_usage"):  # OpenAI's last chunk: usage only
                    yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk" if endpoint == "chat"
                                                 else "text_completion", "created": created, "model": model_name,
                                                 "choices": [], "usage": usage()}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if not r.finished:  # the client went away mid-stream
                    worker.cancel(r)
        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: HTTPRequest):
        return await complete(req, "completions")

    @app.post("/v1/chat/completions")
    async def chat(req: HTTPRequest):
        return await complete(req, "chat")

    app.state.worker = worker
    return app


def build_parser() -> Parser:
    ap = Parser(prog="python -m infer.serve", description=__doc__)
    add_model_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    ap.add_argument("--mode", choices=["eagle", "vanilla"], default="eagle",
                    help="eagle: EAGLE-2 rounds, the tree for each load from the head's tree.json (plain steps where "
                         "no tree pays); vanilla: plain decoding only (default eagle)")
    ap.add_argument("--max-batch", type=positive_int, default=4,
                    help="slots decoded together; a dispatch computes the power of two covering the busy ones "
                         "(default 4)")
    ap.add_argument("--max-model-len", type=positive_int, default=1024,
                    help="longest prompt + max_tokens a request may ask for (default 1024)")
    ap.add_argument("--rounds-per-dispatch", type=positive_int, default=4,
                    help="EAGLE-2 rounds per device dispatch before new arrivals are admitted and tokens are sent "
                         "(default 4)")
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
                             progress=lambda what: bar.update(1))
        bar.close()
        print(f"compiled {n} programs for {args.model}" + (f" into {cache}" if cache else ""))
        return
    target, draft = load_models(args, need_draft=True, mesh=mesh)
    if target.tokenizer is None:
        raise SystemExit("error: the model has no tokenizer: serve a named model, an HF directory or a .gguf")
    engine = Engine(target, draft, slots=args.max_batch, max_len=args.max_model_len, mode=args.mode,
                    eos_token_id=target.tokenizer.eos_token_id, rounds_per_dispatch=args.rounds_per_dispatch)
    print("plan: " + ", ".join(f"{b} rows: " + ("plain" if t is None else f"tree {t.depth}/{t.top_k}/{t.total_tokens}")
                               for b, t in engine.plan.items()))
    bar = tqdm(desc="compiling", unit="program")
    engine.warmup(progress=lambda what: bar.update(1))
    bar.close()
    name = args.model if "/" not in args.model else args.model.rstrip("/").split("/")[-1]
    uvicorn.run(build_app(engine, target.tokenizer, name), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
