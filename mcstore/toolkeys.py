"""Engine key space for offline tools (warmup, inspection) without starting an engine.

A stored chunk's key digests the engine's fingerprint fields
(:func:`kvcore.vllm_glue.kv_fingerprint_fields`), which vLLM only hands a
connector once the engine is up. Tools rebuild the same fields from the
engine's settings: the same ``--model`` string the engine was started with (or
``model_id`` in the connector config), ``--block-size``, ``--dtype``,
``--kv-cache-dtype``, ``--tensor-parallel-size`` and the engine's
``--kv-transfer-config``. vLLM's own code does the work: ``EngineArgs`` builds
the ``VllmConfig``, the platform's default attention backend customizes a
``FullAttentionSpec`` per decoder layer, ``get_kv_cache_groups`` groups them
and ``resolve_kv_cache_layout`` picks the layout, as the engine core does; the
connector's own :func:`mcstore.connector.key_space` then turns them into the key
space, so connector-side fingerprint changes reach the tools by construction.
``tests/test_tools.py`` proves the result equal to a real engine's.

Also here: the connector config inside any of the kv-transfer-config shapes
that carry a store tier (``StoreConnector``, a stock ``MultiConnector`` child,
``TieredConnector``'s ``store`` part), and prompt rendering with the model's
tokenizer, mirroring vLLM's OpenAI server (completions: special tokens added;
chat: template rendered to text, then tokenized without special tokens).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec

from kvcore.errors import ConfigError
from mcstore.config import StoreConfig, load_config
from mcstore.keys import KeySpace

META_SUFFIX = "meta"


class EngineMeta(msgspec.Struct, kw_only=True):
    """What a tool knows about one engine configuration; published under ``{prefix}/{fp16}/meta``."""

    fingerprint: str
    chunk_tokens: int
    tp_size: int
    key_prefix: str = "mct"
    model: str | None = None
    fields: dict[str, Any] = msgspec.field(default_factory=dict)

    def key_space(self) -> KeySpace:
        return KeySpace(self.fingerprint, self.chunk_tokens, self.tp_size, self.key_prefix)


def meta_key(ks: KeySpace) -> str:
    return f"{ks.prefix}/{META_SUFFIX}"


# -- kv-transfer-config --------------------------------------------------------------


def read_kv_config(value: str | dict) -> dict:
    """The engine's ``--kv-transfer-config``: a dict, a JSON string or a JSON file path."""
    if isinstance(value, dict):
        return value
    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = Path(value).read_text()
        except OSError as e:
            raise ConfigError(f"--kv-config {value}: {e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--kv-config: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("--kv-config: not a JSON object")
    return data


def store_extra(kv: dict) -> dict:
    """The store tier's ``kv_connector_extra_config`` inside a kv-transfer-config."""
    name = kv.get("kv_connector")
    extra = kv.get("kv_connector_extra_config") or {}
    if name == "StoreConnector" or kv.get("kv_connector_module_path") == "mcstore":
        return extra
    if name == "TieredConnector":
        if not extra.get("store"):
            raise ConfigError("--kv-config: this TieredConnector config has no store tier")
        return extra["store"]
    if name == "MultiConnector":
        for child in extra.get("connectors") or []:
            try:
                return store_extra(child)
            except ConfigError:
                continue
    raise ConfigError(f"--kv-config: no store tier (StoreConnector) in connector {name!r}")


def store_config(kv: dict) -> StoreConfig:
    return load_config(store_extra(kv))


# -- fingerprint without an engine ----------------------------------------------------


def _vllm_config(model: str, block_size: int | None, dtype: str, kv_cache_dtype: str, tp: int, kv: dict):
    # Tools print results on stdout; vLLM logs there by default.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from kvcore.vllm_glue import install_version_alias

    install_version_alias()
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=model, block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tp, enforce_eager=True, distributed_executor_backend="mp" if tp > 1 else None,
        kv_transfer_config=KVTransferConfig(**kv),
    )
    return args.create_engine_config()


def _kv_cache_config(vllm_config):
    """The parts of the engine's KVCacheConfig that the fingerprint reads."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if model.use_mla or getattr(model, "is_hybrid", False) or model.get_sliding_window() is not None:
        raise ConfigError("mcstore tools: only full-attention decoder models are derived without an engine; "
                          "pass --fingerprint (see `mctier inspect summary`)")
    with set_current_vllm_config(vllm_config):
        backends = get_current_attn_backends(vllm_config)
    backend = backends[0]
    dtype = STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype] if cache.cache_dtype != "auto" else model.dtype
    spec = FullAttentionSpec(
        block_size=cache.block_size,
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        dtype=dtype,
        kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
    )
    try:
        from vllm.v1.worker.utils import customize_attention_spec

        spec = customize_attention_spec(backend, spec)
    except ImportError:
        spec = backend.customize_spec(spec)
    n_layers = model.get_num_layers_by_block_type(parallel, "attention")
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(n_layers)}
    groups = get_kv_cache_groups(vllm_config, specs)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(vllm_config, [supported], list(specs.values()))
    return SimpleNamespace(kv_cache_groups=groups, kv_cache_layout=layout.name)


def derive_meta(model: str, kv_config: str | dict, *, block_size: int | None = None, dtype: str = "auto",
                kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1) -> EngineMeta:
    """The key space an engine with these settings uses (imports vLLM: ~15 s)."""
    from kvcore.vllm_glue import kv_fingerprint_fields
    from mcstore.connector import key_space  # the connector's own derivation: one source of truth

    kv = read_kv_config(kv_config)
    cfg = store_config(kv)
    vc = _vllm_config(model, block_size, dtype, kv_cache_dtype, tensor_parallel_size, kv)
    cfg.check_block_size(vc.cache_config.block_size)
    kvcc = _kv_cache_config(vc)
    ks = key_space(cfg, vc, kvcc)
    return EngineMeta(fingerprint=ks.fp, chunk_tokens=ks.chunk_tokens, tp_size=ks.tp_size, key_prefix=cfg.key_prefix,
                      model=cfg.model_id or vc.model_config.model, fields=kv_fingerprint_fields(vc, kvcc))


def meta_from_args(args) -> EngineMeta | None:
    """From the shared tool flags (see :func:`add_engine_args`); None when none were given."""
    if getattr(args, "model", None) and getattr(args, "kv_config", None):
        return derive_meta(args.model, args.kv_config, block_size=args.block_size, dtype=args.dtype,
                           kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size)
    return None


def add_engine_args(p, *, required: bool = False) -> None:
    g = p.add_argument_group("engine settings (the key fingerprint; same values as the engine's)")
    g.add_argument("--model", required=required, help="model as given to the engine (path or name)")
    g.add_argument("--kv-config", required=required, help="the engine's --kv-transfer-config (JSON or file)")
    g.add_argument("--block-size", type=int, default=None, help="as given to the engine (default: vLLM's)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--kv-cache-dtype", default="auto")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)


# -- prompts ---------------------------------------------------------------------------


class Renderer:
    """Prompt -> token ids with the model's tokenizer, as vLLM's OpenAI server does it."""

    def __init__(self, model: str):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load the tokenizer of {model}: {e}") from None

    def text(self, prompt: str) -> list[int]:
        return list(self.tok(prompt, add_special_tokens=True)["input_ids"])

    def messages(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja/template errors of all kinds are input errors
            raise ValueError(f"cannot render messages with the chat template: {e}") from None
        return list(self.tok(text, add_special_tokens=False)["input_ids"])
