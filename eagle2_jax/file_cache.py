"""Derived files kept on disk between runs: a GGUF's metadata index and its tokenizer.

Parsing the SmolLM2 GGUF with `gguf.GGUFReader` takes ~4.5 s (it builds a numpy view for each of
the ~100k strings of the embedded tokenizer), and transformers' GGUF tokenizer conversion reads the
file again and takes ~12 s; together most of `load_target`'s time. The first load writes
  <root>/gguf/<key>/index.json      the scalar metadata, and each tensor's type, shape and offset
  <root>/gguf/<key>/tokenizer-<transformers version>/   tokenizer.save_pretrained (loads in ~0.2 s)
where <key> hashes the file's absolute path, size and modification time, so an edited or replaced
file gets a new entry. <root> is $EAGLE2_JAX_CACHE (default ~/.cache/eagle2_jax), shared with the
CPU kernels' build. EAGLE2_JAX_FILE_CACHE=0 reads the GGUF itself every time. An unwritable cache
only costs the time; a corrupt entry is rebuilt.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np

SWITCH = "EAGLE2_JAX_FILE_CACHE"
INDEX_VERSION = 1


def cpu_signature() -> str:
    """The processor's architecture and feature flags: code compiled for this CPU (-march=native
    kernels, XLA:CPU programs) must not be reused on a CPU with other features."""
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def root() -> Path:
    r = os.environ.get("EAGLE2_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eagle2_jax")
    return Path(r)


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def entry(path: str) -> Path:
    """This file's directory in the cache (path, size and mtime in the key)."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return root() / "gguf" / key


def _publish(build: Callable[[Path], None], dest: Path) -> None:
    """Write into a fresh temporary directory, then rename it to `dest` (readers never see half)."""
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_text(file: Path, text: str) -> None:
    """Write a file through a temporary name and a rename."""
    tmp = file.with_name(f"{file.name}.tmp-{os.getpid()}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, file)
    except OSError:
        tmp.unlink(missing_ok=True)


# ---- GGUF index ----------------------------------------------------------------------------------

@dataclasses.dataclass
class IndexedTensor:
    """The parts of gguf's ReaderTensor that load_gguf uses, with the same `data` view."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple  # GGUF order: contiguous dimension first
    data: np.ndarray


@dataclasses.dataclass
class GGUFIndex:
    fields: dict  # scalar and string metadata; arrays only as their length, under "<key>#count"
    tensors: list

    def field(self, key, default=None):
        return self.fields.get(key, default)


def _index_dict(reader) -> dict:
    from gguf import GGUFValueType
    fields = {}
    for k, f in reader.fields.items():
        if f.types and f.types[0] == GGUFValueType.ARRAY:
            fields[f"{k}#count"] = len(f.data)
        else:
            v = f.contents()
            fields[k] = v.item() if isinstance(v, np.generic) else v
    tensors = [dict(name=t.name, type=int(t.tensor_type), shape=[int(x) for x in t.shape],
                    offset=int(t.data_offset)) for t in reader.tensors]
    return {"version": INDEX_VERSION, "fields": fields, "tensors": tensors}


_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


def _tensors(path: str, table: list) -> list:
    """Memory-mapped tensors laid out as GGUFReader lays them out (numpy order; quantised types as
    uint8 rows of blocks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape
    mm = np.memmap(path, mode="r")
    out = []
    for t in table:
        qtype = GGMLQuantizationType(t["type"])
        dims = tuple(t["shape"])
        np_dims = tuple(reversed(dims))
        n = int(np.prod(dims))
        off = t["offset"]
        if qtype.name in _PLAIN:
            dt = np.dtype(_PLAIN[qtype.name])
            data = mm[off:off + n * dt.itemsize].view(dt).reshape(np_dims)
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            data = mm[off:off + n * size // block].reshape(quant_shape_to_byte_shape(np_dims, qtype))
        out.append(IndexedTensor(t["name"], qtype, dims, data))
    return out


def gguf_index(path: str, open_reader: Callable[[str], Any]) -> GGUFIndex:
    """The GGUF's metadata and tensors, from the cache when an entry exists, else from
    `open_reader(path)` (a gguf.GGUFReader), writing the entry for next time."""
    index_file = entry(path) / "index.json" if enabled() else None
    d = None
    if index_file is not None and index_file.exists():
        try:
            d = json.loads(index_file.read_text())
            if d.get("version") != INDEX_VERSION:
                d = None
        except (OSError, ValueError):
            d = None
    if d is None:
        d = _index_dict(open_reader(path))
        if index_file is not None:
            _write_text(index_file, json.dumps(d))
    try:
        tensors = _tensors(path, d["tensors"])
    except (KeyError, ValueError, TypeError) as e:
        if index_file is not None:
            index_file.unlink(missing_ok=True)
        raise ValueError(f"GGUF index of {path} does not match the file ({e}); it was removed, load again") from None
    return GGUFIndex(d["fields"], tensors)


# ---- tokenizer -----------------------------------------------------------------------------------

def _tokenizer_entry(path: str):
    import transformers
    # saved per transformers version: another version re-converts rather than trusting an older save
    return entry(path) / f"tokenizer-{transformers.__version__}" if enabled() else None


def gguf_tokenizer_cached(path: str) -> bool:
    d = _tokenizer_entry(path)
    return d is not None and (d / "tokenizer_config.json").exists()


def gguf_tokenizer(path: str):
    """transformers' tokenizer of a GGUF file (its conversion, the first time; then the saved copy)."""
    from transformers import AutoTokenizer
    d = _tokenizer_entry(path)
    if gguf_tokenizer_cached(path):
        try:
            return AutoTokenizer.from_pretrained(str(d))
        except Exception:  # noqa: BLE001 - a damaged entry is rebuilt below
            pass
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    if d is not None:
        _publish(lambda tmp: tok.save_pretrained(str(tmp)), d)
    return tok
