"""A tiny random-weight llama model as GGUF, for the real llama-server: no download.

The vocabulary is SentencePiece-style byte fallback (every byte is a token), so any prompt
tokenizes; the weights are small random numbers, so the answers are nonsense but real.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def build(
    path: Path,
    *,
    n_embd: int = 384,
    n_layer: int = 6,
    n_ff: int = 1024,
    n_head: int = 6,
    n_ctx: int = 16384,
    seed: int = 0,
) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    # GPT-2 style byte-level BPE with no merges: each byte is a token, and tokenizing is
    # linear (a SentencePiece byte-fallback vocabulary took seconds for a 12 kB prompt).
    tokens = [*_byte_symbols(), "<|endoftext|>", "<|im_start|>", "<|im_end|>", "ab"]
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 3
    types.append(gguf.TokenType.NORMAL)
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("mlx-watchdog tiny test model")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])  # llama.cpp refuses a BPE vocabulary without merges
    w.add_bos_token_id(256)
    w.add_eos_token_id(256)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def t(name: str, *shape: int, scale: float = 0.02) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str) -> None:
        w.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    t("token_embd.weight", n_vocab, n_embd)
    ones("output_norm.weight")
    t("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        ones(f"blk.{i}.attn_norm.weight")
        t(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        t(f"blk.{i}.attn_k.weight", n_embd, n_embd)
        t(f"blk.{i}.attn_v.weight", n_embd, n_embd)
        t(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        ones(f"blk.{i}.ffn_norm.weight")
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]
