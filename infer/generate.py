"""Generate text with EAGLE-2 speculative decoding (or plain decoding) from the command line.

    python -m infer.generate                                  # SmolLM2-135M-Instruct + shipped head
    python -m infer.generate --prompt "Write a haiku" --compare
    python -m infer.generate --mode vanilla --temperature 0.7 --top-p 0.9

The prompt is wrapped in the model's chat template (unless --raw); text streams as it is produced
and a closing line reports tokens, seconds, tokens/s, compile time and, for EAGLE-2, tau (average
tokens added per round, bonus included).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from eagle2_jax import generate, generate_vanilla, parse_mesh
from eagle2_jax.loading.registry import BASE_MODELS
from eagle2_jax.decoding.programs import enable_compile_cache
from infer.cli import (Parser, add_backend_args, add_model_args, add_sampling_args, add_tree_args, fail, load_models,
                       positive_int, tree_of)

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def build_parser() -> Parser:
    ap = Parser(prog="python -m infer.generate", description=__doc__)
    add_model_args(ap, allow_none_draft=True)
    ap.add_argument("--mode", choices=["auto", "eagle", "vanilla"], default="auto",
                    help="eagle: EAGLE-2 (needs a draft); vanilla: plain decoding; auto: eagle when a draft is found")
    ap.add_argument("--prompt", action="append", default=None,
                    help=f"user message; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    ap.add_argument("--raw", action="store_true",
                    help="do not apply the chat template to --prompt (always so for base models: gemma3-270m)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128, help="new tokens per prompt (default 128)")
    ap.add_argument("--no-stream", action="store_true", help="run the whole generation on device, print at the end")
    ap.add_argument("--compare", action="store_true",
                    help="also run plain decoding on the same prompts; report speedup and greedy identity")
    add_sampling_args(ap)
    add_tree_args(ap)
    add_backend_args(ap)
    ap.add_argument("--mesh", default=None, help="device mesh, e.g. 'data=2,model=4' (default: one device)")
    return ap


def encode_prompts(tok, texts, raw: bool, base: bool = False):
    """Token ids of the prompts: in the chat template, or as plain text (`raw`); a base model's plain
    text starts with the tokenizer's special tokens (Gemma's BOS)."""
    if raw or base:
        return [tok.encode(t, add_special_tokens=base) for t in texts]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False) for t in texts]


def main(argv=None):
    args = build_parser().parse_args(argv)
    enable_compile_cache()  # a second run loads the compiled programs (EAGLE2_JAX_COMPILE_CACHE=0: off)
    try:
        mesh = parse_mesh(args.mesh)
    except ValueError as e:
        fail(str(e))
    if args.mode == "vanilla":
        args.draft = "none"
    if args.mode == "eagle" and args.draft == "none":
        fail("--mode eagle needs a draft head: pass --draft (not 'none')")
    t0 = time.perf_counter()
    target, draft = load_models(args, need_draft=args.mode == "eagle", mesh=mesh)
    load_s = time.perf_counter() - t0
    tok = target.tokenizer
    if tok is None:
        fail("the model has no tokenizer; use the library API with token ids")
    texts = args.prompt or [DEFAULT_PROMPT]
    prompts = encode_prompts(tok, texts, args.raw, base=args.model in BASE_MODELS)
    # --mode eagle asks for a tree whatever the batch; auto follows the head's per-batch table
    batch = None if args.mode == "eagle" else len(prompts)
    tree = tree_of(args, draft, target, prompts, batch=batch) if draft is not None else None
    if draft is not None and tree is None:  # the head's tree.json: no tree pays at this batch size
        print(f"plain decoding: no tree pays at batch {len(prompts)} here ({draft.source}/tree.json)",
              file=sys.stderr)
        draft = None
    eos = target.config.eos_token_id if tok.eos_token_id is None else tok.eos_token_id
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.sample_top_k, eos_token_id=eos, seed=args.seed, gpu_graphs=args.gpu_graphs)
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
          f" ({target.num_params / 1e6:.0f}M params, {np.dtype(target.dtype).name}, loaded in {load_s:.1f}s)",
          file=sys.stderr)
    timings = {}
    try:
        if draft is not None:
            out = generate(target, draft, prompts, tree=tree, stream=stream if stream_rows else None,
                           timings=timings, **common)
        else:
            out = generate_vanilla(target, prompts, stream=stream if stream_rows else None, timings=timings, **common)
    except ValueError as e:
        fail(str(e))
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
