#!/usr/bin/env bash
# What one request costs floodgate in user-space instructions, counted by callgrind: a
# repeatable measure of the request path (to about 1 %), where wall-clock A/B runs on a
# shared VM need differences of several percent to show. Kernel time is not counted (see
# bench/ab.sh for user and kernel CPU per request). Usage (from the repository root):
#
#   bash bench/request_cost.sh [TEMPLATE] [BINARY]
#
# TEMPLATE: a gateway.toml with anchors.sh's placeholders (default: its passthrough), or
# `-` to run BINARY with the listen address and the upstream's address as its arguments
# (examples/bare_proxy); BINARY: default target/release/floodgate. It starts an nginx upstream (`return 200
# 'ok'`) and a Redis, floodgate under callgrind, warms it up with wrk, then counts the
# instructions of a wrk run of RUN_SECONDS (default 5) over CONNECTIONS (default 8) and
# divides by the requests wrk completed (with Redis limits, it also prints the requests
# per script call: under callgrind the gateway is slow beside Redis, so CONNECTIONS sets
# how many requests a call carries). TOP (default 20) lists the functions that take the most per
# request (self cost; the frames below the event loop, charged with everything, are
# skipped); KEEP=FILE keeps the callgrind dump; CALLGRIND_OPTIONS adds valgrind options
# (`--cache-sim=yes`, `--dump-instr=yes` with the `profiling` build for source lines);
# LOAD=h2 makes the load h2load's (HTTP/2 over cleartext, one stream at a time on each of
# the CONNECTIONS) instead of wrk's HTTP/1.1.
# FLOODGATE_LOG is floodgate's log filter (default `warn`: no access log, as nginx's
# `access_log off` in the upstream and the peers' benchmarks; `info` to count it). A
# template naming @FASTCGI_URL@ (bench/conf/php-hello.toml.tmpl) is measured on a PHP
# script under a PHP-FPM pool started here. Needs nginx, wrk, redis-server, valgrind (and
# php-fpm8.2 for PHP).
set -euo pipefail
cd "$(dirname "$0")/.."

TEMPLATE=${1:-../shared/bench/conf/floodgate/passthrough.toml.tmpl}
BINARY=${2:-target/release/floodgate}
SECONDS_MEASURED=${RUN_SECONDS:-5}
CONNECTIONS=${CONNECTIONS:-8}
TOP=${TOP:-20}
# HEADERS: request headers wrk sends besides Host, one `Name: value` a line (a browser's,
# say: wrk alone sends none).
wrk_headers=()
while IFS= read -r line; do
  [ -n "$line" ] && wrk_headers+=(-H "$line")
done <<<"${HEADERS:-}"
load_tool=wrk
[ "${LOAD:-}" = h2 ] && load_tool=h2load
for tool in nginx "$load_tool" redis-server valgrind callgrind_control callgrind_annotate python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool" >&2; exit 1; }
done
{ [ "$TEMPLATE" = - ] || [ -f "$TEMPLATE" ]; } && [ -x "$BINARY" ] || { echo "no such template or binary" >&2; exit 1; }

# shellcheck source=bench/common.sh
source bench/common.sh
start_run
dir=$RUN_DIR
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
upstream_port=$(free_port)
redis_port=$(free_port)
gateway_port=$(free_port)
nginx_config "$dir/upstream" "$upstream_port" "" "$UPSTREAM_LOCATION"
nginx -c "$dir/upstream/nginx.conf" >/dev/null 2>&1 &
pids+=($!)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" >/dev/null 2>&1 &
pids+=($!)
# A template naming @FASTCGI_URL@ gets a PHP-FPM pool (pm static, 4 children) serving a
# hello-world script, hello.php under @SITE_ROOT@, which is then what wrk asks for, beside
# file4k.txt (4 KB of text) for URL_PATH=/file4k.txt to measure a file served by floodgate.
url_path=/
if [ "$TEMPLATE" != - ] && grep -q @FASTCGI_URL@ "$TEMPLATE"; then
  command -v php-fpm8.2 >/dev/null || { echo "missing php-fpm8.2" >&2; exit 1; }
  fpm_port=$(free_port)
  mkdir -p "$dir/site"
  echo '<?php echo "hello";' >"$dir/site/hello.php"
  # Cut to size afterwards: a `head -c` closing the pipe early can kill base64 with
  # SIGPIPE, which pipefail turns into this script's failure.
  head -c 3072 /dev/urandom | base64 -w 76 >"$dir/site/file4k.txt"
  truncate -s 4096 "$dir/site/file4k.txt"
  php_fpm_config "$dir/fpm.conf" "$dir" "$fpm_port" 4
  php-fpm8.2 -F -R -y "$dir/fpm.conf" >/dev/null 2>&1 &
  pids+=($!)
  url_path=/hello.php
fi
if [ "$TEMPLATE" = - ]; then
  arguments=("127.0.0.1:$gateway_port" "127.0.0.1:$upstream_port")
  name=$(basename "$BINARY")
else
  sed -e "s#@LISTEN_ADDR@#127.0.0.1:$gateway_port#" -e "s#@UPSTREAM_URL@#http://127.0.0.1:$upstream_port#" -e "s#@UPSTREAM_PORT@#$upstream_port#g" \
    -e "s#@REDIS_URL@#redis://127.0.0.1:$redis_port#" -e "s#@FASTCGI_URL@#fastcgi://127.0.0.1:${fpm_port:-0}#" \
    -e "s#@SITE_ROOT@#$dir/site#" "$TEMPLATE" >"$dir/gateway.toml"
  arguments=(--config "$dir/gateway.toml")
  name=$(basename "$TEMPLATE" .toml.tmpl)
fi
FLOODGATE_LOG=${FLOODGATE_LOG:-warn} valgrind --tool=callgrind ${CALLGRIND_OPTIONS:-} --callgrind-out-file="$dir/callgrind.out" \
  "$BINARY" "${arguments[@]}" >"$dir/gateway.log" 2>&1 &
gateway=$!
pids+=($gateway)
for _ in $(seq 300); do (exec 3<>"/dev/tcp/127.0.0.1/$gateway_port") 2>/dev/null && break; sleep 0.1; done

url=http://127.0.0.1:$gateway_port${URL_PATH:-$url_path}
# Loads the gateway for $1 seconds; prints the requests completed.
load() {
  if [ "$load_tool" = h2load ]; then
    h2load -c "$CONNECTIONS" -m 1 -D "$1" "${wrk_headers[@]}" "$url" | awk '/^requests:/ {print $6}'
  else
    wrk -t1 -c"$CONNECTIONS" -d"$1s" "${wrk_headers[@]}" "$url" | awk '/requests in/ {print $1}'
  fi
}
load 3 >/dev/null
script_calls() { redis-cli -p "$redis_port" info commandstats | awk -F'[=,:]' '/^cmdstat_evalsha:/ {n = $3} END {print n + 0}'; }
calls_before=$(script_calls)
callgrind_control -z "$gateway" >/dev/null 2>&1
requests=$(load "$SECONDS_MEASURED")
callgrind_control -d "$gateway" >/dev/null 2>&1
calls=$(( $(script_calls) - calls_before ))
dump=$(ls "$dir"/callgrind.out.* | sort | tail -1)
callgrind_annotate --threshold=100 "$dump" >"$dir/annotate.txt" 2>/dev/null
[ -n "${KEEP:-}" ] && cp "$dump" "$KEEP"
total=$(awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }' "$dir/annotate.txt")
echo "$name: $((total / requests)) instructions per request ($total over $requests requests)"
[ "$calls" -gt 0 ] && echo "  $calls script calls, $((requests * 10 / calls / 10)).$((requests * 10 / calls % 10)) requests per call"
if [ "$TOP" -gt 0 ]; then
  sed -n '/file:function/,$p' "$dir/annotate.txt" | sed -n '3,$p' |
    sed -E 's/ \[[^]]*\]$//; s/\([ 0-9.%]+\)//' |
    awk -v r="$requests" -v t="$total" 'NF >= 2 { c = $1; gsub(",", "", c); if (c + 0 < t / 2) printf "%8d  %s\n", c / r, $2 }' |
    head -n "$TOP"
fi
