"""How long /health takes to answer while the server parses a large request body (a measurement, not a test).

    python -m infer.serve --max-body-mb 16 &
    python scripts/probe_health.py --url http://127.0.0.1:8000 --mb 10

Sends one completion request whose prompt is `--mb` MiB of text (far past any context, so the server
refuses it) and, while it is in flight, asks /health again and again; prints the big request's status
and time, and the /health latencies (count, median, max). Bounded: one big request, health checks only
while it runs (at most --max-checks).
"""
import argparse
import json
import statistics
import threading
import time
import urllib.error
import urllib.request


def timed(url, data=None):
    t0 = time.perf_counter()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        e.read()
        status = e.code
    return status, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--mb", type=float, default=10.0, help="prompt size in MiB (default 10)")
    ap.add_argument("--max-checks", type=int, default=10_000)
    args = ap.parse_args(argv)
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit "
    prompt = (words * int(args.mb * 2 ** 20 / len(words) + 1))[:int(args.mb * 2 ** 20)]
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    big = []
    th = threading.Thread(target=lambda: big.append(timed(args.url + "/v1/completions", body)))
    th.start()
    lat = []
    while th.is_alive() and len(lat) < args.max_checks:
        lat.append(timed(args.url + "/health"))
    th.join()
    ok = [t for s, t in lat if s == 200]
    print(json.dumps({"body_mb": args.mb, "big_status": big[0][0], "big_s": round(big[0][1], 3),
                      "health_checks": len(lat), "health_ok": len(ok),
                      "health_ms_median": round(1e3 * statistics.median(ok), 1) if ok else None,
                      "health_ms_max": round(1e3 * max(ok), 1) if ok else None}))


if __name__ == "__main__":
    main()
