"""Generate text with EAGLE-2 speculative decoding (or plain decoding) from the command line.

    python -m infer.generate                                  # SmolLM2-135M-Instruct + shipped head
    python -m infer.generate --prompt "Write a haiku" --compare
    python -m infer.generate --mode vanilla --temperature 0.7 --top-p 0.9

The prompt is wrapped in the model's chat template (unless --raw); text streams as it is produced
and a closing line reports tokens, seconds, tokens/s, compile time and, for EAGLE-2, tau (average
tokens added per round, bonus included).
"""
from __future__ import annotations

import os
import sys
import time

from infer.cli import Parser, nonneg_float, nonneg_int, positive_int, probability, tree_size

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def build_parser() -> Parser:
    ap = Parser(prog="python -m infer.generate", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="target: a named model, a Hugging Face directory (config.json + safetensors) or a .gguf file")
    ap.add_argument("--draft", default="auto",
                    help="draft head: 'auto' (the head shipped for --model, if any), 'none', a named head, "
                         "or a directory in the EAGLE format or ours")
    ap.add_argument("--mode", choices=["auto", "eagle", "vanilla"], default="auto",
                    help="eagle: EAGLE-2 (needs a draft); vanilla: plain decoding; auto: eagle when a draft is found")
    ap.add_argument("--prompt", action="append", default=None,
                    help=f"user message; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    ap.add_argument("--raw", action="store_true", help="do not apply the chat template to --prompt")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128, help="new tokens per prompt (default 128)")
    ap.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy (default); > 0 samples")
    ap.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    ap.add_argument("--sample-top-k", type=nonneg_int, default=0, help="sample only among the k most likely tokens (0: off)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed; rows draw independent numbers")
    ap.add_argument("--depth", type=positive_int, default=None, help="EAGLE-2 draft passes after the root's children (default from the head, else 5)")
    ap.add_argument("--top-k", type=positive_int, default=None, help="EAGLE-2 children per node / frontier width (default from the head, else 10)")
    ap.add_argument("--total-tokens", type=tree_size, default=None,
                    help="EAGLE-2 tokens verified per round, root included (default from the head, else 60); "
                         "'auto' times rounds on this machine and picks the size with the best expected tokens/s")
    ap.add_argument("--attention", choices=["xla", "pallas"], default="xla",
                    help="pallas: attention as one Pallas kernel reading only the live cache blocks (GPU/TPU; "
                         "eagle2_jax.pallas, not yet measured on a device, so not the default)")
    ap.add_argument("--gpu-graphs", choices=["body", "loop", "off"], default=None,
                    help="GPU: CUDA graphs of the on-device decode loop (default $EAGLE2_JAX_GPU_GRAPHS, else body: "
                         "XLA's own, one graph per step or round with the host waiting on the loop condition each "
                         "time; loop: the whole loop in one graph, no wait; off: none), used with --no-stream or "
                         "several prompts (a streamed prompt is stepped from the host). Outputs are the same")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="parameter and cache dtype; auto: float32 on CPU, bfloat16 on GPU/TPU")
    ap.add_argument("--no-packed", dest="packed", action="store_false",
                    help="dequantise a GGUF target to --dtype in memory. By default, float32 on one CPU device, its "
                         "Q4_1/Q8_0 blocks stay packed and the CPU kernels read them: the same float32 weights and "
                         "arithmetic from a sixth of the memory traffic (eagle2_jax.cpu.packed; also EAGLE2_JAX_PACKED=0)")
    ap.add_argument("--full-draft-vocab", action="store_true",
                    help="draft over the whole vocabulary instead of the head's draft_vocab.json subset (changes "
                         "which tokens are proposed, so tau moves by a few percent per question; never the output)")
    ap.add_argument("--draft-dtype", choices=["float32", "bfloat16"], default=None,
                    help="draft head dtype (default: the target's). The draft only proposes, so outputs are unchanged; "
                         "bfloat16 halves its weight traffic where bf16 matmuls are native (GPU/TPU), but was slower "
                         "on XLA:CPU here")
    ap.add_argument("--mesh", default=None, help="device mesh, e.g. 'data=2,model=4' (default: one device)")
    ap.add_argument("--no-stream", action="store_true", help="run the whole generation on device, print at the end")
    ap.add_argument("--compare", action="store_true",
                    help="also run plain decoding on the same prompts; report speedup and greedy identity")
    return ap


def jnp_name(dtype) -> str:
    import numpy as np
    return np.dtype(dtype).name


def tree_for(args, draft, target=None, prompts=None):
    """The tree: flags over the head's tree.json for this platform over the reference tree
    (eagle2_jax.defaults, as the library's generate); total_tokens 'auto' is tuned."""
    from eagle2_jax import TreeConfig
    from eagle2_jax.defaults import head_tree
    d = head_tree(getattr(draft, "source", None))
    for k in ("depth", "top_k", "total_tokens"):
        v = getattr(args, k)
        if v is not None:
            d[k] = v
    if d.get("total_tokens") == "auto":
        from eagle2_jax.autotune import choose_tree
        base = TreeConfig()
        choice = choose_tree(target, draft, prompts, depth=d.get("depth", base.depth), top_k=d.get("top_k", base.top_k))
        for r in choice.table:
            print(f"  total_tokens {r['total_tokens']:3d}: expected tau {r['expected_tau']:.2f}, round "
                  f"{r['round_ms']:.1f} ms, ~{r['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
        print(f"auto tree: {choice.tree}", file=sys.stderr)
        return choice.tree
    return TreeConfig(**d)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.gpu_graphs:  # read when the decode loop compiles (eagle2_jax.defaults.gpu_graphs)
        from eagle2_jax.defaults import GPU_GRAPHS_SWITCH
        os.environ[GPU_GRAPHS_SWITCH] = args.gpu_graphs
    from eagle2_jax.programs import enable_compile_cache
    enable_compile_cache()  # a second run loads the compiled programs (EAGLE2_JAX_COMPILE_CACHE=0: off)
    from eagle2_jax import CheckpointError, generate, generate_vanilla, load_draft, load_target, parse_mesh
    from eagle2_jax.draft_io import NAMED_DRAFTS

    try:
        mesh = parse_mesh(args.mesh)
        t0 = time.perf_counter()
        target = load_target(args.model, dtype=args.dtype, mesh=mesh, packed=None if args.packed else False)
        draft = None
        if args.mode != "vanilla" and args.draft != "none":
            name = args.model if args.draft == "auto" else args.draft
            if args.draft != "auto" or (name in NAMED_DRAFTS and os.path.isdir(NAMED_DRAFTS[name])):
                draft = load_draft(name, target, dtype=args.draft_dtype, draft_vocab=not args.full_draft_vocab)
        if args.mode == "eagle" and draft is None:
            raise CheckpointError("--mode eagle needs a draft head: pass --draft (not 'none')" if args.draft == "none"
                                  else f"--mode eagle needs a draft head: none is shipped for {args.model!r}; pass --draft")
        from eagle2_jax import pallas
        target, draft = pallas.by_name(args.attention, target, draft)
        load_s = time.perf_counter() - t0
    except (CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    tok = target.tokenizer
    if tok is None:
        sys.exit("error: the model has no tokenizer; use the library API with token ids")
    texts = args.prompt or [DEFAULT_PROMPT]
    prompts = []
    for t in texts:
        if args.raw:
            prompts.append(tok.encode(t, add_special_tokens=False))
        else:
            s = tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            prompts.append(tok.encode(s, add_special_tokens=False))
    try:
        tree = tree_for(args, draft, target, prompts) if draft is not None else None
    except ValueError as e:
        sys.exit(f"error: {e}")
    eos = target.config.eos_token_id if tok.eos_token_id is None else tok.eos_token_id
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.sample_top_k, eos_token_id=eos, seed=args.seed)
    stream_rows = len(prompts) == 1 and not args.no_stream
    printed = []

    def stream(row, new):
        printed.extend(new)
        text = tok.decode(printed, skip_special_tokens=True)
        prev = tok.decode(printed[:-len(new)], skip_special_tokens=True) if len(new) < len(printed) else ""
        sys.stdout.write(text[len(prev):])
        sys.stdout.flush()

    mode = "plain" if draft is None else "EAGLE-2, EAGLE-3 head" if draft.arch == "eagle3" else "EAGLE-2"
    print(f"[{mode}] {args.model}" + (f" + draft {draft.source} {tree}" if draft else "") +
          f" ({target.num_params / 1e6:.0f}M params, {jnp_name(target.dtype)}, loaded in {load_s:.1f}s)", file=sys.stderr)
    timings = {}
    try:
        if draft is not None:
            out = generate(target, draft, prompts, tree=tree, stream=stream if stream_rows else None,
                           timings=timings, **common)
        else:
            out = generate_vanilla(target, prompts, stream=stream if stream_rows else None, timings=timings, **common)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not stream_rows:
        for i, toks in enumerate(out.tokens):
            print(f"--- [{i}] {texts[i]!r}\n{tok.decode(toks, skip_special_tokens=True)}")
    else:
        print()
    n = sum(len(t) for t in out.tokens)
    line = (f"{n} tokens in {timings['run_s']:.2f}s ({n / timings['run_s']:.1f} tokens/s), "
            f"compile {timings.get('compile_s', 0.0):.1f}s")
    if out.tau is not None:
        line += f", tau {out.tau:.2f} over {sum(out.rounds)} rounds"
    print(line, file=sys.stderr)
    if args.compare:
        base = {}
        ref = generate_vanilla(target, prompts, timings=base, **common)
        m = sum(len(t) for t in ref.tokens)
        speed, base_speed = n / timings["run_s"], m / base["run_s"]
        same = ref.tokens == out.tokens
        print(f"plain decoding: {m} tokens in {base['run_s']:.2f}s ({base_speed:.1f} tokens/s, compile "
              f"{base.get('compile_s', 0.0):.1f}s); speedup {speed / base_speed:.2f}x; outputs "
              + ("identical" if same else ("differ (sampling)" if args.temperature > 0 else "DIFFER")), file=sys.stderr)
        if args.temperature == 0 and not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
