"""eagle2-jax: EAGLE-2 speculative decoding (dynamic draft trees) in JAX/Flax.

Lossless: greedy output is token-identical to plain decoding of the target, and sampled output
follows the target's distribution.

Array names end in their shape (`tokens_BN`: [B, N]); each letter has one meaning everywhere:
  B batch rows            T new tokens of a forward    S cache slots       P prompt (padded)
  H query heads           K key/value heads            G = H // K          Dh head dim
  D hidden size           F MLP width                  V vocabulary        L layers
  W tree width (top_k)    N tree nodes (total_tokens)  Q candidate pool    U draft scratch slots
  C accepted-path slots   M output slots               R rounds            A aux layers (EAGLE-3)
  E programs of one attention walk (Pallas)            X the key axis of a mask (S or T)
  Y query rows of attention (G * T)                    J any gathered index
"""
from .models import ops
from .decoding.batching import GenerateOutput
from .loading.checkpoints import load_target
from .config import ModelConfig, SamplingConfig, TreeConfig
from .loading.convert import CheckpointError
from .models.draft import Draft, init_draft
from .loading.draft_io import load_draft, save_draft
from .decoding.generation import generate
from .models.target import Target, forward, init_target
from .sharding import make_mesh, parse_mesh
from .decoding.vanilla import generate_vanilla
# Backends plug in through ops.register (the core never imports them): the Pallas attention kernel
# (opt-in, eagle2_jax.backends.pallas) is asked first, then the CPU backend (eagle2_jax.backends.cpu).
from .backends import pallas as _pallas  # noqa: E402,F401
from .backends import cpu as _cpu  # noqa: E402,F401

__all__ = [
    "CheckpointError", "Draft", "GenerateOutput", "ModelConfig", "SamplingConfig", "Target", "TreeConfig",
    "forward", "generate", "generate_vanilla", "init_draft", "init_target", "load_draft", "load_target",
    "make_mesh", "ops", "parse_mesh", "save_draft",
]
__version__ = "0.1.0"
