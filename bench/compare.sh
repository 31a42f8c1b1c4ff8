#!/usr/bin/env bash
# Side-by-side benchmark: floodgate against nginx as a reverse proxy, same upstream, same
# load. Usage (from the repository root):
#
#   bash bench/compare.sh            # installs nginx and wrk with apt-get when missing (as root)
#
# It builds floodgate in release mode, starts a trivial nginx upstream (`return 200 ok`),
# nginx as a keep-alive proxy (1 worker) and floodgate passthrough (workers = 1, access log
# off, like nginx's `access_log off`), runs `wrk -t1 -c64` against each, and prints a table.
# With 2+ cores the servers share core 0 and wrk runs on core 1. Knobs: DURATION (s),
# CONNECTIONS, REPEATS. The two are measured in turn within each repeat (so a slow spell of
# the machine hits both), and the table gives medians and the median of the per-repeat
# ratios. Everything listens on 127.0.0.1 and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
CONNECTIONS=${CONNECTIONS:-64}
REPEATS=${REPEATS:-3}
UPSTREAM_PORT=${UPSTREAM_PORT:-19081}
NGINX_PORT=${NGINX_PORT:-19082}
FLOODGATE_PORT=${FLOODGATE_PORT:-19083}

missing=()
for tool in nginx wrk; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing ${missing[*]}: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi
command -v cargo >/dev/null || { echo "missing cargo (https://rustup.rs)" >&2; exit 1; }
cargo build --release --quiet
# shellcheck source=bench/common.sh
source bench/common.sh
start_run
RUN=$RUN_DIR

if [ "$(nproc)" -ge 2 ]; then SERVER="taskset -c 0"; LOAD="taskset -c 1"; else SERVER=""; LOAD=""; fi

nginx_conf() { # name port http-block location-block
  nginx_config "$RUN/$1" "$2" "$3" "$4"
  $SERVER nginx -c "$RUN/$1/nginx.conf" >/dev/null 2>&1 &
  pids+=($!)
}

nginx_conf upstream "$UPSTREAM_PORT" "" "$UPSTREAM_LOCATION"
nginx_conf proxy "$NGINX_PORT" "$(proxy_upstream "$UPSTREAM_PORT")" "$PROXY_LOCATION"

cat > "$RUN/floodgate.toml" <<CONF
[server]
listen = "127.0.0.1:$FLOODGATE_PORT"
admin_listen = "127.0.0.1:0"
workers = 1

[upstreams.app]
url = "http://127.0.0.1:$UPSTREAM_PORT"

[[routes]]
name = "all"
upstream = "app"
CONF
FLOODGATE_LOG=warn $SERVER target/release/floodgate --config "$RUN/floodgate.toml" >"$RUN/floodgate.log" 2>&1 &
pids+=($!)

for port in "$UPSTREAM_PORT" "$NGINX_PORT" "$FLOODGATE_PORT"; do
  for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
done

run() { # port -> "req/s p99ms"
  $LOAD wrk -t1 -c"$CONNECTIONS" -d2s "http://127.0.0.1:$1/" >/dev/null
  $LOAD wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency "http://127.0.0.1:$1/" |
    awk '/Requests\/sec/ {rps=$2} / 99%/ {p=$2; if (p ~ /us$/) {sub("us","",p); p=p/1000} else if (p ~ /ms$/) {sub("ms","",p)} else if (p ~ /s$/) {sub("s","",p); p=p*1000}} END {printf "%d %.2f\n", rps, p}'
}

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

nginx=(); floodgate=(); ratios=()
for _ in $(seq "$REPEATS"); do
  n=$(run "$NGINX_PORT"); f=$(run "$FLOODGATE_PORT")
  nginx+=("$n"); floodgate+=("$f")
  ratios+=("$(awk -v a="${f%% *}" -v b="${n%% *}" 'BEGIN {printf "%.2f", a/b}')")
done

# The median of field $1 ($1 = 1: req/s, 2: p99) over the "req/s p99" results that follow.
column() { local field=$1; shift; printf '%s\n' "$@" | awk -v f="$field" '{print $f}' | median; }

printf '\n| proxy (1 worker, wrk -t1 -c%s, median of %s) | req/s | p99 ms | ratio to nginx |\n|---|---|---|---|\n' "$CONNECTIONS" "$REPEATS"
printf '| nginx | %s | %s | 1.00 |\n' "$(column 1 "${nginx[@]}")" "$(column 2 "${nginx[@]}")"
printf '| floodgate | %s | %s | %s (per repeat: %s) |\n' "$(column 1 "${floodgate[@]}")" \
  "$(column 2 "${floodgate[@]}")" "$(printf '%s\n' "${ratios[@]}" | median)" "${ratios[*]}"
