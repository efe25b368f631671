"""Tiny models for tests: random ones and constructed oracles."""
import jax
import jax.numpy as jnp
import numpy as np

from eagle2_jax.config import ModelConfig
from eagle2_jax.models.draft import init_draft
from eagle2_jax.models.target import init_target


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                max_position_embeddings=512, rope_theta=10000.0)
    base.update(kw)
    return ModelConfig(**base)


def tiny_pair(seed=0, **kw):
    t = init_target(tiny_config(**kw), seed)
    return t, init_draft(t, seed + 1)


def _unit_rows(key, n, d):
    x = jax.random.normal(key, (n, d))
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True))


def permutation_oracle(seed=0, vocab=64, hidden=32, layer_scale=0.0):
    """A target whose greedy next token is perm(current token) and a draft that knows perm.

    Target: embedding rows of unit RMS; its layers add nothing (o/down zero) unless layer_scale > 0
    (then they add a small context-dependent perturbation); untied LM head whose column perm(t) is
    embed[t], so argmax = perm(t). Draft: fc passes the token embedding through, its layer adds
    nothing, so through the shared LM head it proposes perm(token) -- the target's own continuation.
    """
    # the default tiny config: with the default vocab and hidden size the oracle's modules equal the
    # random pair's, so tests running both share their compiled programs
    target, draft = tiny_pair(seed, vocab_size=vocab, hidden_size=hidden)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed + 7))
    E = _unit_rows(k1, vocab, hidden)
    perm = np.asarray(jax.random.permutation(k2, vocab))
    head = jnp.zeros((hidden, vocab)).at[:, perm].set(E.T) * 4.0  # sharpen
    p = jax.tree_util.tree_map(lambda x: x, target.params)
    p["embed"] = E
    p["lm_head"] = head
    p["norm"]["scale"] = jnp.ones((hidden,))
    lp = p["layers"]  # stacked: [L, ...]
    lp["attn"]["o"]["kernel"] = lp["attn"]["o"]["kernel"] * layer_scale
    lp["mlp"]["down"]["kernel"] = lp["mlp"]["down"]["kernel"] * layer_scale
    target.params = p
    dp = jax.tree_util.tree_map(lambda x: x, draft.params)
    dp["fc"]["kernel"] = jnp.concatenate([jnp.eye(hidden), jnp.zeros((hidden, hidden))], axis=0)
    dp["fc"]["bias"] = jnp.zeros((hidden,))
    dp["layers_0"]["attn"]["o"]["kernel"] = jnp.zeros_like(dp["layers_0"]["attn"]["o"]["kernel"])
    dp["layers_0"]["mlp"]["down"]["kernel"] = jnp.zeros_like(dp["layers_0"]["mlp"]["down"]["kernel"])
    draft.params = dp
    return target, draft, perm
