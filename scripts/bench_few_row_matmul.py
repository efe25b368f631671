"""Few-row matmul microbenchmark for the CPU backend: the SmolLM2-135M weight shapes (30 layers of
q/k/v/o + gate/up/down and the tied 49,152-word LM head, random float32) at 1-8 rows, XLA's dot
against the few-row kernel (eagle2_jax.backends.cpu.kernels). Backs the CPU-backend figures in
docs/performance.md ("CPU backend") and the head's MEASUREMENTS.md.

    PYTHONPATH=. python scripts/bench_few_row_matmul.py [--rows 1,2,4,8] [--repeats 15] [--packed]

Prints the best time of one pass over all weights (~540 MB) per row count. --packed adds the same
pass over random Q4_1 matrices and a Q8_0 LM head through the packed kernels (eagle2_jax.backends.cpu.packed;
~110 MB) and checks that its outputs equal the float32 kernel's on the dequantised weights. No timing
is asserted anywhere; this only shows what the kernel buys on the machine at hand.

Time: not timed as a whole (one pass is 25-65 ms on a 2-core CPU; the default runs 16 passes of
each variant per row count, plus the compiles and the kernel's first build, about 4 s).
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle2_jax.backends.cpu import kernels as cpu_kernels, packed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--packed", action="store_true", help="also time the packed Q4_1 / Q8_0 kernels")
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

    if a.packed:
        layers_f, embed_f, layers_q, embed_q = _packed_weights(rng, L, D, F, KV, V)
        packed_fn = make(lambda x, p: packed.matmul(x, p), lambda x, e: packed.matmul_nt(x, e))
        kern_all = make(cpu_kernels.matmul, lambda x, e: cpu_kernels.matmul(x, e, True))  # any row count
    print("| rows | XLA dot ms | few-row kernel ms | XLA / kernel |" + (" packed ms | identical |" if a.packed else "")
          + "\n|---|---|---|---|" + ("---|---|" if a.packed else ""))
    for m in [int(r) for r in a.rows.split(",")]:
        x = jnp.asarray(rng.standard_normal((m, D), np.float32))
        tx, tk = best(xla, x, layers, embed), best(kern, x, layers, embed)
        line = f"| {m} | {tx:.1f} | {tk:.1f} | {tx / tk:.2f}x |"
        if a.packed:
            # the random chain can overflow to NaN in a row (it did at 2 rows): NaN in the same places is equal
            same = bool(np.array_equal(np.asarray(kern_all(x, layers_f, embed_f)),
                                       np.asarray(packed_fn(x, layers_q, embed_q)), equal_nan=True))
            line += f" {best(packed_fn, x, layers_q, embed_q):.1f} | {same} |"
        print(line, flush=True)


def _packed_weights(rng, L, D, F, KV, V):
    """Random Q4_1 layer matrices and a Q8_0 embedding: (float32 layers, embed, packed layers, embed)."""
    lanes = cpu_kernels.lanes()

    def q4(K, N):
        q = rng.integers(0, 16, (K, N), dtype=np.uint8)
        d = (rng.standard_normal((K // 32, N)) * 0.002).astype(np.float16).astype(np.float32)
        m = (rng.standard_normal((K // 32, N)) * 0.01).astype(np.float16).astype(np.float32)
        w = np.repeat(d, 32, 0) * q.astype(np.float32) + np.repeat(m, 32, 0)
        return jnp.asarray(w), {k: jnp.asarray(v) for k, v in packed.pack_q4(q, d, m, lanes).items()}

    shapes = dict(q=(D, D), k=(D, KV), v=(D, KV), o=(D, D), g=(D, F), u=(D, F), d=(F, D))
    layers_f, layers_q = [], []
    for _ in range(L):
        pairs = {n: q4(*s) for n, s in shapes.items()}
        layers_f.append({n: p[0] for n, p in pairs.items()})
        layers_q.append({n: p[1] for n, p in pairs.items()})
    q8 = rng.integers(-127, 128, (V, D), dtype=np.int8)
    d8 = (rng.standard_normal((V, D // 32)) * 0.001).astype(np.float16).astype(np.float32)
    embed_f = jnp.asarray(q8.astype(np.float32) * np.repeat(d8, 32, 1))
    return layers_f, embed_f, layers_q, {"q8": jnp.asarray(q8), "d": jnp.asarray(d8)}


if __name__ == "__main__":
    main()
