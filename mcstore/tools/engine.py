"""An engine's key space, prompts and settings as the tools see them.

Two ways to the key space a running engine stores under (:class:`mcstore.keys.EngineMeta`):

* what its connector published when it started (``{prefix}/{fp16}/meta``), found from what
  the operator knows: the engine's URL or its model name, or a fingerprint
  (:mod:`mcstore.tools.published`; :func:`query_from_args` reads the flags);
* derived from the engine's settings without an engine (:func:`derive_meta`): the same
  ``--model`` string (or ``model_id`` in the connector config), ``--block-size``,
  ``--dtype``, ``--kv-cache-dtype``, ``--tensor-parallel-size``,
  ``--pipeline-parallel-size``, ``--prefix-caching-hash-algo`` and
  ``--kv-transfer-config``. vLLM lays the KV cache out (:mod:`kvcore.vllm_layout`) and the
  connector's own :func:`mcstore.connector.key_space` turns it into the key space, so
  connector-side fingerprint changes reach the tools by construction
  (``tests/test_tools.py`` proves the result equal to a real engine's).

The same flags serve both (:func:`add_engine_args`): with ``--kv-config`` they are the
engine's settings; without, they narrow the published key spaces of the named model.
:func:`rebuild_engine` goes from a published key space back to settings an offline engine
stores under (checked against the fingerprint).

Also here: the connector config inside any of the kv-transfer-config shapes that carry a
store tier, and prompt rendering with the model's tokenizer, mirroring vLLM's OpenAI server
(completions: special tokens added; chat: template rendered to text, then tokenized
without special tokens).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvcore.errors import ConfigError
from mcstore.config import StoreConfig, load_config
from mcstore.keys import EngineMeta, engine_meta
from mcstore.tools.published import KeySpaceQuery, offline_settings

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


# -- the key space from the engine's settings ------------------------------------------------


def derive_meta(model: str, kv_config: str | dict, *, block_size: int | None = None, dtype: str = "auto",
                kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                pipeline_parallel_size: int = 1, prefix_caching_hash_algo: str = "sha256") -> EngineMeta:
    """The key space an engine with these settings uses (imports vLLM: ~15 s). The hash
    algorithm decides between links from vLLM's block hashes (``sha256``, vLLM's default)
    and mctier's own chain (the others): an engine started with another
    ``--prefix-caching-hash-algo`` stores under another key space."""
    # Tools print results on stdout; vLLM logs there by default.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from kvcore.vllm_glue import kv_fingerprint_fields
    from kvcore.vllm_layout import engine_kv_cache_layout, engine_vllm_config
    from mcstore.connector import key_space  # the connector's own derivation: one source of truth

    kv = read_kv_config(kv_config)
    cfg = store_config(kv)
    vc = engine_vllm_config(model, kv, block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                            prefix_caching_hash_algo=prefix_caching_hash_algo)
    cfg.check_block_size(vc.cache_config.block_size)
    kvcc = engine_kv_cache_layout(vc)
    ks = key_space(cfg, vc, kvcc)
    return engine_meta(ks, cfg.key_prefix, cfg.model_id or vc.model_config.model, kv_fingerprint_fields(vc, kvcc),
                       cfg.partial_hits and not ks.groups)


def engine_settings(args) -> dict:
    """:func:`derive_meta`'s keyword arguments from the shared tool flags (:func:`add_engine_args`),
    vLLM's defaults for those not given: one place, so that a flag added there reaches every tool."""

    def given(name: str, default):
        value = getattr(args, name, None)
        return default if value is None else value

    return dict(block_size=given("block_size", None), dtype=given("dtype", "auto"),
                kv_cache_dtype=given("kv_cache_dtype", "auto"), tensor_parallel_size=given("tensor_parallel_size", 1),
                pipeline_parallel_size=given("pipeline_parallel_size", 1),
                prefix_caching_hash_algo=given("prefix_caching_hash_algo", "sha256"))


def check_engine_args(args) -> str | None:
    """Why the shared tool flags do not go together, or None."""
    if getattr(args, "kv_config", None) and getattr(args, "chunk_tokens", None) is not None:
        return "--chunk-tokens picks among the published key spaces; with --kv-config the chunk size is the config's"
    return None


def meta_from_args(args) -> EngineMeta | None:
    """Derived from the shared tool flags (:func:`add_engine_args`) when they carry the engine's
    settings (``--model`` and ``--kv-config``); None otherwise."""
    if getattr(args, "model", None) and getattr(args, "kv_config", None):
        return derive_meta(args.model, args.kv_config, **engine_settings(args))
    return None


def query_from_args(args, *, fingerprint: bool = True) -> KeySpaceQuery:
    """The published key space the shared tool flags describe
    (:func:`mcstore.tools.published.find_meta`): the model ``--model`` names (unless it goes with
    ``--kv-config``), ``--fingerprint`` (if ``fingerprint``), and the engine settings given."""

    def given(name: str):
        value = getattr(args, name, None)
        return None if value == "auto" else value

    return KeySpaceQuery(
        model=None if given("kv_config") else given("model"), fingerprint=given("fingerprint") if fingerprint else None,
        tp_size=given("tensor_parallel_size"), pp_size=given("pipeline_parallel_size"),
        block_size=given("block_size"), chunk_tokens=given("chunk_tokens"), dtype=given("dtype"),
        kv_cache_dtype=given("kv_cache_dtype"), hash_algo=given("prefix_caching_hash_algo"),
        key_prefix=given("key_prefix") or "mct")


def rebuild_engine(meta: EngineMeta, master: str) -> tuple[str, dict, dict]:
    """``(model, kv-transfer-config, settings)`` of an engine that stores under the published key
    space ``meta`` (:func:`mcstore.tools.published.offline_settings`), checked: the key space
    derived from them is ``meta``'s. The connector's ``verify_checksums`` is not published: both
    values are tried."""
    model, kv, settings = offline_settings(meta, master)
    extra, got = kv["kv_connector_extra_config"], None
    try:
        for checksums in (False, True):
            kv = {**kv, "kv_connector_extra_config": {**extra, "verify_checksums": checksums}}
            got = derive_meta(model, kv, **settings)
            if got.fingerprint == meta.fingerprint:
                return model, kv, settings
    except (ValueError, OSError) as e:  # ConfigError is a ValueError; vLLM's own refusals too
        raise ConfigError(f"cannot rebuild the engine of key space {meta.fingerprint[:16]} from what it published "
                          f"({e}); pass its settings (--model, --kv-config and the engine flags) or warm "
                          f"through it (--engine URL)") from None
    raise ConfigError(f"the settings rebuilt from key space {meta.fingerprint[:16]} (model {model}, {settings}) give "
                      f"key space {got.fingerprint[:16]}: the engine ran with something its metadata does not say "
                      f"(PYTHONHASHSEED, a model revision, another vLLM); pass its settings (--model, --kv-config "
                      f"and the engine flags) or warm through it (--engine URL)")


def add_engine_args(p, *, fingerprint: bool = True) -> None:
    """The flags that name the engine (shared by every tool; :func:`query_from_args`,
    :func:`meta_from_args`, :func:`engine_settings` read them)."""
    g = p.add_argument_group(
        "the engine",
        "Name it by its URL (--engine) or its model (--model): its key space, tokenizer and layout are read from "
        "what it published in the store when it started, and the settings below pick one when several were "
        "published for the model. With --kv-config they are the engine's settings instead, and the key space is "
        "derived from them (no engine needed).")
    g.add_argument("--model", help="the engine's model: the path it was given, or the connector's model_id")
    g.add_argument("--kv-config", help="the engine's --kv-transfer-config (JSON or file): derive the key space "
                                       "from the settings instead of reading what the engine published")
    if fingerprint:
        g.add_argument("--fingerprint", help="the key space published under this fingerprint (16 or 64 hex "
                                             "digits; `mctier inspect summary` lists them)")
    g.add_argument("--tokenizer", help="tokenizer to render prompts (default: the model the engine loaded)")
    g.add_argument("--block-size", type=int, default=None, help="as given to the engine (default: vLLM's)")
    g.add_argument("--chunk-tokens", type=int, default=None,
                   help="the connector's chunk_tokens (without --kv-config: picks among published key spaces)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--kv-cache-dtype", default="auto")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="(default: 1)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, help="(default: 1)")
    # Not a choices list of our own: vLLM validates the value when the settings are derived.
    g.add_argument("--prefix-caching-hash-algo", default=None,
                   help="as given to the engine (default: vLLM's, sha256); another algorithm puts the "
                        "engine's objects in another key space")


# -- prompts ---------------------------------------------------------------------------


class Renderer:
    """Prompt -> token ids with the model's tokenizer, as vLLM's OpenAI server does it."""

    def __init__(self, model: str):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load the tokenizer of {model} (pass --tokenizer): {e}") from None

    def text(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def messages(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja/template errors of all kinds are input errors
            raise ValueError(f"cannot render messages with the chat template: {e}") from None
        return list(self.tok(text, add_special_tokens=False)["input_ids"])
