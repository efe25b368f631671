"""Decoding: the EAGLE-2 round (tree: expand and rerank; verify: greedy and lossless sampling
acceptance; eagle: the round and its programs), plain decoding (vanilla), logits processing and
sampling, batching into buckets, the compiled-program cache and drivers, the default tree per platform
and batch size, and `generate`."""
