"""The generated tiny GGUF model: a valid llama file, quantized, cached, and loadable."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the test model needs gguf (pip install 'edgeproxy[testing]')")
pytest.importorskip("numpy", reason="the test model needs numpy (pip install 'edgeproxy[testing]')")

from gguf import GGMLQuantizationType, GGUFReader  # noqa: E402

from edgeproxy.testing import TinyLlamaSpec, tiny_llama_gguf, write_tiny_llama_gguf  # noqa: E402

requires_llama = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'edgeproxy[local]')",
)


def _field(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_a_quantized_llama_with_a_tokenizer(tmp_path: Path, quant: str) -> None:
    path = write_tiny_llama_gguf(tmp_path / "m.gguf", TinyLlamaSpec(quant=quant))  # type: ignore[arg-type]
    reader = GGUFReader(path)
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == 2
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert isinstance(tokens, list)
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and "<0x0A>" in tokens
    assert "<|im_start|>" in str(_field(reader, "tokenizer.chat_template"))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType[quant]
    assert types["token_embd.weight"] == GGMLQuantizationType[quant]
    assert types["output_norm.weight"] == GGMLQuantizationType.F32
    assert len(types) == 3 + 9 * 2
    assert not list(tmp_path.glob("*.partial"))


def test_built_once_per_session_outside_the_repository() -> None:
    first = tiny_llama_gguf("Q8_0")
    mtime = first.stat().st_mtime_ns
    assert tiny_llama_gguf("Q8_0") == first
    assert first.stat().st_mtime_ns == mtime
    assert tiny_llama_gguf("Q4_0") != first
    assert tiny_llama_gguf("Q8_0", seed=1) != first
    repo = Path(__file__).resolve().parents[2]
    assert repo not in first.resolve().parents


def test_explicit_folder_and_bad_shapes(tmp_path: Path) -> None:
    path = tiny_llama_gguf("Q4_0", directory=tmp_path)
    assert path.parent == tmp_path and path.stat().st_size > 50_000
    with pytest.raises(ValueError, match="multiples of 32"):
        TinyLlamaSpec(n_embd=48)
    with pytest.raises(ValueError, match="quant"):
        TinyLlamaSpec(quant="Q5_K")  # type: ignore[arg-type]


@pytest.mark.model
@requires_llama
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_llama_cpp_loads_it_and_generates(quant: str) -> None:
    import llama_cpp

    from edgeproxy._local.binding import new_llama

    # As the local model loads it: clear of ggml's AMX kernels where those are miscompiled.
    llm = new_llama(
        llama_cpp,
        model_path=str(tiny_llama_gguf(quant)),  # type: ignore[arg-type]
        n_ctx=128,
        n_threads=1,
        verbose=False,
    )
    try:
        prompt = llm.tokenize(b"hello edge proxy", add_bos=True)
        assert prompt[0] == llm.token_bos()
        assert len(prompt) <= 6  # whole-word pieces, not bytes
        out = llm.create_completion("hello", max_tokens=12, temperature=0)
        assert out["usage"]["completion_tokens"] == 12  # never stops early by design
        assert out["choices"][0]["text"].strip()
    finally:
        llm.close()
