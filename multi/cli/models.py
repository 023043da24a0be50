"""Deterministic random-weight Llama models with a locally trained tokenizer (no hub).

Models are defined by what they are for, not by one shape:

- ``tiny`` (2 layers, hidden 256) keeps the test suite quick on every CPU class;
- ``tiny-swa`` and ``tiny-swa-all`` are ``tiny`` with sliding-window attention (a 64-token
  window), for what the tiers do with such models (``kvcore.kvgroups``,
  ``kvcore.vllm_glue.require_full_attention``): ``tiny-swa`` interleaves sliding and full
  layers (Gemma-2 style ``layer_types``), ``tiny-swa-all`` slides on every layer (Mistral
  style ``sliding_window``). The store and P2P tiers and ``TieredHMAConnector`` (``SupportsHMA``)
  serve both with vLLM's hybrid allocator on; with ``TieredConnector`` (no ``SupportsHMA``) vLLM
  allocates every layer's pages for every token of ``tiny-swa`` (served) but frees
  ``tiny-swa-all``'s behind the window (refused);
- ``small`` is the model on which loading versus recomputing is a real decision: a
  2K-token prefill should take 1 to 3 s in a vLLM engine on one core of the machine
  at hand. Its shape is picked from ``LADDER`` by measuring: each rung (cheapest
  first) runs one 2K-token forward pass in the engines' dtype on one core, in the
  engines' environment (:func:`kvcore.platform.engine_env`, so the AVX2 simulation
  applies); the estimate is that time times ``ENGINE_OVER_HF`` (a vLLM engine's
  prefill against this Hugging Face forward, measured on both CPU classes). Rungs are
  measured until one reaches the band's lower edge, and that one is taken: the
  cheapest shape on which recomputing 2K tokens costs a second, which keeps the tests
  and the demo as quick as the purpose allows. When it overshoots the band's upper
  edge, the rung below is taken instead.

Weights are always saved as bf16, which loads in both dtypes (float32 engines
upcast exactly), so a bf16 and a float32 engine run the same weights. The chosen
shape, the dtype it was sized for, the CPU class and the measured speed are written
to ``mctier-spec.json`` beside the weights; a directory built for the same preset,
dtype and CPU class is reused as it is.

Weights are scaled up from the usual 0.02 init: with the default scale a random
model's greedy output barely depends on the prompt, and then no test can tell right
KV from wrong (``check_sensitivity`` guards this).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, hidden=256, heads=4, kv_heads=2, vocab=2048, seed=0),
    # Layer 0 slides, layer 1 attends fully; vLLM's Llama reads both keys from config.json.
    "tiny-swa": dict(layers=2, hidden=256, heads=4, kv_heads=2, vocab=2048, seed=0, window=64, full_every=2),
    "tiny-swa-all": dict(layers=2, hidden=256, heads=4, kv_heads=2, vocab=2048, seed=0, window=64),
    # The shape of "small" when measuring is skipped (explicit overrides fill it in).
    "small": dict(layers=8, hidden=1024, heads=16, kv_heads=4, vocab=2048, seed=0),
}
# Candidate shapes of "small", cheapest first (head size 64 everywhere: a size the CPU
# attention backend supports). Each rung costs roughly 1.5 to 2.5 times the one before.
LADDER: list[dict[str, int]] = [
    dict(layers=2, hidden=512, heads=8, kv_heads=2),
    dict(layers=4, hidden=512, heads=8, kv_heads=2),
    dict(layers=4, hidden=768, heads=12, kv_heads=4),
    dict(layers=6, hidden=1024, heads=16, kv_heads=4),
    dict(layers=8, hidden=1024, heads=16, kv_heads=4),
    dict(layers=12, hidden=1024, heads=16, kv_heads=4),
    dict(layers=16, hidden=1280, heads=20, kv_heads=4),
]
TARGET_S = (1.0, 3.0)  # a 2K-token prefill in one engine on one core
PROBE_TOKENS = 2048
# vLLM engine prefill / HF forward of the same 2K tokens on one core, by dtype, as measured
# on AMX (bf16) and the simulated AVX2 paths (float32) (docs/benchmarks/cpu-classes.md).
ENGINE_OVER_HF = {"bfloat16": 1.05, "float32": 1.8, "float16": 1.8}
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
    window: int = 0  # sliding-window length in tokens; 0: full attention everywhere
    full_every: int = 0  # with a window: layers full_every-1, 2*full_every-1, ... attend fully; 0: none do

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


def _attention_kwargs(spec: ModelSpec) -> dict:
    """Sliding-window keys of config.json. Hugging Face's Llama ignores them (only the random
    weights come from it); vLLM's reads them: ``layer_types`` picks the sliding layers, and
    without it ``sliding_window`` applies to every layer."""
    if not spec.window:
        return {}
    out: dict = {"sliding_window": spec.window}
    if spec.full_every:
        out["layer_types"] = ["full_attention" if (i + 1) % spec.full_every == 0 else "sliding_attention"
                              for i in range(spec.layers)]
    return out


def _config(spec: ModelSpec):
    from transformers import LlamaConfig

    return LlamaConfig(
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
        **_attention_kwargs(spec),
    )


# Run in a child process with the engines' environment, pinned to one core: one
# warm-up pass, then two timed 2K-token forwards of each rung, until one is slow enough.
_PROBE = r"""
import json, sys, time, torch
from transformers import LlamaForCausalLM
from multi.cli.models import ModelSpec, _config
req = json.load(sys.stdin)
torch.set_num_threads(1)
dtype = getattr(torch, req["dtype"])
x = torch.randint(4, 2000, (1, req["tokens"]))
for shape in req["rungs"]:
    spec = ModelSpec(**shape)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(_config(spec)).to(torch.bfloat16).to(dtype).eval()
    with torch.inference_mode():
        model(x[:, :64])
        s = float("inf")
        for _ in range(2):  # the faster of two: a neighbour's burst only ever slows one down
            t = time.perf_counter()
            model(x)
            s = min(s, time.perf_counter() - t)
    print(json.dumps({"shape": shape, "hf_s": s}), flush=True)
    if s * req["factor"] >= req["stop_s"]:
        break
"""


def _probe_core() -> int:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[-1]


def measure_ladder(dtype: str, base: dict[str, int]) -> list[dict]:
    """``[{"shape", "hf_s", "engine_s"}]`` for the rungs measured, cheapest first."""
    from kvcore.platform import engine_env

    core = _probe_core()
    env = {**os.environ, **engine_env(core), "OMP_NUM_THREADS": "1"}
    req = {"dtype": dtype, "tokens": PROBE_TOKENS, "factor": ENGINE_OVER_HF[dtype], "stop_s": TARGET_S[0],
           "rungs": [{**base, **r} for r in LADDER]}
    root = str(Path(__file__).resolve().parent.parent)
    r = subprocess.run([sys.executable, "-c", _PROBE], input=json.dumps(req), capture_output=True, text=True,
                       env=env, cwd=root, timeout=900, start_new_session=True,
                       preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not rows:
        raise RuntimeError(f"measuring the model ladder failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    for row in rows:
        row["engine_s"] = round(row["hf_s"] * ENGINE_OVER_HF[dtype], 3)
        row["hf_s"] = round(row["hf_s"], 3)
    return rows


def pick_rung(rows: list[dict]) -> dict:
    """The measured row to build: the first estimated at the band's lower edge or more, or the
    one below it when that overshoots the upper edge (the largest rung when none reaches it)."""
    lo, hi = TARGET_S
    for i, row in enumerate(rows):
        if row["engine_s"] >= lo:
            return rows[i - 1] if row["engine_s"] > hi and i > 0 else row
    return rows[-1]


def build(preset: str, out_dir: str | os.PathLike, *, dtype: str | None = None, **overrides: int) -> Path:
    """Build (or reuse, when built for the same preset, dtype and CPU class) a model directory.

    ``small`` is sized by measuring (see the module docstring) unless a shape override
    is given; ``dtype`` defaults to :func:`kvcore.platform.engine_dtype`."""
    from kvcore.platform import cpu_summary, engine_dtype

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose from {sorted(PRESETS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    dtype = engine_dtype(explicit=dtype)
    cpu = cpu_summary()
    out = Path(out_dir)
    stamp = out / "mctier-spec.json"
    measure = preset == "small" and not (given.keys() & {"layers", "hidden", "heads", "kv_heads"})
    key = {"preset": preset, "init_std": INIT_STD, "overrides": given}
    if measure:
        key.update(dtype=dtype, cpu=cpu["cpu"], isa=cpu["isa"], simulated=cpu["simulated"])
    if stamp.exists() and (out / "model.safetensors").exists():
        try:
            old = json.loads(stamp.read_text())
        except ValueError:
            old = {}
        if old.get("key") == key:
            return out

    params = {**PRESETS[preset], **given}
    record: dict = {"key": key, "dtype_sized_for": dtype if measure else None}
    if measure:
        rows = measure_ladder(dtype, {k: params[k] for k in ("vocab", "seed")})
        chosen = pick_rung(rows)
        params.update(chosen["shape"])
        record.update(measured=rows, estimated_2k_prefill_s=chosen["engine_s"])
    spec = ModelSpec(**params)
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError("hidden must be a multiple of heads, heads a multiple of kv_heads")

    import torch
    from transformers import LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(spec, out)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(_config(spec)).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    record.update(shape=msgspec.to_builtins(spec), params=sum(p.numel() for p in model.parameters()), cpu=cpu)
    stamp.write_text(json.dumps(record, indent=1, sort_keys=True))
    return out


def describe(model_dir: str | os.PathLike) -> str:
    """One line on a built model: shape, parameters, the dtype it was sized for and its speed."""
    try:
        rec = json.loads((Path(model_dir) / "mctier-spec.json").read_text())
    except (OSError, ValueError):
        return f"{model_dir} (no mctier-spec.json)"
    s = rec.get("shape", {})
    line = (f"{rec.get('key', {}).get('preset', '?')}: {s.get('layers')} layers, hidden {s.get('hidden')}, "
            f"{s.get('kv_heads')} KV heads, {rec.get('params', 0) / 1e6:.1f}M params")
    if s.get("window"):
        line += f", {s['window']}-token sliding window " + (
            f"(1 full-attention layer in {s['full_every']})" if s.get("full_every") else "(every layer)")
    if rec.get("estimated_2k_prefill_s") is not None:
        line += (f"; sized for {rec['dtype_sized_for']} on {rec['cpu']['cpu']}: 2K-token prefill "
                 f"~{rec['estimated_2k_prefill_s']:.1f} s on one core (estimated)")
    return line
