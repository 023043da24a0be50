"""LMCache as the established store-tier peer, in its multi-process mode.

LMCache's in-process ``LMCacheConnectorV1`` has no CPU branch and silently runs in
"degraded mode (recompute)" on CPU engines (shared/notes/lmcache-cpu.md), so the
peer is ``lmcache server`` plus vLLM's ``LMCacheMPConnector``, as LMCache documents
for multi-process deployments. LMCache lives in its own virtualenv
(``scripts/setup_lmcache.sh``, under ``~/.cache/mctier/venv-lmcache`` unless ``LMCACHE_VENV``):
its pins (numpy, protobuf, prometheus_client) must not touch the project's.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kvcore.procs import Proc, free_port

ROOT = Path(__file__).resolve().parent.parent
# Shared by every clone on the machine (scripts/setup_lmcache.sh says why).
VENV = Path(os.environ.get("LMCACHE_VENV") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            / "mctier" / "venv-lmcache")
CHUNK_TOKENS = 256  # same chunk as the store tier's default, so both store whole 256-token chunks
# LMCache's usage telemetry would phone home every 600 s.
ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1", "PYTHONPATH": str(ROOT)}


def ensure_venv() -> Path:
    """Create or reuse the LMCache virtualenv; the python to run LMCache engines with."""
    subprocess.run(["bash", str(ROOT / "scripts" / "setup_lmcache.sh")], check=True,
                   env={**os.environ, "LMCACHE_VENV": str(VENV)})  # the script and this module agree
    return VENV / "bin" / "python"


def version() -> str:
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", "import importlib.metadata as m; "
                          "print(m.version('lmcache'))"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "unknown"


def start_server(log_dir: Path, l1_gb: int, track=lambda proc: proc) -> tuple[Proc, int]:
    """``lmcache server`` on loopback with an ``l1_gb`` DRAM L1 (allocated eagerly on CPU);
    ``track`` sees the process before it is waited for, so that a caller can always stop it."""
    port, http_port = free_port(), free_port()
    argv = [str(VENV / "bin" / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port), "--chunk-size", str(CHUNK_TOKENS),
            "--l1-size-gb", str(l1_gb), "--l1-init-size-gb", str(l1_gb), "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto"]
    proc = track(Proc("lmcache-server", argv, log_dir / "lmcache-server.log", env=ENV))
    proc.wait_port(port, 120)
    return proc, port


def kv_config(port: int) -> dict:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}
