"""What the KV a model computes depends on, beyond its layout: its weights and its config.

Two engines of the same architecture (same layer names, same page bytes) but different
checkpoints, or one with ``hf_overrides`` (a RoPE scaling, say), compute different KV for the
same tokens. Their fingerprints (the store's keys, the P2P handshake) must differ, and must not
depend on where the checkpoint lies: the same weights copied to another host or path are the
same KV.

- :func:`weights_digest` of a local checkpoint directory: SHA-256 over, per weight file (sorted
  by name), its name and size, and per tensor of a ``.safetensors`` file its name, dtype,
  shape and three 4 KiB samples of its bytes (start, middle, end). A fine-tune changes every
  tensor it trains, and so every sample of them; hashing the files whole would read a 140 GB
  checkpoint at every engine start. Other weight formats (``.bin``, ``.pt``, ``.gguf``) are
  sampled every 1/16 of the file. About 12 KiB read per tensor: a 70B checkpoint (~700
  tensors) costs ~9 MB of reads. None for something that is not a local directory (a hub
  name whose revision then identifies it).
- :func:`config_digest` of the effective model config (``hf_config.to_dict()``, overrides
  applied) without its bookkeeping keys (``_name_or_path``, ``transformers_version``, ...).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from pathlib import Path

_SAMPLE = 4096
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_FILE_SAMPLES = 16


def _read_at(f, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def _safetensors(h, f, size: int) -> None:
    (hlen,) = struct.unpack("<Q", f.read(8))
    if hlen > size - 8 or hlen > 100 << 20:
        raise ValueError("bad safetensors header")
    header = json.loads(f.read(hlen))
    base = 8 + hlen
    for name in sorted(k for k in header if k != "__metadata__"):
        t = header[name]
        start, end = t["data_offsets"]
        h.update(json.dumps([name, t["dtype"], t["shape"], end - start]).encode())
        n = end - start
        for off in sorted({0, max(0, n // 2 - _SAMPLE // 2), max(0, n - _SAMPLE)}):
            h.update(_read_at(f, base + start + off, min(_SAMPLE, n - off)))


def _sampled(h, f, size: int) -> None:
    for i in range(_FILE_SAMPLES):
        h.update(_read_at(f, (size * i) // _FILE_SAMPLES, _SAMPLE))


@functools.cache
def _digest_dir(path: str, stamp: tuple) -> str | None:
    h = hashlib.sha256(b"mctier/weights/v1")
    found = False
    for p in sorted(Path(path).iterdir()):
        if not p.is_file() or not p.name.endswith(_WEIGHT_SUFFIXES):
            continue
        found = True
        size = p.stat().st_size
        h.update(json.dumps([p.name, size]).encode())
        with open(p, "rb") as f:
            if p.name.endswith(".safetensors"):
                try:
                    _safetensors(h, f, size)
                    continue
                except (ValueError, KeyError, TypeError, struct.error):
                    f.seek(0)
            _sampled(h, f, size)
    return h.hexdigest() if found else None


def weights_digest(model: str | os.PathLike) -> str | None:
    """Digest of the weights of the checkpoint directory ``model`` (see the module docstring);
    None when ``model`` is not a local directory holding weight files."""
    path = Path(model)
    if not path.is_dir():
        return None
    # Computed once per process for unchanged files (the scheduler and each worker ask).
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir())
                  if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    return _digest_dir(str(path.resolve()), stamp)


def config_digest(config: dict) -> str:
    """Hex SHA-256 of an effective model config (a ``PretrainedConfig.to_dict()``), without the
    keys that name where it came from or what wrote it."""
    kept = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint(fields: dict) -> str:
    """Hex SHA-256 of a canonical JSON of identity fields (the P2P handshake's)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()
