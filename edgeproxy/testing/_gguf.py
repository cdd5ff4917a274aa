"""A tiny llama-architecture GGUF model with random weights, built at test time.

The model exists so that the local-model fallback can be exercised with the
real llama.cpp on any machine, in a second, without downloading anything:
two transformer blocks, a 64-wide embedding and a ~600-token SentencePiece
vocabulary, quantized to ``Q8_0`` or ``Q4_0`` with the ``gguf`` package.
It speaks gibberish by design; only its shape is realistic.

Files are written on demand and never committed: :func:`tiny_llama_gguf`
keeps one file per set of parameters in a temporary folder of the process
(removed at exit), so a test session builds each variant once.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["CHATML_TEMPLATE", "TinyLlamaSpec", "tiny_llama_gguf", "write_tiny_llama_gguf"]

Quant = Literal["Q8_0", "Q4_0"]

# The chat template stored in the file: ChatML, as many small instruct models use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Pieces that tokenize common English into whole words; every prefix of each
# is in the vocabulary too, because SentencePiece merges grow one symbol at a time.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this "
    "have from or one had by word but not what all were we when your can said there "
    "use an each which she do how their if will up other about out many then them "
    "these so some her would make like him into time has look two more write go see "
    "number no way could people my than first water been call who oil its now find "
    "hello edge proxy model local region answer token stream cache fallback"
).split()

_SPACE = "\u2581"  # SentencePiece's word-boundary marker

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


@dataclass(frozen=True)
class TinyLlamaSpec:
    """The shape of the generated model. Every width is a multiple of 32 (one quant block)."""

    quant: Quant = "Q8_0"
    seed: int = 0
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 128
    context_length: int = 4096

    def __post_init__(self) -> None:
        if self.quant not in ("Q8_0", "Q4_0"):
            raise ValueError(f"quant must be 'Q8_0' or 'Q4_0', not {self.quant!r}")
        if self.n_embd % 32 or self.n_ff % 32:
            raise ValueError("n_embd and n_ff must be multiples of 32 (the quant block size)")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError("n_head must divide n_embd, and n_head_kv must divide n_head")

    @property
    def file_name(self) -> str:
        return (
            f"tiny-llama-{self.n_layer}x{self.n_embd}-ff{self.n_ff}-h{self.n_head}"
            f"-kv{self.n_head_kv}-ctx{self.context_length}-s{self.seed}-{self.quant.lower()}.gguf"
        )


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [_UNKNOWN, _CONTROL, _CONTROL, _CONTROL, _CONTROL]
    # Byte fallback: any text tokenizes, whatever the vocabulary lacks.
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    pieces: list[str] = [_SPACE] + [chr(c) for c in range(0x21, 0x7F)]
    seen = set(pieces)
    for word in _WORDS:
        full = _SPACE + word
        for end in range(2, len(full) + 1):
            piece = full[:end]
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
    tokens += pieces
    types += [_NORMAL] * len(pieces)
    # SentencePiece merges by score: longer pieces score higher so whole words win.
    scores = [0.0] * (len(tokens) - len(pieces)) + [float(len(p)) - 100.0 for p in pieces]
    return tokens, scores, types


def write_tiny_llama_gguf(path: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Write a tiny random-weight llama GGUF (quantized per ``spec``) to ``path``.

    The file carries a SentencePiece tokenizer with byte fallback, BOS/EOS
    and ChatML special tokens, and a ChatML chat template, so llama.cpp loads
    it like any instruct model. Needs ``numpy`` and ``gguf`` (the ``testing``
    extra).
    """
    try:
        import numpy as np
        from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
        from gguf.quants import quantize
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "building the test model needs numpy and gguf; install edgeproxy[testing]"
        ) from exc

    spec = spec or TinyLlamaSpec()
    path = Path(path)
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    head_dim = spec.n_embd // spec.n_head
    qtype = GGMLQuantizationType[spec.quant]
    file_type = LlamaFileType.MOSTLY_Q8_0 if spec.quant == "Q8_0" else LlamaFileType.MOSTLY_Q4_0
    rng = np.random.default_rng(spec.seed)

    def matrix(rows: int, cols: int, scale: float) -> Any:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    # Write to a temporary name first: a reader never sees half a file.
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, "llama")
    writer.add_name("edgeproxy tiny llama (random weights)")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    def add(name: str, data: Any) -> None:
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    def add_norm(name: str) -> None:
        writer.add_tensor(name, np.ones(spec.n_embd, dtype=np.float32))

    # numpy shapes are (rows, cols) = ggml's (ne1, ne0); rows of ne0 values are quantized.
    add("token_embd.weight", matrix(n_vocab, spec.n_embd, 1.0))
    kv_width = head_dim * spec.n_head_kv
    attn = 1.0 / spec.n_embd**0.5
    for i in range(spec.n_layer):
        add_norm(f"blk.{i}.attn_norm.weight")
        add(f"blk.{i}.attn_q.weight", matrix(spec.n_embd, spec.n_embd, attn))
        add(f"blk.{i}.attn_k.weight", matrix(kv_width, spec.n_embd, attn))
        add(f"blk.{i}.attn_v.weight", matrix(kv_width, spec.n_embd, attn))
        add(f"blk.{i}.attn_output.weight", matrix(spec.n_embd, spec.n_embd, attn))
        add_norm(f"blk.{i}.ffn_norm.weight")
        add(f"blk.{i}.ffn_gate.weight", matrix(spec.n_ff, spec.n_embd, attn))
        add(f"blk.{i}.ffn_up.weight", matrix(spec.n_ff, spec.n_embd, attn))
        add(f"blk.{i}.ffn_down.weight", matrix(spec.n_embd, spec.n_ff, 1.0 / spec.n_ff**0.5))
    add_norm("output_norm.weight")
    output = matrix(n_vocab, spec.n_embd, 3.0 / spec.n_embd**0.5)
    # Control and byte tokens get a zero logit while word pieces spread around
    # it, so sampling practically never ends the answer early or emits broken
    # UTF-8: an answer runs to max_tokens, which keeps tests deterministic.
    for token_id, kind in enumerate(types):
        if kind != _NORMAL:
            output[token_id] = 0.0
    add("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


_lock = threading.Lock()
_cache: dict[tuple[TinyLlamaSpec, Path | None], Path] = {}
_session_dir: Path | None = None


def _default_dir() -> Path:
    global _session_dir
    if _session_dir is None:
        _session_dir = Path(tempfile.mkdtemp(prefix="edgeproxy-gguf-"))
        atexit.register(shutil.rmtree, _session_dir, ignore_errors=True)
    return _session_dir


def tiny_llama_gguf(
    quant: Quant = "Q8_0", *, directory: str | Path | None = None, **shape: Any
) -> Path:
    """The path of a tiny random-weight llama GGUF, built on first use and then reused.

    Without ``directory`` the file goes to a temporary folder of this process,
    deleted at exit, so each test session builds it once. ``shape`` overrides
    :class:`TinyLlamaSpec` fields (``seed``, ``n_embd``, ``n_layer``, ...).
    Thread-safe.
    """
    spec = TinyLlamaSpec(quant=quant, **shape)
    folder = Path(directory) if directory is not None else None
    with _lock:
        cached = _cache.get((spec, folder))
        if cached is not None and cached.exists():
            return cached
        target = (folder or _default_dir()) / spec.file_name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            write_tiny_llama_gguf(target, spec)
        _cache[(spec, folder)] = target
        return target
