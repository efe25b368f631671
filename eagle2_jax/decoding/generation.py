"""`generate`: EAGLE-2 speculative decoding of a batch of token-id prompts, the library's entry point.

It checks the request, resolves the tree (autotune.resolve_tree), pads the batch and runs the
round's programs (eagle.PREFILL, then eagle.LOOP on device, or eagle.STREAM_STEP from the host; programs.run).
"""
from __future__ import annotations

from typing import Callable, Optional

from .autotune import resolve_tree
from .batching import GenerateOutput
from ..config import SamplingConfig, TreeConfig
from ..models.draft import Draft, check_compatible
from .eagle import PROGRAMS, program_inputs, scratch_slots
from ..models.target import Target, is_abstract
from .programs import gpu_graph_options, run
from .spec import RoundSpec
from ..sharding import to_host
from .vanilla import generate_vanilla


def generate(target: Target, draft: Draft, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, eos_token_id: Optional[int] = None, seed: int = 0,
             tree=None, stream: Optional[Callable[[int, list], None]] = None,
             timings: Optional[dict] = None, compile_only: bool = False,
             gpu_graphs: str = "body") -> Optional[GenerateOutput]:
    """EAGLE-2 speculative decoding of token-id prompts; lossless with respect to the target.

    `tree`: a TreeConfig; None: the head's tree for this platform and this many prompts (where the
    head's tree.json says no tree pays at this batch size, plain decoding: every round adds one
    token), else the reference tree; "auto": the tree size timed on this machine (both through
    autotune.resolve_tree, as the command line).
    Returns `.tokens` (new tokens per prompt, EOS kept) and `.accept_lengths` (tokens added per
    round, bonus included; tau is their mean). With `stream`, rounds are stepped from the host and
    stream(row, new_tokens) is called as tokens come. With `timings` (a dict), records compile_s and
    run_s. With `compile_only`, compiles the prefill and decode programs these prompts and settings
    need (cached for later calls), runs nothing and returns None; it also works for abstract params
    (load_target(..., abstract=True)). `gpu_graphs`: the decode loop's CUDA graphs on a GPU ("body",
    "loop" or "off", eagle2_jax.decoding.programs).
    """
    gpu_graph_options(gpu_graphs)  # a bad mode fails here on every platform
    if tree is None or isinstance(tree, str):
        if tree not in (None, "auto"):
            raise ValueError(f"tree must be a TreeConfig, 'auto' or None, got {tree!r}")
        tree = resolve_tree(draft, total_tokens=tree, batch=len(prompts), target=target, prompts=prompts)
        if tree is None:
            check_compatible(draft.config, target.config)
            return _plain(target, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, eos_token_id=eos_token_id, seed=seed, stream=stream, timings=timings,
                          compile_only=compile_only, gpu_graphs=gpu_graphs)
    if not isinstance(tree, TreeConfig):
        raise ValueError(f"tree must be a TreeConfig, 'auto' or None, got {tree!r}")
    check_compatible(draft.config, target.config)
    sampling = SamplingConfig(temperature, top_k, top_p)
    if tree.top_k > target.config.vocab_size:
        raise ValueError(f"tree top_k {tree.top_k} exceeds the vocabulary ({target.config.vocab_size})")
    if draft.proposal_vocab_size is not None and tree.top_k > draft.proposal_vocab_size:
        raise ValueError(f"tree top_k {tree.top_k} exceeds the draft head's vocabulary ({draft.proposal_vocab_size})")
    if (target.abstract or is_abstract(draft.params)) and not compile_only:
        raise ValueError("this target or draft has abstract params (shapes only): use compile_only=True")
    b, args, static = program_inputs(target, draft, prompts, max_new_tokens, eos_token_id, seed, sampling,
                                     scratch_slots(tree))
    st = run(PROGRAMS, args, static, RoundSpec.of(target, draft, tree), b.num_rows, stream, timings, compile_only,
             gpu_graphs)
    if compile_only:
        return None
    out, n_out, acc, rounds = map(to_host, (st.out_BM, st.n_out_B, st.accept_BR, st.rounds_B))
    rows = range(b.num_rows)
    return GenerateOutput(tokens=[out[r, :n_out[r]].tolist() for r in rows],
                          accept_lengths=[acc[r, :rounds[r]].tolist() for r in rows],
                          rounds=[int(rounds[r]) for r in rows])


def _plain(target: Target, prompts, **kw) -> Optional[GenerateOutput]:
    """Plain decoding as a generation whose every round adds one token (tau 1)."""
    out = generate_vanilla(target, prompts, **kw)
    if out is None:
        return None
    steps = [max(len(t) - 1, 0) for t in out.tokens]  # the first token comes from the prefill
    return GenerateOutput(tokens=out.tokens, accept_lengths=[[1] * n for n in steps], rounds=steps)
