"""Benchmark plain decoding, EAGLE-2 and Hugging Face `generate` on EAGLE/MT-bench question files.

    python -m infer.bench --questions ../shared/data/eval/mt_bench.jsonl --limit 10
    python -m infer.bench --methods plain,hf --limit 5 --max-new-tokens 64     # ours vs transformers

One process, one machine. Multi-turn questions continue the conversation with the model's own
answers. Compile time is excluded from tokens/s and reported apart (our programs are compiled
ahead of time per shape bucket). Speedup = EAGLE-2 tokens/s / plain tokens/s; at temperature 0 the
EAGLE-2 output is checked token for token against plain decoding. Writes results.json,
results.md and results.png under --out, rewritten after every batch of questions; `--resume` keeps
the batches already there and runs the rest, so a long run survives an interruption:

    python -m infer.bench --limit 80 --batch 16 --methods eagle --out runs/bench/mt80 --resume
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time

from tqdm import tqdm

from eagle2_jax import generate, generate_vanilla
from eagle2_jax.platform import default_dtype, platform
from eagle2_jax.decoding.programs import enable_compile_cache
from eagle2_jax.loading.registry import resolve_source
from infer.cli import (Parser, add_backend_args, add_model_args, add_sampling_args, add_tree_args, fail, load_models,
                       positive_int, tree_of, writable_dir)
from infer.prompts import DEFAULT_QUESTIONS, load_questions, render


def parse(argv=None):
    ap = Parser(prog="python -m infer.bench", description=__doc__)
    ap.add_argument("--questions", default=DEFAULT_QUESTIONS, help="EAGLE/MT-bench jsonl (`turns`)")
    ap.add_argument("--limit", type=positive_int, default=None, help="first N questions")
    ap.add_argument("--categories", nargs="*", default=None, help="only these categories")
    ap.add_argument("--turns", type=positive_int, default=1, help="turns per question (MT-bench has 2; default 1)")
    ap.add_argument("--methods", default="plain,eagle", help="comma list of plain, eagle, hf, hf-pld")
    ap.add_argument("--hf-limit", type=positive_int, default=None,
                    help="run transformers (hf, hf-pld) on the first N questions only (it is the slow one); its "
                         "ratios then compare against ours on those same questions")
    ap.add_argument("--max-new-tokens", type=positive_int, default=256, help="new tokens per answer (default 256)")
    ap.add_argument("--batch", type=positive_int, default=1, help="prompts decoded together (first turns only when > 1)")
    add_model_args(ap)
    add_sampling_args(ap, top=False)
    add_tree_args(ap)
    add_backend_args(ap)
    ap.add_argument("--out", type=writable_dir, default="runs/bench", help="output directory (default runs/bench)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the batches of questions already answered in --out/results.json (same settings; "
                         "a larger --limit extends the run, a smaller one keeps the answers beyond it) and answer "
                         "only the rest. tokens/s then sums the "
                         "runs' seconds, so compare speeds within one uninterrupted run; tau is unaffected")
    return ap.parse_args(argv)


class Ours:
    def __init__(self, name, target, draft, tree, args):
        self.name, self.target, self.draft, self.tree, self.args = name, target, draft, tree, args

    def _generate(self, prompts, **extra):
        kw = dict(max_new_tokens=self.args.max_new_tokens, temperature=self.args.temperature,
                  eos_token_id=self.target.config.eos_token_id, seed=self.args.seed,
                  gpu_graphs=self.args.gpu_graphs, **extra)
        if self.draft is None:
            return generate_vanilla(self.target, prompts, **kw)
        return generate(self.target, self.draft, prompts, tree=self.tree, **kw)

    def __call__(self, prompts):
        tm = {}
        out = self._generate(prompts, timings=tm)
        return out.tokens, tm["run_s"], tm.get("compile_s", 0.0), out.accept_lengths

    def warm(self, prompts):
        """Compile for these prompts without generating (a warm-up run at temperature > 0 can take
        minutes: nothing stops it before max_new_tokens)."""
        self._generate(prompts, compile_only=True)


class HF:
    def __init__(self, name, target, args, pld=False):
        import torch  # optional: only the hf methods need it
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(os.cpu_count() or 1)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU where there is one, as ours
        path = resolve_source(args.model)
        kw = dict(dtype=torch.float32 if (default_dtype() if args.dtype == "auto" else args.dtype) == "float32"
                  else torch.bfloat16)
        if path.endswith(".gguf"):
            self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), **kw)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, **kw)
        self.model.to(self.device).eval()
        self.name, self.target, self.args, self.pld, self.torch = name, target, args, pld, torch

    def __call__(self, prompts):
        torch = self.torch
        outs, total = [], 0.0
        eos = self.target.config.eos_token_id
        for p in prompts:
            kw = dict(max_new_tokens=self.args.max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                      do_sample=self.args.temperature > 0)
            if self.args.temperature > 0:
                kw["temperature"] = self.args.temperature
            if self.pld:
                kw["prompt_lookup_num_tokens"] = 10
            ids = torch.tensor([p], device=self.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                r = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            outs.append(r[0, len(p):].tolist())  # (waits for the device)
            total += time.perf_counter() - t0
        return outs, total, 0.0, None


def main(argv=None):
    args = parse(argv)
    enable_compile_cache()  # a second run loads the compiled programs (EAGLE2_JAX_COMPILE_CACHE=0: off)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = set(methods) - {"plain", "eagle", "hf", "hf-pld"}
    if bad:
        fail(f"unknown method(s) {', '.join(sorted(bad))} (known: plain, eagle, hf, hf-pld)")
    questions = load_questions(args.questions, args.limit, args.categories)
    if not questions:
        fail("no questions selected")
    if "eagle" not in methods:
        args.draft = "none"
    target, draft = load_models(args, need_draft="eagle" in methods)
    tok = target.tokenizer
    if tok is None:
        fail(f"{args.model} has no tokenizer (random weights?): time it with python -m infer.roundcost")
    runners = {}
    tree = None
    for m in methods:
        if m == "plain":
            runners[m] = Ours(m, target, None, None, args)
        elif m == "eagle":
            tree = tree_of(args, draft, target, [render(tok, [{"role": "user", "content": q["turns"][0]}])
                                                 for q in questions[:2]], batch=args.batch)
            if tree is None:  # the head's tree.json: no tree pays at this batch size, so EAGLE-2 decodes plainly
                print(f"eagle: no tree pays at batch {args.batch} here; it decodes plainly", file=sys.stderr)
            runners[m] = Ours(m, target, draft if tree is not None else None, tree, args)
        else:
            try:
                runners[m] = HF(m, target, args, pld=(m == "hf-pld"))
            except ImportError:
                print(f"skipping {m}: torch/transformers not installed", file=sys.stderr)
    groups = [questions[i:i + args.batch] for i in range(0, len(questions), args.batch)]
    done = set()
    rows = []
    if args.resume:
        try:
            rows, done = resumed(args.out, settings(args, runners, tree), groups)
        except ValueError as e:
            fail(str(e))
    # warm-up: compile the buckets of a short prompt (ours), or one short run (transformers); reported, not timed
    warm = {}
    for m, r in runners.items():
        t0 = time.perf_counter()
        try:
            getattr(r, "warm", r)([render(tok, [{"role": "user", "content": "Hello!"}])] * args.batch)
        except ValueError as e:
            fail(str(e))
        warm[m] = time.perf_counter() - t0
    hf_groups = len(groups) if args.hf_limit is None else -(-args.hf_limit // args.batch)
    n_hf = sum(m.startswith("hf") for m in runners)
    total = len(questions) * (len(runners) - n_hf) + min(len(questions), hf_groups * args.batch) * n_hf
    bar = tqdm(total=total, unit="answer", desc="bench", dynamic_ncols=True)
    for g, group in enumerate(groups):
        if g in done:
            bar.update(sum(len(group) if not m.startswith("hf") or g < hf_groups else 0 for m in runners))
            continue
        convs = {m: [[] for _ in group] for m in runners}
        n_turns = 1 if args.batch > 1 else args.turns
        for turn in range(n_turns):
            for m, r in runners.items():
                if m.startswith("hf") and g >= hf_groups:
                    continue
                live = [i for i, q in enumerate(group) if turn < len(q["turns"])]
                if not live:
                    continue
                prompts = []
                for i in live:
                    convs[m][i].append({"role": "user", "content": group[i]["turns"][turn]})
                    prompts.append(render(tok, convs[m][i]))
                try:
                    toks, run_s, compile_s, acc = r(prompts)
                except ValueError as e:  # e.g. a conversation grown past the model's positions
                    fail(f"{m}, questions {[group[i].get('question_id') for i in live]}, turn {turn + 1}: {e} "
                         f"(the batches before it are in {args.out}; --resume continues)")
                for j, i in enumerate(live):
                    convs[m][i].append({"role": "assistant", "content": tok.decode(toks[j], skip_special_tokens=True)})
                    rows.append(dict(method=m, question_id=group[i].get("question_id"), category=group[i].get("category"),
                                     turn=turn, new_tokens=len(toks[j]), seconds=run_s / len(live), compile_s=compile_s / len(live),
                                     rounds=len(acc[j]) if acc else None,
                                     tau=(sum(acc[j]) / len(acc[j])) if acc and acc[j] else None, tokens=toks[j]))
                bar.update(len(live) if turn == 0 else 0)
        write_outputs(args.out, rows, _summary(rows, runners, args, tree, warm, target), figure=False)  # so far
    bar.close()
    summary = _summary(rows, runners, args, tree, warm, target)
    write_outputs(args.out, rows, summary)
    print(markdown(summary))


def settings(args, runners, tree):
    """What the answers depend on, recorded in results.json; a resumed run must match it."""
    return {"questions": os.path.abspath(args.questions), "categories": args.categories, "turns": args.turns,
            "methods": sorted(runners), "hf_limit": args.hf_limit, "model": args.model, "draft": args.draft,
            "tree": tree.__dict__ if tree else None, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "seed": args.seed, "batch": args.batch, "attention": args.attention,
            "dtype": args.dtype, "packed": args.packed, "full_draft_vocab": args.full_draft_vocab,
            "draft_dtype": args.draft_dtype}


def resumed(out, now, groups):
    """(rows, indices of done groups) from an earlier run's results.json in `out`: a group is done when
    every method answered every one of its questions; the rows of other groups are dropped (they are
    answered again, in the same batch as now). Questions this run does not select (a smaller --limit)
    keep the rows of those every method answered: a resumed run never loses finished answers."""
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        return [], set()
    try:
        with open(path) as f:
            old = json.load(f)
        before = old["summary"].get("settings")
        old["rows"]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a results file of infer.bench ({type(e).__name__}: {e}): "
                         "use another --out, or drop --resume to overwrite it") from None
    now = json.loads(json.dumps(now))  # (as it would read back: lists for tuples)
    if before != now:
        diff = sorted(k for k in set(now) | set(before or {}) if (before or {}).get(k) != now.get(k))
        raise ValueError(f"{path} was written with other settings ({', '.join(diff) or 'none recorded'}): "
                         "use another --out, or drop --resume to overwrite it")
    answered = collections.defaultdict(set)
    for r in old["rows"]:
        answered[r["method"]].add(r["question_id"])
    methods = [m for m in now["methods"] if not m.startswith("hf")] or now["methods"]
    done = {g for g, group in enumerate(groups)
            if all(q["question_id"] in answered[m] for m in methods for q in group)}
    keep = {q["question_id"] for g in done for q in groups[g]}
    selected = {q["question_id"] for group in groups for q in group}
    keep |= {i for i in set.intersection(*(answered[m] for m in methods)) if i not in selected}
    return [r for r in old["rows"] if r["question_id"] in keep], done


def _summary(rows, runners, args, tree, warm, target):
    summary = summarize(rows, runners, args, tree, warm)
    summary["settings"] = settings(args, runners, tree)
    module = getattr(target, "module", None)  # (test doubles have none)
    summary["cpu_kernels"] = getattr(getattr(module, "ops", None), "name", "") == "cpu"  # eagle2_jax.backends.cpu in use
    if platform() == "gpu":  # timings depend on it, answers do not
        summary["gpu_graphs"] = args.gpu_graphs
    return summary


def summarize(rows, runners, args, tree, warm):
    s = {"questions": args.questions, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
         "batch": args.batch, "tree": tree.__dict__ if tree else None, "warmup_s": warm, "methods": {}}
    for m in runners:
        rs = [r for r in rows if r["method"] == m]
        toks, secs = sum(r["new_tokens"] for r in rs), sum(r["seconds"] for r in rs)
        d = {"new_tokens": toks, "seconds": secs, "tokens_per_s": toks / secs if secs else 0.0,
             "compile_s": sum(r["compile_s"] for r in rs)}
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        if taus:
            d["tau"] = sum(r["new_tokens"] for r in rs) / max(1, sum(r["rounds"] for r in rs))
            by_cat = collections.defaultdict(lambda: [0, 0])  # category: [new tokens, rounds]
            for r in rs:
                by_cat[r["category"]][0] += r["new_tokens"]
                by_cat[r["category"]][1] += r["rounds"] or 0
            d["per_category_tau"] = {c: t / n for c, (t, n) in by_cat.items() if n}
        cats = collections.defaultdict(lambda: [0, 0.0])
        for r in rs:
            cats[r["category"]][0] += r["new_tokens"]
            cats[r["category"]][1] += r["seconds"]
        d["per_category_tokens_per_s"] = {c: t / x for c, (t, x) in cats.items() if x}
        s["methods"][m] = d
    M = s["methods"]
    if "plain" in M and "eagle" in M:
        s["speedup_eagle_vs_plain"] = M["eagle"]["tokens_per_s"] / M["plain"]["tokens_per_s"]
        s["per_category_speedup"] = {c: M["eagle"]["per_category_tokens_per_s"][c] / v
                                     for c, v in M["plain"]["per_category_tokens_per_s"].items()
                                     if c in M["eagle"]["per_category_tokens_per_s"]}
        if args.temperature == 0:
            a = {(r["question_id"], r["turn"]): r["tokens"] for r in rows if r["method"] == "plain"}
            b = {(r["question_id"], r["turn"]): r["tokens"] for r in rows if r["method"] == "eagle"}
            s["greedy_identical"] = all(a[k] == b.get(k) for k in a)
            if not s["greedy_identical"]:  # how many answers differ, and from which token on
                s["greedy_mismatches"] = {f"{q}/{t}": next((i for i, (x, y) in enumerate(zip(a[q, t], b[q, t]))
                                                           if x != y), min(len(a[q, t]), len(b[q, t])))
                                          for q, t in a if (q, t) in b and a[q, t] != b[q, t]}
    for hf in ("hf", "hf-pld"):
        if hf not in M or not M[hf]["tokens_per_s"]:
            continue
        keys = {(r["question_id"], r["turn"]) for r in rows if r["method"] == hf}
        s[f"{hf}_answers"] = len(keys)
        for ours in ("plain", "eagle"):
            if ours in M:  # on the answers transformers also gave (all of them unless --hf-limit)
                s[f"speedup_{ours}_vs_{hf}"] = _rate(rows, ours, keys) / M[hf]["tokens_per_s"]
    return s


def _rate(rows, method, keys):
    """tokens/s of `method` over the answers in `keys` ((question_id, turn) pairs)."""
    rs = [r for r in rows if r["method"] == method and (r["question_id"], r["turn"]) in keys]
    secs = sum(r["seconds"] for r in rs)
    return sum(r["new_tokens"] for r in rs) / secs if secs else 0.0


def markdown(s):
    lines = [f"questions: {os.path.basename(s['questions'])}, max_new_tokens {s['max_new_tokens']}, "
             f"temperature {s['temperature']}, batch {s['batch']}, tree {s['tree']}"
             + (f", few-row CPU kernels {'on' if s['cpu_kernels'] else 'off'}" if "cpu_kernels" in s else "")
             + (f", CUDA graphs {s['gpu_graphs']}" if "gpu_graphs" in s else ""), "",
             "| method | new tokens | seconds | tokens/s | tau | compile s (excluded) |", "|---|---|---|---|---|---|"]
    for m, d in s["methods"].items():
        tau = f"{d['tau']:.2f}" if "tau" in d else "-"
        lines.append(f"| {m} | {d['new_tokens']} | {d['seconds']:.1f} | {d['tokens_per_s']:.1f} | {tau} | "
                     f"{d['compile_s'] + s['warmup_s'].get(m, 0):.1f} |")
    for k in sorted(s):
        if k.startswith("speedup") or k.startswith("greedy_") or k.endswith("_answers"):
            v = s[k]
            lines.append(f"- {k}: {v:.2f}x" if isinstance(v, float) else f"- {k}: {v}")
    return "\n".join(lines)


def write_outputs(out, rows, summary, figure=True):
    """results.json + results.md (rewritten after every batch of questions, so an interrupted run keeps
    what it measured) and, at the end, results.png."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"summary": summary, "rows": rows}, f)
    os.replace(path + ".tmp", path)  # (a kill mid-write leaves the last batch's file whole, for --resume)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(summary) + "\n")
    if not figure:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sp = summary.get("per_category_speedup") or {}
    if sp:
        axes[0].bar(list(sp), list(sp.values()))
        axes[0].axhline(1.0, color="k", lw=0.8)
        axes[0].set_title("EAGLE-2 speedup over plain decoding")
        axes[0].tick_params(axis="x", rotation=45)
    taus = [r["tau"] for r in rows if r["tau"] is not None]
    if taus:
        axes[1].hist(taus, bins=20)
        axes[1].set_title("tau per answer")
        axes[1].set_xlabel("tokens per round")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "results.png"), dpi=100)


if __name__ == "__main__":
    main()
