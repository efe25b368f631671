"""The networks: the target (Llama, Qwen, Gemma families in one scanned stack), its layers and KV
caches, the EAGLE-2 and EAGLE-3 draft heads, and the `ops` seam every layer calls through (dense,
attention, LM head, embedding) with the per-layer weight layout (`layer_list`)."""
