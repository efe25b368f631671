"""The seam between the model math and the hardware: the few products the core computes.

`Ops` is a small frozen (hashable) object chosen once when a target is loaded and carried as one
static field of the target and draft modules, so it is part of every compile key. The core
(layers, model, draft, tree, verify) computes every weight product, attention, embedding lookup
and layer loop through it and contains no backend-specific branch. `XLA` here is the accelerator
path (GPU, TPU, and CPU whenever nothing else is plugged in): plain `lax` ops that XLA fuses and
shards.

A backend plugs in from outside by subclassing `Ops` and registering a chooser with `register`:
`eagle2_jax.backends.cpu` adds few-row C++ kernels and GGUF blocks kept packed for a one-device CPU. The
core never imports a backend.

Shape letters in names are the package's one list (eagle2_jax/__init__.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from .layer_list import unrolled_scan

NEG_INF = -1e30  # large finite negative for masked scores (float32)
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Ops:
    """The XLA implementation; backends override methods. Fields are static settings."""

    name: str = "xla"
    # unroll the layer scan (MaxText's scan_layers=False): for cost analysis, where XLA counts a
    # while loop's body once; programs keep the rolled scan (flat compile time and program size)
    unroll_layers: bool = False
    # write half-precision dot products in float32 and round them in a second op (XLA:CPU, see
    # `dense`); GPU/TPU round on write
    f32_dot_outputs: bool = False
    # how `attend_xla` lays out attention scores (see there): "rows" [query rows, slots] (GPU: the
    # softmax reduces along the minor axis, in the fewest kernels), "heads" [query heads, tokens,
    # slots] (TPU: the queries stay as projected, masks broadcast inside the score kernel), "slots"
    # [slots, query rows] (XLA:CPU's faster orientation for few rows)
    scores: str = "rows"
    # write a forward's new keys/values into the layer's cache first and attend over the cache alone
    # (`layers.attend_within`: one block of score, softmax and value kernels a layer); off, the cache
    # as it was and the new keys/values are two blocks of one softmax (`layers.attend_beside`), the
    # form a backend's two-block attention kernel takes
    cache_first: bool = True
    # how the decoder layers run: "scan", one layer body scanned over stacked [L, ...] weights (program
    # size and compile time flat in depth); "list", each layer's weights a buffer of their own
    # (`layer_list.per_layer`, made at load) and the layer loop unrolled, for a compiler that would
    # copy a scanned layer's weights out of the stack before using them (XLA for GPU)
    layers: str = "scan"

    def __post_init__(self):
        if self.layers not in ("scan", "list"):
            raise ValueError(f"layers must be 'scan' or 'list', got {self.layers!r}")

    # ---- weights ------------------------------------------------------------------------------
    def weight(self, w) -> jax.Array:
        """A weight used elementwise (norm scale, bias), as an array."""
        return w

    def dense(self, x, w, n_in: int = 1) -> jax.Array:
        """x [..., *in] @ w [*in, *out] (n_in trailing axes of x contracted with w's leading ones),
        in w's dtype. Half-precision products accumulate in float32 and round once on write, as
        GPU/TPU matrix units do (no float32 copy of the result, no separate rounding op); with
        `f32_dot_outputs` the product is written in float32 and rounded by a second op, which
        XLA:CPU runs ~4x faster than a bf16-output dot (same values)."""
        dims = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
        if x.dtype != w.dtype:
            x = x.astype(w.dtype)
        if self.f32_dot_outputs and jnp.dtype(w.dtype) in HALF_DTYPES:
            return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(w.dtype)
        return jax.lax.dot_general(x, w, dims, preferred_element_type=w.dtype)

    def embed(self, table, tokens) -> jax.Array:
        """Rows `tokens` of the embedding table [V, D]."""
        return jnp.take(table, tokens, axis=0, mode="clip")

    def lm_head(self, x, w, tied: bool) -> jax.Array:
        """Logits [..., V] in float32: x @ w ([D, V]) or, tied, x @ w.T (w the embedding [V, D])."""
        eq = "...d,vd->...v" if tied else "...d,dv->...v"
        return jnp.einsum(eq, x.astype(w.dtype), w, preferred_element_type=jnp.float32)

    def vocab_logits(self, x, vocab_head) -> jax.Array:
        """Logits [..., V'] in float32 over a draft vocabulary subset (`vocab_head["w"]` [D, V'])."""
        w = vocab_head["w"]
        return jnp.einsum("...d,dv->...v", x.astype(w.dtype), w, preferred_element_type=jnp.float32)

    def vocab_head(self, target_params, tie_word_embeddings: bool, ids, dtype) -> dict:
        """The draft-vocabulary leaf {ids [V'], w [D, V']} cut from the target's LM head."""
        head = target_params["embed"].T if tie_word_embeddings else target_params["lm_head"]
        return {"ids": ids, "w": jnp.take(head, ids, axis=1).astype(dtype)}

    # ---- attention and layers -----------------------------------------------------------------
    def attend(self, q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD=None, v_new_BKTD=None, mask_new_BTT=None):
        """Softmax attention of T queries over the cache (under mask [B, T, S]) and, when given,
        this call's own keys/values (mask [B, T, T]) in one float32 softmax: [B, T, H, Dh]. The
        masks may come as `loop_masks` made them."""
        return attend_xla(q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT,
                          scores=self.scores)

    def loop_masks(self, masks: tuple, G: int) -> tuple:
        """Masks ([B, T, X] each) as `attend` takes them inside a layer loop, made once before the
        loop: broadcast to the query rows ([B, 1, G * T, X], `row_mask`) for the "rows" and
        "slots" score layouts, which XLA would otherwise rebuild in every layer; as they are for
        "heads", which broadcasts them inside the score kernel (XLA's TPU compiler moves a row
        broadcast made before a scan back into every layer, at a few kernels a layer). A backend
        whose `attend` takes [B, T, X] masks returns them as they are."""
        return masks if self.scores == "heads" else tuple(row_mask(m, G) for m in masks)

    def scan_layers(self, body: Callable, carry, xs):
        """`lax.scan(body, carry, xs)` over stacked layers (xs leaves [L, ...]); with `layers` "list"
        (per-layer weight buffers) the body once per layer instead."""
        if self.layers == "list":
            return unrolled_scan(body, carry, xs)
        return jax.lax.scan(body, carry, xs, unroll=self.unroll_layers)


XLA = Ops()
XLA_GPU = Ops(name="xla-gpu", layers="list")  # the XLA path as XLA's GPU compiler reads weights best
XLA_TPU = Ops(name="xla-tpu", scores="heads")  # the XLA path as XLA's TPU compiler fuses it best
XLA_CPU = Ops(name="xla-cpu", f32_dot_outputs=True, scores="slots")  # the XLA path as XLA:CPU runs it fastest


def xla_for(platform: str) -> Ops:
    """The XLA path's settings for a platform ("cpu", "tpu", anything else a GPU)."""
    return {"cpu": XLA_CPU, "tpu": XLA_TPU}.get(platform, XLA_GPU)


def query_rows(q_BTHD, K: int):
    """[B, T, H, Dh] -> [B, K, G * T, Dh] float32, scaled: query rows y = g * T + t."""
    B, T, H, Dh = q_BTHD.shape
    G = H // K
    q = q_BTHD.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, Dh)  # moved in its dtype
    return q.astype(jnp.float32) * (1.0 / math.sqrt(Dh))


def row_mask(mask_BTX, G: int):
    """[B, T, X] -> [B, 1, G * T, X]: the mask of each query row y = g * T + t (`query_rows`)."""
    B, T, X = mask_BTX.shape
    return jnp.broadcast_to(mask_BTX[:, None], (B, G, T, X)).reshape(B, G * T, X)[:, None]


def attend_xla(q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD=None, v_new_BKTD=None, mask_new_BTT=None, *,
               scores: str = "rows"):
    """One float32 softmax over the cache slots and, when given, the new keys as a second block
    (no concatenated copy), normalised after the value products ([Dh] a query, not [slots]).
    The scores' layout (`Ops.scores`; same values in each):
      "rows"  [B, K, Y, slots] over query rows y = g * T + t (`query_rows`): the softmax reduces
              along the minor axis, in the fewest kernels XLA's GPU compiler makes of it;
      "heads" [B, K, G, T, slots]: each KV head's G query heads as the query projection lays them
              out, so the queries are not moved into rows (XLA's TPU compiler folds the output's
              transpose into the products' layouts) and a [B, T, X] mask broadcasts inside the
              score kernel: fewer kernels than "rows" for XLA's TPU compiler;
      "slots" [B, K, slots, Y]: with few query rows XLA's CPU matmuls are several times faster.
    (Kernel counts per layout and platform: docs/performance.md.)"""
    B, T, H, Dh = q_BTHD.shape
    K = k_BKSD.shape[1]
    G = H // K
    f32 = jnp.float32
    blocks = [(k_BKSD, v_BKSD, mask_BTS)]
    if k_new_BKTD is not None:
        blocks.append((k_new_BKTD.astype(k_BKSD.dtype), v_new_BKTD.astype(v_BKSD.dtype), mask_new_BTT))
    dot = lambda eq, a, b: jnp.einsum(eq, a.astype(b.dtype), b, preferred_element_type=f32)  # noqa: E731
    if scores not in ("rows", "heads", "slots"):
        raise ValueError(f"scores must be rows, heads or slots, got {scores!r}")
    if scores != "heads":
        q = query_rows(q_BTHD, K).astype(k_BKSD.dtype)  # the query takes the cache's dtype, as do the new keys / values

        def masked(k, m):  # m: [B, T, X], or already [B, 1, Y, X] (`Ops.loop_masks`)
            rows = m if m.ndim == 4 else row_mask(m, G)
            if scores == "slots":
                return jnp.where(rows.swapaxes(2, 3), dot("bksd,bkyd->bksy", k, q), NEG_INF)
            return jnp.where(rows, dot("bkyd,bksd->bkys", q, k), NEG_INF)
        ax, pv = (2, "bksy,bksd->bkyd") if scores == "slots" else (3, "bkys,bksd->bkyd")
    else:
        q = (q_BTHD.reshape(B, T, K, G, Dh).astype(f32) * (1.0 / math.sqrt(Dh))).astype(k_BKSD.dtype)

        def masked(k, m):  # m: [B, T, X]
            if m.ndim != 3:
                raise ValueError(f"the query-head score layout takes [B, T, X] masks, got shape {m.shape}")
            return jnp.where(m[:, None, None], dot("btkgd,bksd->bkgts", q, k), NEG_INF)
        ax, pv = 4, "bkgts,bksd->bkgtd"
    s = [masked(k, m) for k, _, m in blocks]
    top = functools.reduce(jnp.maximum, [jnp.max(x, axis=ax, initial=NEG_INF) for x in s])  # [B, K, Y] / [B, K, G, T]
    p = [jnp.exp(x - jnp.expand_dims(top, ax)) for x in s]
    total = functools.reduce(jnp.add, [jnp.sum(x, axis=ax) for x in p])
    out = functools.reduce(jnp.add, [dot(pv, x, v) for x, (_, v, _) in zip(p, blocks)])
    out = out / total[..., None]
    return out.reshape(B, K, G, T, Dh).transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)


# ---- backends plugged in from outside --------------------------------------------------------

_CHOOSERS: list = []


def register(chooser: Callable[[Any, Any, Any], Optional[Ops]]) -> None:
    """Add a backend: chooser(params, dtype, mesh) returns its Ops for a loaded target, or None."""
    if chooser not in _CHOOSERS:
        _CHOOSERS.append(chooser)


def choose(params, dtype, mesh=None) -> Ops:
    """The Ops for a target's params: the first registered backend that takes them, else the XLA
    path's settings for the backend (`xla_for`)."""
    for chooser in _CHOOSERS:
        ops = chooser(params, dtype, mesh)
        if ops is not None:
            return ops
    return xla_for(jax.default_backend())
