"""Few-row matmul microbenchmark: the SmolLM2-135M weight shapes (30 layers of q/k/v/o + gate/up/down
and the tied 49,152-word LM head, random float32) at 1-8 rows, XLA's dot vs eagle2_jax.cpu_kernels.

    python scripts/bench_few_row_matmul.py [--rows 1,2,4,8] [--repeats 15]

Prints the best time of one pass over all weights (~540 MB) per row count. No timing is asserted
anywhere; this only shows what the kernel buys on the machine at hand.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle2_jax import cpu_kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("the few-row kernel did not build here (see the warning above)")
    L, D, F, KV, V = 30, 576, 1536, 192, 49152
    rng = np.random.default_rng(0)

    def w(*s):
        return jnp.asarray(rng.standard_normal(s, np.float32) * 0.02)

    layers = [dict(q=w(D, D), k=w(D, KV), v=w(D, KV), o=w(D, D), g=w(D, F), u=w(D, F), d=w(F, D)) for _ in range(L)]
    embed = w(V, D)

    def make(mm, head):
        @jax.jit
        def f(x, layers, embed):
            for p in layers:
                q, k, v = mm(x, p["q"]), mm(x, p["k"]), mm(x, p["v"])
                x = x + mm(q * jnp.concatenate([k, v, k], -1), p["o"])
                x = x + mm(jax.nn.silu(mm(x, p["g"])) * mm(x, p["u"]), p["d"])
            return head(x, embed)
        return f

    xla = make(lambda x, w: x @ w, lambda x, e: x @ e.T)
    kern = make(cpu_kernels.matmul, lambda x, e: cpu_kernels.matmul(x, e, True) if x.shape[0] <= cpu_kernels.NT_MAX_ROWS
                else x @ e.T)

    def best(f, *args):
        jax.block_until_ready(f(*args))
        ts = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t0)
        return min(ts) * 1e3

    print("| rows | XLA dot ms | few-row kernel ms | XLA / kernel |\n|---|---|---|---|")
    for m in [int(r) for r in a.rows.split(",")]:
        x = jnp.asarray(rng.standard_normal((m, D), np.float32))
        tx, tk = best(xla, x, layers, embed), best(kern, x, layers, embed)
        print(f"| {m} | {tx:.1f} | {tk:.1f} | {tx / tk:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
