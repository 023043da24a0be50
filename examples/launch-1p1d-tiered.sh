#!/usr/bin/env bash
# 1 prefill + 1 decode instance with TieredConnector, a Mooncake master + store server,
# and the proxy, all on 127.0.0.1 (one core per engine). Ctrl-C stops everything.
#   examples/launch-1p1d-tiered.sh MODEL_DIR
set -euo pipefail
MODEL=${1:?usage: $0 MODEL_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 \
       VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} \
       MC_LOG_LEVEL=ERROR MC_STORE_CLIENT_SETUP_RETRIES=1 MC_TCP_BIND_ADDRESS=127.0.0.1
# bf16 where the CPU has native bf16, float32 elsewhere (`mctier cpu`); DTYPE=... overrides.
DTYPE="${DTYPE:-$(mctier cpu --dtype)}"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM
serve() {  # core port config
  VLLM_CPU_OMP_THREADS_BIND=$1 setsid mctier serve "$MODEL" --host 127.0.0.1 --port "$2" --enforce-eager \
    --block-size 32 --max-model-len 8192 --served-model-name model --enable-prompt-tokens-details \
    --dtype "$DTYPE" --kv-transfer-config "$(cat "$3")" & pids+=($!)
}
setsid mctier master --port 50051 --metrics-port 9003 --segment-size 4GB & pids+=($!)
sleep 3
serve 0 8100 "$HERE/tiered-prefill.json"
serve 1 8200 "$HERE/tiered-decode.json"
for port in 8100 8200; do
  until curl -sf "127.0.0.1:$port/health" >/dev/null; do sleep 1; done
done
setsid mctier proxy --port 8000 --prefill http://127.0.0.1:8100@http://127.0.0.1:8998 \
  --decode http://127.0.0.1:8200 & pids+=($!)
echo "proxy on http://127.0.0.1:8000 (OpenAI API); Ctrl-C stops everything"
wait
