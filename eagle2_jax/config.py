"""Frozen configuration dataclasses.

`ModelConfig` uses Hugging Face field names so a `config.json` maps onto it directly.
`TreeConfig` fixes the static shape of one EAGLE-2 round; `SamplingConfig` fixes the
logits processing applied everywhere (plain decoding, verification, bonus token).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder (Llama 2/3, SmolLM, Mistral-style GQA, Qwen2 q/k/v bias, Qwen3 q/k norm,
    Gemma 3 text: local sliding-window layers among global ones, two RoPE bases, sandwich norms,
    GeGLU, a scaled embedding)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Hugging Face `rope_scaling` dict, stored as a sorted tuple of items so the config stays hashable.
    rope_scaling: Optional[tuple] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3)
    # Gemma 3: layers whose entry is "sliding_attention" see the last `sliding_window` positions only
    # and rotate with `rope_local_base_freq`; the others are global (`rope_theta`, `rope_scaling`)
    sliding_window: Optional[int] = None
    layer_types: Optional[tuple] = None
    rope_local_base_freq: float = 10000.0
    query_pre_attn_scalar: Optional[float] = None  # attention scores scaled by its -1/2 (default head_dim)
    hidden_activation: str = "silu"  # "gelu_pytorch_tanh": GeGLU (Gemma)
    sandwich_norm: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    model_type: str = "llama"

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                    "sliding_attention", "full_attention"}:
                raise ValueError(f"layer_types must give sliding_attention or full_attention for each of the "
                                 f"{self.num_hidden_layers} layers, got {self.layer_types!r}")
        if self.hidden_activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_activation must be silu or gelu_pytorch_tanh, got {self.hidden_activation!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling) if self.rope_scaling else {}

    @property
    def local_layers(self) -> tuple:
        """Per layer: whether it is a sliding-window (local) layer."""
        if self.sliding_window is None or self.layer_types is None:
            return (False,) * self.num_hidden_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def windowed(self) -> bool:
        return any(self.local_layers)

    SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
    ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type == "gemma3" and isinstance(d.get("text_config"), dict):  # the multimodal wrapper
            d, model_type = {**d["text_config"], "model_type": "gemma3_text"}, "gemma3_text"
        if model_type not in cls.SUPPORTED_TYPES:
            raise ValueError(f"unsupported architecture {model_type!r}: supported are "
                             f"{', '.join(cls.SUPPORTED_TYPES)}")
        rp = d.get("rope_parameters")
        if model_type == "gemma3_text":
            d = cls._gemma3(d)
            rp = d.get("rope_parameters")
        if isinstance(rp, dict):  # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
            d = dict(d)
            if "rope_theta" in rp:
                d["rope_theta"] = rp["rope_theta"]
            scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
            d["rope_scaling"] = scaling or None
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        eos = kw.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            kw["eos_token_id"] = eos[0] if eos else None
        if model_type == "qwen2":
            kw.setdefault("attention_bias", True)
        if model_type == "qwen3":
            kw["qk_norm"] = True
            if d.get("use_sliding_window") and d.get("sliding_window"):
                raise ValueError("Qwen3 with sliding-window attention is not supported (use_sliding_window)")
        rs = kw.get("rope_scaling")
        if rs is not None and rs.get("rope_type", rs.get("type")) in (None, "default"):
            kw["rope_scaling"] = None
        return cls(**kw)

    @staticmethod
    def _gemma3(d: dict) -> dict:
        """A Gemma 3 text config's fields in ours (transformers 4 and 5 spellings)."""
        d = dict(d)
        n = d.get("num_hidden_layers", 26)
        if d.get("layer_types") is None:  # older configs: every sliding_window_pattern-th layer is global
            pattern = int(d.get("sliding_window_pattern", 6))
            d["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
        rp = d.get("rope_parameters")
        if isinstance(rp, dict) and "full_attention" in rp:  # per layer type (transformers 5)
            d["rope_local_base_freq"] = rp.get("sliding_attention", {}).get("rope_theta", 10000.0)
            d["rope_parameters"] = rp["full_attention"]
        if d.get("final_logit_softcapping") or d.get("attn_logit_softcapping"):
            raise ValueError("Gemma with logit soft-capping (Gemma 2) is not supported")
        d.setdefault("hidden_activation", "gelu_pytorch_tanh")
        d.setdefault("query_pre_attn_scalar", 256)
        d.setdefault("tie_word_embeddings", True)
        d.setdefault("head_dim", 256)
        return {**d, "qk_norm": True, "sandwich_norm": True, "embed_scale": True}

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"corrupt config file {path}: {e}") from None
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = self.rope_scaling_dict or None
        d["architectures"] = [self.ARCHITECTURES.get(self.model_type, "LlamaForCausalLM")]
        for k in ("qk_norm", "sandwich_norm", "embed_scale"):  # implied by the model type
            del d[k]
        d["layer_types"] = list(self.layer_types) if self.layer_types else None
        return d


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Static shape of one EAGLE-2 draft tree.

    depth: draft passes after the root's children (reference `depth`); the tree has depth+1
      draft levels, so at most depth+2 tokens are added per round (bonus included). Only
      `passes` = min(depth, total_tokens - 2) of them run: deeper levels cannot hold a kept node.
    top_k: children kept per node and frontier width (reference `top_k`).
    total_tokens: tokens verified per round, root included (N).
    """

    depth: int = 5
    top_k: int = 10
    total_tokens: int = 60

    def __post_init__(self):
        for name in ("depth", "top_k", "total_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"TreeConfig.{name} must be a positive integer, got {v!r}")
        if self.total_tokens - 1 > self.pool_size:
            raise ValueError(
                f"TreeConfig: total_tokens - 1 = {self.total_tokens - 1} exceeds the candidate pool "
                f"top_k + depth * top_k**2 = {self.pool_size}")

    @property
    def pool_size(self) -> int:
        return self.top_k + self.depth * self.top_k * self.top_k

    @property
    def passes(self) -> int:
        """Draft passes that can matter: N - 1 kept nodes reach depth N - 1 at most (a node's score
        never exceeds its parent's, so the kept set contains every kept node's ancestors), and pass
        `level` makes nodes of depth level + 2. Later passes are skipped; the tree is the same."""
        return max(0, min(self.depth, self.total_tokens - 2))

    @property
    def max_accept(self) -> int:
        """Most tokens one round can commit: root + the draft levels that can be kept (passes + 1)."""
        return self.passes + 2


MIN_TEMPERATURE = 1e-5  # below it a temperature decodes greedily (vLLM's rule): logits / T would overflow float32
INT32_MAX = 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Logits processing, applied identically to every distribution the target produces. Every value
    fits the dtype it becomes on device (float32, int32); a temperature below MIN_TEMPERATURE is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be in [0, 2**31), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
