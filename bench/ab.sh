#!/usr/bin/env bash
# A/B runs of gateway builds against each other and against nginx, with the CPU each
# server spends per request (user and kernel, read from /proc), in alternating rounds so
# that a slow spell of the machine hits every target. Usage (from the repository root):
#
#   bash bench/ab.sh NAME=BINARY:TEMPLATE ...
#   bash bench/ab.sh new=target/release/floodgate:../shared/bench/conf/floodgate/passthrough.toml.tmpl \
#                    old=/tmp/old/floodgate:../shared/bench/conf/floodgate/passthrough.toml.tmpl
#
# TEMPLATE is a gateway.toml with the placeholders of ../shared/bench/conf/floodgate
# (@LISTEN_ADDR@, @UPSTREAM_URL@, @UPSTREAM_PORT@, @REDIS_URL@; bench/conf has floodgate's own);
# `-` instead runs BINARY with the listen
# address and the upstream's address as its arguments (examples/bare_hyper,
# examples/bare_proxy). Besides the named gateways it runs the
# nginx anchors listed in NGINX (default "nginx nginx-low"; empty: none): `nginx`, a keep-alive reverse
# proxy, and `nginx-low`, the same with limit_req rejecting nearly every request (100 r/s,
# burst 50, answering 429 without logging each rejection, as anchors.sh's). Every server, its upstream (nginx `return 200 'ok'`, one
# worker) and a Redis for the templates run on core 0, wrk -t1 -c64 on core 1. Knobs:
# ROUNDS (3), DURATION (5 s per run, after a 2 s warm-up), CONNECTIONS (64), REDIS_PORT
# (6392). Prints one line per run and the medians. Needs nginx, wrk, redis-server, taskset.
set -euo pipefail

ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
CONNECTIONS=${CONNECTIONS:-64}
NGINX=${NGINX-nginx nginx-low}
REDIS_PORT=${REDIS_PORT:-6392}
UPSTREAM_PORT=${UPSTREAM_PORT:-18300}
FIRST_PORT=${FIRST_PORT:-18310}
for tool in nginx wrk redis-server taskset; do
  command -v "$tool" >/dev/null || { echo "missing $tool" >&2; exit 1; }
done

# shellcheck source=bench/common.sh
source "$(dirname "$0")/common.sh"
start_run
run_dir=$RUN_DIR

names=()
ports=()
next_port=$FIRST_PORT

nginx_server() { # name port http-block location-block
  nginx_config "$run_dir/$1" "$2" "$3" "$4"
  taskset -c 0 nginx -c "$run_dir/$1/nginx.conf" >/dev/null 2>&1 &
  pids+=($!)
  echo $! >"$run_dir/$1.pid"
}

add_target() { names+=("$1"); ports+=("$2"); }

nginx_server upstream "$UPSTREAM_PORT" "" "$UPSTREAM_LOCATION"
proxy_http=$(proxy_upstream "$UPSTREAM_PORT")
proxy_location=$PROXY_LOCATION
for anchor in $NGINX; do
  case $anchor in
    nginx) nginx_server nginx "$next_port" "$proxy_http" "$proxy_location" ;;
    nginx-low)
      nginx_server nginx-low "$next_port" "$proxy_http limit_req_zone \$binary_remote_addr zone=low:10m rate=100r/s; limit_req_status 429; limit_req_log_level info;" \
        "limit_req zone=low burst=50 nodelay; $proxy_location" ;;
    *) echo "unknown nginx anchor: $anchor" >&2; exit 1 ;;
  esac
  add_target "$anchor" "$next_port"
  next_port=$((next_port + 1))
done

taskset -c 0 redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$run_dir" \
  >"$run_dir/redis.log" 2>&1 &
pids+=($!)

for spec in "$@"; do
  name=${spec%%=*}
  binary_and_template=${spec#*=}
  binary=${binary_and_template%%:*}
  template=${binary_and_template#*:}
  if [ "$template" = - ]; then
    # Not a gateway: a server that takes its listen address and the upstream's.
    [ -x "$binary" ] || { echo "$spec: no such binary" >&2; exit 1; }
    taskset -c 0 "$binary" "127.0.0.1:$next_port" "127.0.0.1:$UPSTREAM_PORT" >"$run_dir/$name.log" 2>&1 &
  else
    [ -x "$binary" ] && [ -f "$template" ] || { echo "$spec: no such binary or template" >&2; exit 1; }
    sed -e "s#@LISTEN_ADDR@#127.0.0.1:$next_port#" -e "s#@UPSTREAM_URL@#http://127.0.0.1:$UPSTREAM_PORT#" -e "s#@UPSTREAM_PORT@#$UPSTREAM_PORT#g" \
      -e "s#@REDIS_URL@#redis://127.0.0.1:$REDIS_PORT#" "$template" >"$run_dir/$name.toml"
    FLOODGATE_LOG=warn taskset -c 0 "$binary" --config "$run_dir/$name.toml" >"$run_dir/$name.log" 2>&1 &
  fi
  pids+=($!)
  echo $! >"$run_dir/$name.pid"
  add_target "$name" "$next_port"
  next_port=$((next_port + 1))
done

for port in "$UPSTREAM_PORT" "${ports[@]}"; do
  for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
done

ticks_per_second=$(getconf CLK_TCK)
results=$run_dir/results
for round in $(seq "$ROUNDS"); do
  for i in "${!names[@]}"; do
    name=${names[$i]}
    url=http://127.0.0.1:${ports[$i]}/
    pid=$(cat "$run_dir/$name.pid")
    taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d2s "$url" >/dev/null
    read -r user0 kernel0 < <(cpu_ticks "$pid")
    report=$(taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency "$url")
    read -r user1 kernel1 < <(cpu_ticks "$pid")
    awk -v round="$round" -v name="$name" -v u=$((user1 - user0)) -v k=$((kernel1 - kernel0)) -v hz="$ticks_per_second" '
      /requests in/ { total = $1 }
      /Requests\/sec/ { rate = $2 }
      / 99%/ { p99 = $2 }
      /Non-2xx/ { refused = $NF }
      END {
        printf "%d %s %.0f %s %.2f %.2f %d\n", round, name, rate, p99, u / hz * 1e6 / total, k / hz * 1e6 / total, refused
      }' <<<"$report" | tee -a "$results" |
      awk '{ printf "round %s  %-14s %8s req/s  p99 %-8s  user %s µs  kernel %s µs per request  non-2xx %s\n", $1, $2, $3, $4, $5, $6, $7 }'
  done
done

echo
echo "| target | req/s (median of $ROUNDS) | user µs/request | kernel µs/request |"
echo "|---|---|---|---|"
for name in "${names[@]}"; do
  median() { awk -v n="$name" -v f="$1" '$2 == n { print $f }' "$results" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
  echo "| $name | $(median 3) | $(median 5) | $(median 6) |"
done
