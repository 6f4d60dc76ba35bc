"""Build a tiny random-weight Llama that the real mlx_lm.server can load and serve.

Nothing is downloaded: the BPE tokenizer is trained on a few sentences and the weights are
random, so generation is nonsense but every server code path is real. Used by the tests and by
`mlx-watchdog demo`; needs the `server` extra (mlx, mlx-lm, and tokenizers through them).
"""

from __future__ import annotations

import json
from pathlib import Path

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a watchdog probes the server with a tiny prompt",
    "ping pong hello world the model answers one token",
    "prefill takes time when the prompt is long and unique",
    "abandoned requests hold the scheduler of a serial server",
    "zero one two three four five six seven eight nine",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 1_000_000,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return int(tok.get_vocab_size())


def build_model(out: Path, *, heads: int = 4) -> Path:
    """Write a loadable model folder into `out` and return it. `heads=2` makes each head 32
    wide, which a quantized KV cache (`--kv-bits 8 --kv-group-size 32`) needs."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    return out


if __name__ == "__main__":
    import sys

    print(build_model(Path(sys.argv[1])))
