#!/usr/bin/env bash
# Redis decisions per second and Redis CPU per decision: floodgate's RedisStore (group
# commit, decide.lua) against the native redis-cell module under redis-benchmark -P16, on
# the same bucket and keys, in alternating rounds so every ratio is paired within a round.
# Usage (from the repository root):
#
#   CELL_MODULE=/path/to/libredis_cell.so bash bench/redis_vs_cell.sh
#
# Build redis-cell from crates.io (redis-cell 0.2.2: `cargo build --release` in its
# source). Each round starts a fresh redis-server pinned to core 0, runs redis-benchmark
# on core 1 (`CL.THROTTLE`, 50 connections, 16 pipelined, -r KEYS), restarts Redis, and
# runs `examples/redis_decisions` on core 1 (1,024 callers). Knobs: ROUNDS (5), KEYS
# (10000; 1 for one busy key), RUN_SECONDS per floodgate run (5), CELL_N (requests per
# redis-benchmark run, 1000000), POLICY: `anchors` (default: 1000 per 60 s, 1000 deep,
# anchors.sh's policy for redis-cell: the state lives on) or `never` (never refuses; the
# state expires at once). Needs redis-server, redis-benchmark, redis-cli and cargo.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-5}
KEYS=${KEYS:-10000}
SECONDS_PER_RUN=${RUN_SECONDS:-5}
CELL_N=${CELL_N:-1000000}
POLICY=${POLICY:-anchors}
PORT=${PORT:-6391}
[ -f "${CELL_MODULE:-}" ] || { echo "set CELL_MODULE to libredis_cell.so" >&2; exit 1; }
case $POLICY in
  anchors) cell_args=(999 1000 60 1); floodgate_args=(1000 60 1000) ;;
  never) cell_args=(1000000 1000000000 1 1); floodgate_args=(1000000000 1 1000000000) ;;
  *) echo "POLICY: anchors or never" >&2; exit 1 ;;
esac
clients=50
[ "$KEYS" = 1 ] && clients=1

cargo build --release --quiet --example redis_decisions
dir=$(mktemp -d)
server=
stop() { [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; }
trap 'stop; rm -rf "$dir"' EXIT
start() {
  taskset -c 0 redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
    --loadmodule "$CELL_MODULE" >"$dir/redis.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && return; sleep 0.1; done
  echo "redis-server did not start" >&2; exit 1
}
cpu_us() { redis-cli -p "$PORT" info cpu | awk -F: '/^used_cpu_(sys|user):/ {s += $2} END {printf "%.0f", s * 1e6}'; }

printf '| round | redis-cell decisions/s | floodgate decisions/s | ratio | redis-cell Redis CPU µs/decision | floodgate | ratio |\n|---|---|---|---|---|---|---|\n'
for round in $(seq "$ROUNDS"); do
  start
  before=$(cpu_us)
  cell_rate=$(taskset -c 1 redis-benchmark -p "$PORT" -n "$CELL_N" -c "$clients" -P 16 -r "$KEYS" -q \
    CL.THROTTLE 'cell:__rand_int__' "${cell_args[@]}" | tr '\r' '\n' | sed -nE 's/.*: ([0-9.]+) requests per second.*/\1/p' | tail -1)
  cell_cpu=$(awk -v a="$before" -v b="$(cpu_us)" -v n="$CELL_N" 'BEGIN {printf "%.2f", (b - a) / n}')
  stop
  start
  line=$(taskset -c 1 target/release/examples/redis_decisions "redis://127.0.0.1:$PORT" 1024 "$SECONDS_PER_RUN" \
    "$KEYS" "${floodgate_args[@]}")
  stop
  ours=$(sed -E 's/.*decisions\/s=([0-9.]+).*/\1/' <<<"$line")
  ours_cpu=$(sed -E 's/.*redis cpu us\/decision=([0-9.]+).*/\1/' <<<"$line")
  awk -v r="$round" -v c="$cell_rate" -v f="$ours" -v cc="$cell_cpu" -v fc="$ours_cpu" 'BEGIN {
    printf "| %d | %.0f | %.0f | %.2f | %.2f | %.2f | %.2f |\n", r, c, f, f / c, cc, fc, fc / cc }'
done
