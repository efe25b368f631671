"""How much of the target's next-token decision each layer's stream already holds (a logit lens):
the target's final norm and LM head applied to the hidden state entering layer i, on the assistant
positions of a data set's examples, and how often its top-1 equals the target's own next token.
An EAGLE-3 head reads three such streams (`eagle_aux_hidden_state_layer_ids`); an EAGLE-1/2 head
reads the final one, where the answer is 1.0 by definition. Reproduces the "What it reads" figures
of docs/performance.md (draft-head acceptance) and the EAGLE-3 head's model card.

    python scripts/logit_lens.py --data runs/data/smollm2 --shard -1 --examples 16 --layers 2,15,24,26,27,28,29

--data is a train.data output directory (shard_*.npz). Time: not timed (one float32 target forward
per example, one compile per 128-token length bucket).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data", required=True, help="a train.data output directory (shard_*.npz)")
    ap.add_argument("--shard", type=int, default=-1, help="which shard (default: the last)")
    ap.add_argument("--examples", type=int, default=16)
    ap.add_argument("--layers", default="2,15,27,29", help="target layers whose entering stream is read")
    args = ap.parse_args(argv)
    shards = sorted(glob.glob(os.path.join(args.data, "shard_*.npz")))
    if not shards:
        sys.exit(f"error: no shard_*.npz under {args.data}")
    layers = tuple(int(x) for x in args.layers.split(","))

    import jax
    import jax.numpy as jnp
    from eagle2_jax import load_target
    from train.loss import target_features
    t = load_target(args.model, dtype="float32", packed=False)
    c = t.config
    if any(not 0 <= i < c.num_hidden_layers for i in layers):
        sys.exit(f"error: layers must be in [0, {c.num_hidden_layers})")
    D = c.hidden_size
    ops = t.module.ops
    head_VD = np.asarray(ops.weight(t.params["embed"]) if c.tie_word_embeddings else np.asarray(t.params["lm_head"]).T)
    scale = np.asarray(ops.weight(t.params["norm"]["scale"]))
    features = jax.jit(lambda ids: target_features(t.module, t.params, ids, layers))

    z = np.load(shards[args.shard])
    hits, n = np.zeros(len(layers)), 0
    for e in range(min(args.examples, len(z["offsets"]) - 1)):
        a, b = z["offsets"][e], z["offsets"][e + 1]
        ids, keep = z["tokens"][a:b], z["loss_mask"][a:b].astype(bool)
        T = -(-len(ids) // 128) * 128  # (few shapes, few compiles)
        padded = np.zeros((1, T), np.int32)
        padded[0, :len(ids)] = ids
        F = np.asarray(features(jnp.asarray(padded)))[0, :len(ids)][keep]  # [N, A*D + D]
        own = (F[:, -D:] @ head_VD.T).argmax(1)  # the target's next token (final norm already applied)
        for j in range(len(layers)):
            h = F[:, j * D:(j + 1) * D]
            h = scale * h / np.sqrt((h * h).mean(1, keepdims=True) + c.rms_norm_eps)
            hits[j] += np.sum((h @ head_VD.T).argmax(1) == own)
        n += len(own)
    print(f"{n} assistant positions, {args.examples} examples of {shards[args.shard]}")
    for i, h in zip(layers, hits):
        print(f"entering layer {i}: top-1 equals the target's next token at {h / max(n, 1):.3f} of positions")


if __name__ == "__main__":
    main()
