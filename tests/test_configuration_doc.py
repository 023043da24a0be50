"""Config defined once: docs/configuration.md is what ``make docs`` generates from the config
structs (:mod:`multi.configdoc`), every key of every config struct has a description, and a
config error names the bad key and lists the keys of the object it is in."""

from __future__ import annotations

import ast
import difflib
from pathlib import Path
from typing import Annotated

import msgspec
import pytest

from kvcore.config import doc, keys, load
from kvcore.errors import ConfigError
from multi import configdoc

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
# Structs with forbid_unknown_fields that users do not fill through a connector config or
# mooncake.json, each with where its keys are documented instead.
NOT_CONNECTOR_CONFIG = {
    "_Entry": "the router's --instances TOML file (multi/router/instances.py, docs/router.md)",
    "_File": "the router's --instances TOML file (multi/router/instances.py, docs/router.md)",
}


def test_committed_configuration_doc_is_the_generated_one():
    want = configdoc.document()
    have = DOC.read_text() if DOC.exists() else ""
    diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                        "docs/configuration.md (committed)", "generated", n=1))
    assert have == want, f"docs/configuration.md is out of date: run `make docs`\n{diff[:4000]}"


def test_every_config_key_has_a_description():
    missing = [f"{cls.__name__}.{k.name}" for cls in configdoc.config_structs() for k in keys(cls)
               if not k.description.strip()]
    assert not missing, f"config keys without msgspec.Meta(description=...): {missing}"


def test_every_config_struct_is_in_the_doc():
    """A struct that refuses unknown keys is a config a user writes: it has a section (or is
    listed in NOT_CONNECTOR_CONFIG with where its keys are documented)."""
    found = set()
    for package in ("kvcore", "mcstore", "p2p", "multi"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                        k.arg == "forbid_unknown_fields" for k in node.keywords):
                    found.add(node.name)
    documented = {cls.__name__ for cls in configdoc.config_structs()}
    assert found - set(NOT_CONNECTOR_CONFIG) == documented
    text = configdoc.document()
    for cls in configdoc.config_structs():
        for k in keys(cls):
            type_cell = k.type.replace("|", "\\|")
            assert f"| `{k.name}` | `{type_cell}` |" in text, (cls.__name__, k.name)


class Sample(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A sample config."""

    name: Annotated[str, doc("Its name.")]
    size: Annotated[int | str, doc("Bytes | a size string.")] = "4MB"
    weight: Annotated[float, msgspec.Meta(ge=0, description="A weight (seconds).")] = 1.5
    items: Annotated[list[int], doc("Some items.")] = msgspec.field(default_factory=list)
    bare: float | None = None


def test_keys_read_type_default_and_description_from_the_struct():
    assert keys(Sample) == [
        ("name", "str", "required", "Its name."),
        ("size", "int | str", '"4MB"', "Bytes | a size string."),
        ("weight", "float (>= 0)", "1.5", "A weight (seconds)."),
        ("items", "list[int]", "[]", "Some items."),
        ("bare", "float | null", "null", ""),
    ]
    table = configdoc.key_table(Sample, {"size": ("global_segment_size",)})
    assert table[0] == "| Key | Type | Default | mooncake.json | Description |"
    assert table[3] == "| `size` | `int \\| str` | `\"4MB\"` | `global_segment_size` | Bytes \\| a size string. |"
    assert table[2].startswith("| `name` | `str` | required |")


def test_a_changed_description_changes_the_doc(monkeypatch):
    from mcstore.config import StoreConfig

    before = configdoc.document()
    real = keys

    def edited(cls):
        out = real(cls)
        return [k._replace(description="EDITED") if cls is StoreConfig and k.name == "chunk_tokens" else k
                for k in out]

    monkeypatch.setattr(configdoc, "keys", edited)
    after = configdoc.document()
    assert after != before and "| `chunk_tokens` | `int` | `256` |  | EDITED |" in after


def test_config_errors_name_the_key_and_list_the_keys_of_its_object():
    from mcstore.config import load_config as store_config
    from multi.config import load_config as tiered_config

    with pytest.raises(ConfigError, match=r"chunk_tokn.*known keys: chunk_tokens, .*sync_load_max"):
        store_config({"master": "127.0.0.1:50051", "chunk_tokn": 64}, env={})
    with pytest.raises(ConfigError, match=r"\$\.chunk_tokens.*known keys: chunk_tokens"):
        store_config({"master": "127.0.0.1:50051", "chunk_tokens": "many"}, env={})
    cases = [({"store": {}, "polcy": {}},
              r"`polcy`.*known keys: default_source, p2p, policy, store, tiers, write_back\)"),
             ({"store": {}, "policy": {"idle_compute": 1}},
              r"`idle_compute` - at `\$\.policy` \(known keys: calibrate, idle_compute_s, .*tiers\)"),
             ({"store": {}, "policy": {"idle_compute_s": -1}},
              r"\$\.policy\.idle_compute_s` \(known keys: calibrate, idle_compute_s, "),
             ({"tiers": [{"nam": "x"}]}, r"`nam` - at `\$\.tiers\[0\]` \(known keys: config, connector, name\)"),
             ({"store": {}, "policy": {"tiers": {"store": {"latency": 1}}}},
              r"`latency` - .*\(known keys: bandwidth_gbps, latency_s\)"),
             ({"store": {}, "policy": 3}, r"at `\$\.policy` \(known keys: default_source, p2p, policy, ")]
    for extra, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            tiered_config(extra)
    with pytest.raises(ConfigError, match=r"`x` \(known keys: bare, items, name, size, weight\)"):
        load(Sample, {"name": "a", "x": 1}, "sample")
