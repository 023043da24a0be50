"""Deterministic random-weight Llama models with a locally trained tokenizer (no hub).

``tiny`` keeps tests fast; ``small`` makes recomputing a 2K-token prompt take
seconds on one core, so loading vs recomputing is a real choice. Weights are
scaled up from the usual 0.02 init: with the default scale a random model's
greedy output barely depends on the prompt, and then no test can tell right KV
from wrong (``check_sensitivity`` guards this).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import msgspec

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, hidden=256, heads=4, kv_heads=2, vocab=2048, seed=0),
    "small": dict(layers=8, hidden=1024, heads=16, kv_heads=4, vocab=2048, seed=0),
}
CONTEXT = 8192
INIT_STD = 0.08
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


class ModelSpec(msgspec.Struct, frozen=True):
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seed: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


_WORDS = (
    "the of and to in is that it for on with as was at by an be this from or have are not "
    "system user assistant prompt cache token block layer store transfer decode prefill model "
    "request engine memory disk network latency bandwidth master segment chunk key value "
    "query answer document chapter section paragraph table figure result method data time"
).split()


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pseudo = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(3000)]
    vocab = _WORDS + pseudo
    return [
        " ".join(rng.choice(vocab) for _ in range(rng.randint(8, 40))) + rng.choice([".", "?", "!", ","])
        for _ in range(n_lines)
    ]


def _train_tokenizer(spec: ModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=CONTEXT,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build(preset: str, out_dir: str | os.PathLike, **overrides: int) -> Path:
    """Build (or reuse, when the same spec is already there) a model directory."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose from {sorted(PRESETS)}")
    params = dict(PRESETS[preset])
    params.update({k: v for k, v in overrides.items() if v is not None})
    spec = ModelSpec(**params)
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError("hidden must be a multiple of heads, heads a multiple of kv_heads")
    out = Path(out_dir)
    stamp = out / "mctier-spec.json"
    want = json.dumps({"preset": preset, **msgspec.to_builtins(spec), "init_std": INIT_STD}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want and (out / "model.safetensors").exists():
        return out

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(spec, out)
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.hidden * 2,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=CONTEXT,
        initializer_range=INIT_STD,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(want)
    return out
