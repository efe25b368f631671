"""eagle2-jax: EAGLE-2 speculative decoding (dynamic draft trees) in JAX/Flax.

Lossless: greedy output is token-identical to plain decoding of the target, and sampled output
follows the target's distribution.
"""
from . import ops
from .batching import GenerateOutput
from .checkpoints import load_target
from .config import ModelConfig, SamplingConfig, TreeConfig
from .convert import CheckpointError
from .draft import Draft, init_draft
from .draft_io import load_draft, save_draft
from .generation import generate
from .model import Target, forward, init_target
from .sharding import make_mesh, parse_mesh
from .vanilla import generate_vanilla
# Backends plug in through ops.register (the core never imports them): the Pallas attention kernel
# (opt-in, eagle2_jax.pallas) is asked first, then the CPU backend (eagle2_jax.cpu).
from . import pallas as _pallas  # noqa: E402,F401
from . import cpu as _cpu  # noqa: E402,F401

__all__ = [
    "CheckpointError", "Draft", "GenerateOutput", "ModelConfig", "SamplingConfig", "Target", "TreeConfig",
    "forward", "generate", "generate_vanilla", "init_draft", "init_target", "load_draft", "load_target",
    "make_mesh", "ops", "parse_mesh", "save_draft",
]
__version__ = "0.1.0"
