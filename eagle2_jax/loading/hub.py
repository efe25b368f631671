"""Hugging Face Hub ids (`meta-llama/Llama-3.1-8B-Instruct`, `org/name@revision`) resolved to a local
snapshot directory through `huggingface_hub`, which keeps its own cache and reads its own settings:
HF_HUB_CACHE / HF_HOME for the cache, HF_TOKEN for gated models, HF_HUB_OFFLINE=1 for the local cache
only. Only the files a target or a head needs are fetched (no PyTorch .bin weights).
"""
from __future__ import annotations

import os
import re

from .convert import CheckpointError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")
# configs, safetensors weights, tokenizer files, and the files our heads ship beside their weights
PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja")


def is_hub_id(source: str) -> bool:
    """`org/name` or `org/name@revision` that is not a path on this machine."""
    return bool(HUB_ID.match(str(source))) and not os.path.exists(str(source))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir() -> str:
    """The cache huggingface_hub uses, read from the environment now (the library reads it at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def snapshot(source: str) -> str:
    """The local directory of Hub id `source` (`org/name[@revision]`), fetched into the Hub cache if
    missing (offline: from the cache only). Any failure is one CheckpointError line naming the id
    and the cache."""
    import huggingface_hub
    repo_id, _, revision = str(source).partition("@")
    cache = _cache_dir()
    try:
        return huggingface_hub.snapshot_download(repo_id, revision=revision or None, cache_dir=cache,
                                                 allow_patterns=list(PATTERNS), local_files_only=_offline())
    except Exception as e:  # noqa: BLE001 - the library raises many types (HTTP, offline, not found, OS)
        reason = " ".join(str(e).split()) or type(e).__name__
        where = "offline (HF_HUB_OFFLINE=1), " if _offline() else ""
        raise CheckpointError(f"cannot get {source!r} from the Hugging Face Hub ({where}cache {cache}): "
                              f"{type(e).__name__}: {reason[:300]}") from None
