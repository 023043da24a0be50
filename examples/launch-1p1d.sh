#!/usr/bin/env bash
# 1 prefill + 1 decode vLLM engine on one host (CPU), each pinned to one core, plus the
# mctier P/D proxy. No Mooncake master is needed: the P2P tier uses the Transfer Engine's
# P2P handshake and the prefill engine's own bootstrap server.
#
#   examples/launch-1p1d.sh [MODEL]        (default: a tiny random Llama built locally)
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model":"m","prompt":"hello hello hello","max_tokens":8}'
#
# Ctrl-C stops all three processes.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
MODEL="${1:-}"
P_PORT="${P_PORT:-8100}"; D_PORT="${D_PORT:-8200}"; PROXY_PORT="${PROXY_PORT:-8000}"
BOOT_PORT="${VLLM_MOONCAKE_BOOTSTRAP_PORT:-8998}"
LOGS="${LOGS:-$ROOT/.cache/launch-1p1d}"
mkdir -p "$LOGS"
if [[ -z "$MODEL" ]]; then
  MODEL="$("$PY" -m multi.cli model tiny "$ROOT/.cache/models/tiny" | tail -1)"
fi

export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 \
       VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" \
       MC_LOG_LEVEL=ERROR MC_TCP_BIND_ADDRESS=127.0.0.1

P_CFG=$(sed "s/\"bootstrap_port\": 8998/\"bootstrap_port\": $BOOT_PORT/" "$HERE/p2p-prefill.json")
D_CFG=$(cat "$HERE/p2p-decode.json")
# bf16 where the CPU has native bf16, float32 elsewhere (`mctier cpu`); DTYPE=... overrides.
DTYPE="${DTYPE:-$("$PY" -m multi.cli cpu --dtype)}"
COMMON=(--host 127.0.0.1 --enforce-eager --block-size 32 --max-model-len 4096 --served-model-name m --dtype "$DTYPE")

pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT INT TERM

VLLM_CPU_OMP_THREADS_BIND=0 setsid "$PY" -m multi.cli serve "$MODEL" --port "$P_PORT" "${COMMON[@]}" \
  --kv-transfer-config "$P_CFG" >"$LOGS/prefill.log" 2>&1 &
pids+=($!)
VLLM_CPU_OMP_THREADS_BIND=1 setsid "$PY" -m multi.cli serve "$MODEL" --port "$D_PORT" "${COMMON[@]}" \
  --kv-transfer-config "$D_CFG" >"$LOGS/decode.log" 2>&1 &
pids+=($!)

echo "waiting for the engines (logs in $LOGS) ..."
for port in "$P_PORT" "$D_PORT"; do
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "engine on $port did not start"; exit 1; }
done

setsid "$PY" -m multi.cli proxy --prefill "http://127.0.0.1:$P_PORT@http://127.0.0.1:$BOOT_PORT" \
  --decode "http://127.0.0.1:$D_PORT" --port "$PROXY_PORT" >"$LOGS/proxy.log" 2>&1 &
pids+=($!)
echo "proxy on http://127.0.0.1:$PROXY_PORT (prefill :$P_PORT, decode :$D_PORT, bootstrap :$BOOT_PORT)"
wait -n "${pids[@]}"
