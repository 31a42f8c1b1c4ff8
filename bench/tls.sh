#!/usr/bin/env bash
# floodgate's HTTPS listener against nginx's `listen ssl`, in alternating rounds, both with
# one worker and the same ECDSA P-256 certificate, both proxying to the same keep-alive
# nginx upstream. Two scenarios: keep-alive requests over TLS (wrk -c64), and one request
# per connection (`Connection: close`, so each request is a new TLS handshake). Prints
# one line per run with req/s and the server's user and kernel CPU per request, then the
# medians. Usage (from the repository root):
#
#   bash bench/tls.sh [BINARY]          # default target/release/floodgate
#
# Knobs: ROUNDS (3), DURATION (5 s per run, after a 2 s warm-up), CONNECTIONS (64),
# FIRST_PORT (18400). Every server on core 0, wrk on core 1. Needs nginx, wrk, openssl,
# taskset.
set -euo pipefail
cd "$(dirname "$0")/.."

BINARY=${1:-target/release/floodgate}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
CONNECTIONS=${CONNECTIONS:-64}
FIRST_PORT=${FIRST_PORT:-18400}
for tool in nginx wrk openssl taskset; do
  command -v "$tool" >/dev/null || { echo "missing $tool" >&2; exit 1; }
done
[ -x "$BINARY" ] || { echo "no such binary: $BINARY" >&2; exit 1; }

# shellcheck source=bench/common.sh
source bench/common.sh
start_run
dir=$RUN_DIR
upstream_port=$FIRST_PORT
nginx_port=$((FIRST_PORT + 1))
floodgate_port=$((FIRST_PORT + 2))
floodgate_plain=$((FIRST_PORT + 3))

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -keyout "$dir/site.key" -out "$dir/site.crt" -subj /CN=localhost \
  -addext subjectAltName=DNS:localhost -addext basicConstraints=critical,CA:FALSE 2>/dev/null

nginx_config "$dir/upstream" "$upstream_port" "" "$UPSTREAM_LOCATION"
taskset -c 0 nginx -c "$dir/upstream/nginx.conf" >/dev/null 2>&1 &
pids+=($!)

# nginx with TLS: the same one-worker configuration, its server on ssl.
nginx_config "$dir/nginx" "$nginx_port" "$(proxy_upstream "$upstream_port")" "$PROXY_LOCATION"
sed -i "s#listen 127.0.0.1:$nginx_port; listen 127.0.0.2:$nginx_port; listen 127.0.0.3:$nginx_port;#listen 127.0.0.1:$nginx_port ssl; ssl_certificate $dir/site.crt; ssl_certificate_key $dir/site.key; ssl_protocols TLSv1.2 TLSv1.3;#" \
  "$dir/nginx/nginx.conf"
taskset -c 0 nginx -c "$dir/nginx/nginx.conf" >/dev/null 2>&1 &
pids+=($!)
echo $! >"$dir/nginx.pid"

cat >"$dir/floodgate.toml" <<EOF
[server]
listen = "127.0.0.1:$floodgate_plain"
admin_listen = "127.0.0.1:0"
workers = 1

[server.tls]
listen = "127.0.0.1:$floodgate_port"
certificates = [{ cert = "site.crt", key = "site.key" }]

[upstreams.up]
url = "http://127.0.0.1:$upstream_port"

[[routes]]
name = "all"
path_prefix = "/"
upstream = "up"
EOF
FLOODGATE_LOG=warn taskset -c 0 "$BINARY" --config "$dir/floodgate.toml" >"$dir/floodgate.log" 2>&1 &
pids+=($!)
echo $! >"$dir/floodgate.pid"

for port in "$upstream_port" "$nginx_port" "$floodgate_port"; do
  for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
done

hz=$(getconf CLK_TCK)
results=$dir/results
for round in $(seq "$ROUNDS"); do
  for scenario in keepalive handshake; do
    extra=()
    [ "$scenario" = handshake ] && extra=(-H "Connection: close")
    for name in nginx floodgate; do
      port=$nginx_port
      [ "$name" = floodgate ] && port=$floodgate_port
      url=https://127.0.0.1:$port/
      pid=$(cat "$dir/$name.pid")
      taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d2s "${extra[@]}" "$url" >/dev/null 2>&1
      read -r user0 kernel0 < <(cpu_ticks "$pid")
      report=$(taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" "${extra[@]}" "$url" 2>&1)
      read -r user1 kernel1 < <(cpu_ticks "$pid")
      awk -v round="$round" -v scenario="$scenario" -v name="$name" -v u=$((user1 - user0)) -v k=$((kernel1 - kernel0)) -v hz="$hz" '
        /requests in/ { total = $1 }
        /Requests\/sec/ { rate = $2 }
        /Non-2xx/ { bad = $NF }
        /Socket errors/ { errors = $0 }
        END { printf "%d %s %s %.0f %.2f %.2f %d\n", round, scenario, name, rate, u / hz * 1e6 / total, k / hz * 1e6 / total, bad }' <<<"$report" |
        tee -a "$results" |
        awk '{ printf "round %s  %-9s %-9s %8s req/s  user %s µs  kernel %s µs per request  non-2xx %s\n", $1, $2, $3, $4, $5, $6, $7 }'
    done
  done
done

echo
echo "| scenario | server | req/s (median of $ROUNDS) | user µs/request | kernel µs/request |"
echo "|---|---|---|---|---|"
for scenario in keepalive handshake; do
  for name in nginx floodgate; do
    median() { awk -v s="$scenario" -v n="$name" -v f="$1" '$2 == s && $3 == n { print $f }' "$results" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
    echo "| $scenario | $name | $(median 4) | $(median 5) | $(median 6) |"
  done
done
