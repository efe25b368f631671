"""Per-layer weight buffers: the target's layers as L separate buffers and an unrolled layer loop.

The core scans the decoder layers over stacked weights ([L, ...] leaves under params["layers"]):
one compiled layer body whatever the depth. A compiler that copies each scanned layer's weights out
of the stack before its matmuls (XLA for GPU, read from its compiled programs: docs/performance.md)
reads the weights several times over; with each layer's weights a buffer of their own the matmuls
read them where they are, at the price of compiling every layer (MaxText's scan_layers=False).

Whether a target runs this way is one setting of its Ops (`Ops.layers`, "scan" or "list"), chosen at
load; `per_layer(target)` then turns its stacked weights into `LayerList` leaves (one buffer per
layer, same shardings) and `Ops.scan_layers` runs the layer body once per layer (`unrolled_scan`),
reading the stacked KV cache by static slices. This module imports nothing of the package.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# A layer's outputs (its new keys and values) larger than this are made within the layer: left free,
# XLA's GPU compiler fuses their last steps into the cache write after the last layer, which then
# reads every layer's partial sums back long after the L2 has dropped them; a decode step's few
# bytes are left to fuse, which saves it kernels.
BARRIER_BYTES = 64 * 1024


@jax.tree_util.register_pytree_node_class
class LayerList:
    """One stacked weight [L, ...] held as L separate buffers; indexes and reports shape and dtype
    as the stack would."""

    def __init__(self, items):
        self.items = list(items)

    def tree_flatten(self):
        return self.items, None

    @classmethod
    def tree_unflatten(cls, aux, items):
        return cls(items)

    @property
    def shape(self):
        return (len(self.items),) + tuple(self.items[0].shape)

    @property
    def dtype(self):
        return self.items[0].dtype

    @property
    def ndim(self):
        return len(self.shape)

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


def is_layer_list(x) -> bool:
    return isinstance(x, LayerList)


def holds_layer_lists(tree) -> bool:
    return any(is_layer_list(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_layer_list))


def unstack(layers):
    """A pytree of stacked [L, ...] leaves (arrays or abstract ShapeDtypeStructs) as LayerLists."""
    def split(a):
        if isinstance(a, jax.ShapeDtypeStruct):
            s = a.sharding
            if isinstance(s, jax.sharding.NamedSharding):  # the stack's spec without the layer axis
                s = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
            return LayerList([jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=s)] * a.shape[0])
        return LayerList([a[i] for i in range(a.shape[0])])
    return jax.tree_util.tree_map(split, layers)


def unrolled_scan(body, carry, xs):
    """`lax.scan(body, carry, xs)` as a Python loop: LayerList leaves give their i-th buffer, stacked
    arrays (the KV cache) their static i-th slice; the outputs are stacked as a scan stacks them."""
    L = jax.tree_util.tree_leaves(xs, is_leaf=is_layer_list)[0].shape[0]
    ys = []
    for i in range(L):
        carry, y = body(carry, jax.tree_util.tree_map(lambda a: a[i], xs, is_leaf=is_layer_list))
        if sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(y)) > BARRIER_BYTES:
            y = jax.lax.optimization_barrier(y)  # made within its layer (see BARRIER_BYTES)
        ys.append(y)
    return carry, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)


def per_layer(target, *, release: bool = False):
    """The target with its stacked layer weights as per-layer buffers (a no-op if they already are).
    Unless the MLP is split across devices (or has biases), each layer's gate and up weights become
    one [D, 2F] buffer, "gate_up", read by one matmul: apart, XLA's GPU compiler writes the gate's
    split-K partial sums and streams the up weights through the L2 before it reads them back.

    `release` (for a caller that holds no other reference to the stacked weights, as load_target):
    each stacked weight is freed as soon as it is split, so device memory peaks near the weights plus
    the largest one (gate and up together), not twice the weights. `target` is then unusable. The
    result's Ops run the layers as a list (`Ops.layers`); a backend with its own layer loop refuses."""
    ops = dataclasses.replace(target.ops, layers="list")  # (a backend with its own layer loop refuses)
    if holds_layer_lists(target.params["layers"]):
        return target if ops == target.ops else dataclasses.replace(target, ops=ops)

    def done(stacks, parts):  # the stacked weights just split: free them once their slices are computed
        if release:
            jax.block_until_ready(parts.items)
            for a in stacks:
                if isinstance(a, jax.Array):
                    a.delete()

    stacked = dict(target.params["layers"])
    mlp = dict(stacked.pop("mlp"))
    if _fusable(mlp):
        g, u = mlp.pop("gate")["kernel"], mlp.pop("up")["kernel"]
        if isinstance(g, jax.ShapeDtypeStruct):
            fused = LayerList([_concat_last(gi, ui) for gi, ui in zip(unstack(g).items, unstack(u).items)])
        else:  # layer by layer: one layer's gate and up slices at a time besides the stacks
            fused = LayerList([jnp.concatenate([g[i], u[i]], axis=-1) for i in range(g.shape[0])])
        done((g, u), fused)
        mlp["gate_up"] = {"kernel": fused}

    def split(a):
        if is_layer_list(a):  # (gate_up, split above)
            return a
        out = unstack(a)
        done((a,), out)
        return out
    layers = jax.tree_util.tree_map(split, {**stacked, "mlp": mlp}, is_leaf=is_layer_list)
    return dataclasses.replace(target, params={**target.params, "layers": layers}, ops=ops)


def draft_like(draft, target):
    """The draft with its layer's gate and up weights as one [D, 2F] "gate_up" buffer when `target`
    runs per-layer buffers (as `per_layer` gives them, for the same reason: apart they cost a kernel
    and the up weights' trip through the L2 at each draft pass); else unchanged.
    `split_gate_up` undoes it (the head's writers use it)."""
    layer = draft.params.get("layers_0") if isinstance(draft.params, dict) else None
    if target.ops.layers != "list" or layer is None or not _fusable(layer["mlp"]):
        return draft
    mlp = dict(layer["mlp"])
    g, u = mlp.pop("gate")["kernel"], mlp.pop("up")["kernel"]
    fused = _concat_last(g, u) if isinstance(g, jax.ShapeDtypeStruct) else jnp.concatenate([g, u], axis=-1)
    mlp["gate_up"] = {"kernel": fused}
    return dataclasses.replace(draft, params={**draft.params, "layers_0": {**layer, "mlp": mlp}})


def split_gate_up(mlp: dict) -> dict:
    """One layer's MLP params with a fused "gate_up" kernel [..., 2F] split back into gate and up."""
    if "gate_up" not in mlp:
        return mlp
    rest = {k: v for k, v in mlp.items() if k != "gate_up"}
    gate, up = jnp.split(mlp["gate_up"]["kernel"], 2, axis=-1)
    return {**rest, "gate": {"kernel": gate}, "up": {"kernel": up}}


def _fusable(mlp) -> bool:
    """Gate and up without biases, each whole on every device (split along F, their concatenation
    would interleave the devices' halves)."""
    gate, up = mlp.get("gate"), mlp.get("up")
    return (isinstance(gate, dict) and isinstance(up, dict) and set(gate) == set(up) == {"kernel"}
            and _whole_on_each_device(gate["kernel"]))


def _whole_on_each_device(a) -> bool:
    s = getattr(a, "sharding", None)
    return not isinstance(s, jax.sharding.NamedSharding) or all(x is None for x in s.spec)


def _concat_last(a, b):
    return jax.ShapeDtypeStruct(a.shape[:-1] + (a.shape[-1] + b.shape[-1],), a.dtype, sharding=a.sharding)
