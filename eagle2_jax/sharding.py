"""Device mesh and partition rules, kept as data apart from the model math.

Params are named by their '/'-joined path; the first rule whose regex matches gives the logical
axes of each dimension; LOGICAL_AXES maps logical names to mesh axes. The target's stacked layer
params ("layers/...", STACKED_PREFIX) take the rule of their per-layer name with an unsharded
leading layer axis. A dimension that the mesh
axis does not divide is replicated (e.g. SmolLM2's 3 KV heads on a 2-way model axis).
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "model")

# logical axis -> mesh axis
LOGICAL_AXES = {
    "batch": "data",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
}

# (regex over the param path, logical axes per dimension)
PARAM_RULES: tuple = (
    (r"(^|/)embed$", ("vocab", None)),
    (r"(^|/)lm_head$", (None, "vocab")),
    (r"attn/q/kernel$", (None, "heads", None)),
    (r"attn/q/bias$", ("heads", None)),
    (r"attn/(k|v)/kernel$", (None, "kv_heads", None)),
    (r"attn/(k|v)/bias$", ("kv_heads", None)),
    (r"attn/o/kernel$", ("heads", None, None)),
    (r"mlp/(gate|up)/kernel$", (None, "mlp")),
    (r"mlp/(gate|up)/bias$", ("mlp",)),
    (r"mlp/down/kernel$", ("mlp", None)),
    (r"vocab_head/w$", (None, "vocab")),
    (r".*", ()),  # everything else (norms, draft fc) replicated
)

STACKED_PREFIX = "layers/"  # params stacked on a leading layer axis

# stacked KV cache [L, B, K, S, Dh]
CACHE_AXES = ("layers", "batch", "kv_heads", None, None)


def make_mesh(data: int = 1, model: int = 1, devices: Optional[Sequence] = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    need = data * model
    if need > len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {need} devices, "
                         f"only {len(devices)} available")
    return Mesh(np.array(devices[:need]).reshape(data, model), MESH_AXES)


def parse_mesh(spec: Optional[str]) -> Optional[Mesh]:
    """'data=2,model=4' -> Mesh; None or '' -> None (single device)."""
    if not spec:
        return None
    sizes, seen = {"data": 1, "model": 1}, set()
    for part in spec.split(","):
        name, _, val = part.partition("=")
        name = name.strip()
        if name not in sizes or name in seen or not val.strip().isdigit() or int(val) < 1:
            raise ValueError(f"bad --mesh {spec!r}: expected e.g. 'data=2,model=4', each axis at most once")
        sizes[name] = int(val)
        seen.add(name)
    return make_mesh(sizes["data"], sizes["model"])


def spec_for(logical: Sequence, shape: Sequence[int], mesh: Mesh) -> P:
    axes = []
    for i, dim in enumerate(shape):
        name = logical[i] if i < len(logical) else None
        mesh_axis = LOGICAL_AXES.get(name) if name else None
        if mesh_axis is not None and dim % mesh.shape[mesh_axis] == 0 and mesh.shape[mesh_axis] > 1:
            axes.append(mesh_axis)
        else:
            axes.append(None)
    return P(*axes)


def param_spec(path: str, shape, mesh: Mesh, rules=PARAM_RULES) -> P:
    if path.startswith(STACKED_PREFIX):
        inner = param_spec(path[len(STACKED_PREFIX):], tuple(shape)[1:], mesh, rules)
        return P(None, *inner)
    for pattern, logical in rules:
        if re.search(pattern, path):
            return spec_for(logical, shape, mesh)
    return P()


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_shardings(params, mesh: Mesh, rules=PARAM_RULES):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, param_spec(path_str(p), x.shape, mesh, rules)), params)


def put_global(x, sharding):
    """An array placed with `sharding`. Across processes (jax.distributed; a mesh with devices of other
    hosts) every process passes the same full value and keeps the shards its devices hold."""
    if jax.process_count() == 1 or sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def to_host(x) -> np.ndarray:
    """The whole value of an array on the host, gathered from every process when it spans several."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def shard_params(params, mesh: Optional[Mesh], rules=PARAM_RULES):
    """Params (numpy or jax leaves) on the mesh by the rules; without a mesh, on the default device.
    Loaders keep numpy until here, so a stacked tensor goes to its shards without a stop on one device."""
    if mesh is None:
        return jax.tree_util.tree_map(jnp.asarray, params)
    return jax.tree_util.tree_map(put_global, params, param_shardings(params, mesh, rules))


def constrain(x, mesh: Optional[Mesh], logical: Sequence):
    """with_sharding_constraint by logical axes (no-op without a mesh)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(logical, x.shape, mesh)))


def constrain_cache(cache, mesh: Optional[Mesh]):
    if mesh is None:
        return cache
    return cache.replace(k=constrain(cache.k, mesh, CACHE_AXES), v=constrain(cache.v, mesh, CACHE_AXES))


def batch_multiple(mesh: Optional[Mesh]) -> int:
    return 1 if mesh is None else mesh.shape["data"]
