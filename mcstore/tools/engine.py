"""An engine's key space, prompts and settings as the tools see them.

Three ways to the key space a running engine stores under (:class:`mcstore.keys.EngineMeta`):

* what its connector published when it started (``{prefix}/{fp16}/meta``):
  :func:`published_metas`, picked by fingerprint or by the model a live server names
  (:func:`meta_for_server`, from its ``/v1/models``);
* derived from the engine's settings without an engine (:func:`derive_meta`): the same
  ``--model`` string (or ``model_id`` in the connector config), ``--block-size``,
  ``--dtype``, ``--kv-cache-dtype``, ``--tensor-parallel-size``,
  ``--pipeline-parallel-size``, ``--prefix-caching-hash-algo`` and
  ``--kv-transfer-config``. vLLM lays the KV cache out (:mod:`kvcore.vllm_glue`) and the
  connector's own :func:`mcstore.connector.key_space` turns it into the key space, so
  connector-side fingerprint changes reach the tools by construction
  (``tests/test_tools.py`` proves the result equal to a real engine's).

Also here: the connector config inside any of the kv-transfer-config shapes that carry a
store tier, and prompt rendering with the model's tokenizer, mirroring vLLM's OpenAI server
(completions: special tokens added; chat: template rendered to text, then tokenized
without special tokens).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import requests

from kvcore.errors import ConfigError
from mcstore.admin import MasterAdmin, Unavailable
from mcstore.client import StoreClient
from mcstore.config import StoreConfig, load_config
from mcstore.keys import KEY_VERSION, META_SUFFIX, EngineMeta, engine_meta

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
    from kvcore.vllm_glue import engine_kv_cache_layout, engine_vllm_config, kv_fingerprint_fields
    from mcstore.connector import key_space  # the connector's own derivation: one source of truth

    kv = read_kv_config(kv_config)
    cfg = store_config(kv)
    vc = engine_vllm_config(model, kv, block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                            prefix_caching_hash_algo=prefix_caching_hash_algo)
    cfg.check_block_size(vc.cache_config.block_size)
    kvcc = engine_kv_cache_layout(vc)
    ks = key_space(cfg, vc, kvcc)
    return engine_meta(ks, cfg.key_prefix, cfg.model_id or vc.model_config.model, kv_fingerprint_fields(vc, kvcc))


def engine_settings(args) -> dict:
    """:func:`derive_meta`'s keyword arguments from the shared tool flags (:func:`add_engine_args`):
    one place, so that a flag added there reaches every tool."""
    return dict(block_size=args.block_size, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
                prefix_caching_hash_algo=getattr(args, "prefix_caching_hash_algo", "sha256"))


def meta_from_args(args) -> EngineMeta | None:
    """From the shared tool flags (see :func:`add_engine_args`); None when none were given."""
    if getattr(args, "model", None) and getattr(args, "kv_config", None):
        return derive_meta(args.model, args.kv_config, **engine_settings(args))
    return None


def add_engine_args(p, *, required: bool = False) -> None:
    g = p.add_argument_group("engine settings (the key fingerprint; same values as the engine's)")
    g.add_argument("--model", required=required, help="model as given to the engine (path or name)")
    g.add_argument("--kv-config", required=required, help="the engine's --kv-transfer-config (JSON or file)")
    g.add_argument("--block-size", type=int, default=None, help="as given to the engine (default: vLLM's)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--kv-cache-dtype", default="auto")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    # Not a choices list of our own: vLLM validates the value when the settings are derived.
    g.add_argument("--prefix-caching-hash-algo", default="sha256",
                   help="as given to the engine (default: vLLM's, sha256); another algorithm puts the "
                        "engine's objects in another key space")


# -- the key space an engine published ---------------------------------------------------------


def published_metas(client: StoreClient, admin: MasterAdmin) -> list[EngineMeta]:
    """Every engine key space published in the store (lists keys: needs the admin API)."""
    out = []
    for k in admin.all_keys():
        parts = k.split("/")
        if len(parts) == 3 and len(parts[1]) == 16 and parts[2] == META_SUFFIX:
            meta = client.read(k, EngineMeta)
            if meta is not None:
                out.append(meta)
    return out


class ServerModel:
    """What a live vLLM OpenAI server says about itself: its served name, the model it
    loaded (``root`` in ``/v1/models``) and its block size (``vllm:cache_config_info``)."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        try:
            r = requests.get(self.url + "/v1/models", timeout=timeout)
            r.raise_for_status()
            card = r.json()["data"][0]
        except (requests.RequestException, KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"engine {self.url} does not answer /v1/models: {e}") from None
        self.name: str = card["id"]
        self.root: str = card.get("root") or card["id"]
        self.block_size: int | None = None
        try:
            from prometheus_client.parser import text_string_to_metric_families

            text = requests.get(self.url + "/metrics", timeout=timeout).text
            for fam in text_string_to_metric_families(text):
                if fam.name == "vllm:cache_config_info":
                    self.block_size = int(fam.samples[0].labels["block_size"])
        except (requests.RequestException, KeyError, IndexError, ValueError):
            pass


def meta_for_server(server: ServerModel, client: StoreClient, admin: MasterAdmin,
                    fingerprint: str | None = None, key_prefix: str = "mct") -> EngineMeta:
    """The key space the engine behind ``server`` published when it started (or the one
    published under ``fingerprint``). Key spaces of another key version
    (:meth:`EngineMeta.foreign`) are never returned: this mctier's keys would not be theirs.
    Of several of the model, those that name this key version win (the others are from
    engines that ran before an upgrade), then those of the server's block size."""
    if fingerprint:
        fp = fingerprint.lower()
        meta = client.read(f"{key_prefix}/{fp[:16]}/{META_SUFFIX}", EngineMeta)
        if meta is None or not meta.fingerprint.startswith(fp):
            raise ConfigError(f"no key space published under fingerprint {fp[:16]} (key prefix {key_prefix!r}); "
                              f"`mctier inspect summary` lists them")
        if meta.foreign():
            raise ConfigError(_foreign_error([meta]))
        return meta
    try:
        metas = published_metas(client, admin)
    except Unavailable as e:
        raise ConfigError(f"cannot list the engines' published metadata ({e}); pass --admin, --fingerprint, "
                          f"or the engine's settings (--model, --kv-config)") from None
    names = {server.name, server.root}
    found = [m for m in metas if m.model in names or m.fields.get("model") in names]
    foreign = [m for m in found if m.foreign()]
    found = [m for m in found if not m.foreign()]
    if not found and foreign:
        raise ConfigError(_foreign_error(foreign))
    if len(found) > 1:  # published before and after an upgrade: the current version's
        found = [m for m in found if m.key_version == KEY_VERSION] or found
    if len(found) > 1 and server.block_size is not None:  # e.g. an older engine of the same model
        same = [m for m in found if {g.get("block_size") for g in m.fields.get("groups", [])} == {server.block_size}]
        found = same or found
    if len(found) == 1:
        return found[0]
    seen = ", ".join(f"{m.fingerprint[:16]} ({m.model})" for m in metas) or "none"
    if not found:
        raise ConfigError(f"no published key space for model {server.root!r} (served as {server.name!r}) in the "
                          f"store; published: {seen}. Is the engine's store tier on this master (--master)? "
                          f"Otherwise pass the engine's settings (--model, --kv-config)")
    raise ConfigError(f"several key spaces were published for model {server.root!r}: "
                      + ", ".join(m.fingerprint[:16] for m in found) + "; pick one with --fingerprint")


def _foreign_error(metas: list[EngineMeta]) -> str:
    return ("key space " + ", ".join(f"{m.fingerprint[:16]} (key version {m.key_version})" for m in metas)
            + f" was published by another mctier; this one computes {KEY_VERSION} keys, which that engine "
            "would not find: use the mctier the engine runs")


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
