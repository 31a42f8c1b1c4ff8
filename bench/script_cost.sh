#!/usr/bin/env bash
# What one rate-limit decision costs Redis, in instructions, counted by callgrind inside
# redis-server on a fixed input: repeatable to a fraction of a percent, where wall-clock
# figures on a shared VM swing by tens of percent. Usage (from the repository root):
#
#   bash bench/script_cost.sh [floodgate|cell] [BATCH] [KEYS]
#
# floodgate: src/limit/scripts/decide.lua, BATCH one-check requests per EVALSHA (default
# 32), the keys drawn from KEYS client keys (default 10000; 1 for one busy client).
# cell: redis-cell's CL.THROTTLE on the same keys, one call per decision, pipelined; set
# CELL_MODULE to its libredis_cell.so (build it from crates.io: redis-cell 0.2.2).
# It sends WARM calls (default 400) first, then counts CALLS (default 200) and prints the
# instructions per decision and the functions that take the most. The bucket: RATE tokens
# per second (default 1e9: the state expires at once; RATE=1 keeps it), BURST deep
# (default 1e9). Needs redis-server, redis-cli, valgrind and python3. KEEP=1 keeps the
# server's directory; REDIS_SERVER names another redis-server binary (Debian's is
# stripped: build one with symbols to see which functions take the most); SCRIPT another
# version of decide.lua, to compare.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-floodgate}
BATCH=${2:-32}
KEYS=${3:-10000}
WARM=${WARM:-400}
CALLS=${CALLS:-200}
TOP=${TOP:-25}
RATE=${RATE:-1000000000}
export BURST=${BURST:-1000000000}
REDIS_SERVER=${REDIS_SERVER:-redis-server}
SCRIPT=${SCRIPT:-src/limit/scripts/decide.lua}

for tool in "$REDIS_SERVER" redis-cli valgrind callgrind_control callgrind_annotate python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool" >&2; exit 1; }
done
if [ "$MODE" = cell ] && [ ! -f "${CELL_MODULE:-}" ]; then
  echo "cell: set CELL_MODULE to libredis_cell.so" >&2
  exit 1
fi

dir=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
server_pid=
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $dir" >&2; else rm -rf "$dir"; fi
}
trap cleanup EXIT

module_args=()
[ "$MODE" = cell ] && module_args=(--loadmodule "$CELL_MODULE")
valgrind --tool=callgrind --callgrind-out-file="$dir/callgrind.out" \
  "$REDIS_SERVER" --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
  "${module_args[@]}" >"$dir/server.log" 2>&1 &
server_pid=$!
cli() { redis-cli -p "$port" "$@"; }
for _ in $(seq 200); do cli ping >/dev/null 2>&1 && break; sleep 0.1; done

if [ "$MODE" = floodgate ]; then
  sha=$(cli script load "$(cat "$SCRIPT")")
  gen() { python3 bench/script_cost.py floodgate "$sha" "$1" "$BATCH" "$KEYS" "$2" "$RATE"; }
else
  gen() { python3 bench/script_cost.py cell "$1" "$BATCH" "$KEYS" "$2" "$RATE"; }
fi
gen "$WARM" 1 >"$dir/warm.resp"
gen "$CALLS" 2 >"$dir/measure.resp"

cli --pipe <"$dir/warm.resp" >/dev/null
callgrind_control -z "$server_pid" >/dev/null 2>&1
cli --pipe <"$dir/measure.resp" >"$dir/pipe.log"
grep -q 'errors: 0' "$dir/pipe.log" || { cat "$dir/pipe.log" >&2; exit 1; }
callgrind_control -d "$server_pid" >/dev/null 2>&1
dump=$(ls "$dir"/callgrind.out.* | sort | tail -1)

callgrind_annotate --threshold=100 "$dump" >"$dir/annotate.txt"
total=$(awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }' "$dir/annotate.txt")
decisions=$((CALLS * BATCH))
echo "$MODE: batch $BATCH, $KEYS keys: $((total / decisions)) instructions per decision ($total over $decisions decisions)"
if [ "$TOP" -gt 0 ]; then
  # Self cost per decision of the functions that take the most (the dump, taken while
  # the server runs, also charges everything to the frames below the event loop: skipped).
  sed -n '/file:function/,$p' "$dir/annotate.txt" | sed -n '3,$p' |
    sed -E 's/ \[[^]]*\]$//; s/\([ 0-9.%]+\)//' |
    awk -v d="$decisions" -v t="$total" 'NF >= 2 { c = $1; gsub(",", "", c); if (c + 0 < t + 0) printf "%8d  %s\n", c / d, $2 }' |
    head -n "$TOP"
fi
