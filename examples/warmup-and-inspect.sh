#!/usr/bin/env bash
# Warm the store with recurring prefixes, then look at what it holds.
#
#   mctier master --port 50051 --metrics-port 9003 &            # master + store server
#   mctier serve MODEL --block-size 32 --port 8000 --dtype "$(mctier cpu --dtype)" \
#       --kv-transfer-config "$(cat examples/store-only.json)" &  # an engine with the store tier
#   examples/warmup-and-inspect.sh MODEL
#
# The tools need only the master and the engine's URL (--server/--engine) or its model (--model):
# the key space, tokenizer and layout come from the metadata the engine's connector published in
# the store when it started. The tools find the master's admin API from the master (the store
# server publishes it). `--fingerprint FP16` (from `inspect summary`) works as well.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${1:?usage: $0 MODEL}"
ENGINE="${ENGINE:-http://127.0.0.1:8000}"
MASTER="${MASTER:-127.0.0.1:50051}"

# 1. Warm through the live engine, hard-pinned (first run computes, re-runs skip what is stored).
mctier warmup "$HERE/warmup-prefixes.txt" --server "$ENGINE" --master "$MASTER" --pin hard
mctier warmup "$HERE/warmup-chat.jsonl" --server "$ENGINE" --master "$MASTER"
# (With --model "$MODEL" instead of --server an offline vLLM engine runs in a child process, with the
# settings the engine published.)

# 2. What the store holds, per model fingerprint and tier; a prompt's hit depth chunk by chunk.
mctier inspect summary --master "$MASTER"
mctier inspect lookup --master "$MASTER" --model "$MODEL" \
    --prompt "$(head -c 2000 "$HERE/warmup-prefixes.txt") and now my question"
mctier inspect stats --master "$MASTER" --engine "$ENGINE"

# 3. The same as an HTTP JSON API on loopback (OpenAPI at /docs); deletes need the token.
#   MCTIER_INSPECT_TOKEN=secret mctier inspect serve --master 127.0.0.1:50051 --engine "$ENGINE" --port 9400 &
#   curl -s localhost:9400/summary
#   curl -s -X POST localhost:9400/lookup -H 'Content-Type: application/json' -d '{"prompt": "..."}'
#   curl -s -X DELETE -H "Authorization: Bearer secret" localhost:9400/fingerprints/FP16
