"""Platform specifics that plug into the core from outside through `models.ops.register`: the CPU
backend (few-row C++ kernels, GGUF blocks kept packed) and the opt-in Pallas tree-attention kernel.
The core never imports them; `eagle2_jax/__init__.py` does, to register them."""
