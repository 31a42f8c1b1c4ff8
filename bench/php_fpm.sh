#!/usr/bin/env bash
# floodgate in front of PHP-FPM and a site's files, beside nginx doing the same, in one run
# (docs/performance.md#php-fpm-and-files). Usage, from the repository root:
#
#   cargo build --release && ROUNDS=3 DUR=5 bash bench/php_fpm.sh
#
# Two identical PHP-FPM pools (pm = static, CHILDREN workers), one for each server (a
# kept-alive FastCGI connection holds a worker, so servers sharing a pool would wait for
# each other's idle connections), and one site directory: hello.php
# (`echo "hello"`), a 4 KB file and a 100 MB file. nginx (1 worker; fastcgi_pass with
# keep-alive connections, root + try_files, sendfile) and floodgate (workers = 1; a
# fastcgi:// upstream with max_requests = CHILDREN, the route's root) serve the same three.
# PHP-FPM and both servers run on core 0, wrk on core 1. Each round runs every scenario on
# nginx and then on floodgate; the table gives medians and the per-round ratios, CPU per
# request of the server alone (user + system time of its process), and for the large file
# throughput and the server's peak RSS. Knobs: ROUNDS, DUR (s), CHILDREN, CONNS.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
DUR=${DUR:-5}
CHILDREN=${CHILDREN:-4}
CONNS=${CONNS:-32}
FLOODGATE_BIN=${FLOODGATE_BIN:-$PWD/target/release/floodgate}
FPM_PORT=${FPM_PORT:-19190}
NGINX_PORT=${NGINX_PORT:-19191}
FLOODGATE_PORT=${FLOODGATE_PORT:-19192}

for tool in php-fpm8.2 nginx wrk; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install -y php8.2-fpm nginx wrk" >&2; exit 1; }
done
[ -x "$FLOODGATE_BIN" ] || { echo "build floodgate first: cargo build --release" >&2; exit 1; }
# shellcheck source=bench/common.sh
source bench/common.sh
start_run
RUN=$RUN_DIR
if [ "$(nproc)" -ge 2 ]; then SERVER="taskset -c 0"; LOAD="taskset -c 1"; else SERVER=""; LOAD=""; fi

SITE=$RUN/site
mkdir -p "$SITE"
echo '<?php echo "hello";' >"$SITE/hello.php"
# Cut to size afterwards: a `head -c` closing the pipe early can kill base64 with
# SIGPIPE, which pipefail turns into this script's failure.
head -c 3072 /dev/urandom | base64 -w 76 >"$SITE/file4k.txt"
truncate -s 4096 "$SITE/file4k.txt"
head -c $((100 * 1024 * 1024)) /dev/urandom >"$SITE/file100m.bin"
# nginx's worker runs as www-data.
chmod -R a+rX "$RUN"

NGINX_FPM_PORT=$FPM_PORT
FLOODGATE_FPM_PORT=$((FPM_PORT + 10))
for port in $NGINX_FPM_PORT $FLOODGATE_FPM_PORT; do
  php_fpm_config "$RUN/fpm-$port.conf" "$RUN" "$port" "$CHILDREN"
  $SERVER php-fpm8.2 -F -R -y "$RUN/fpm-$port.conf" >/dev/null 2>&1 &
  pids+=($!)
done

# nginx as the usual PHP site: a try_files front controller, PHP through fastcgi_pass with
# kept-alive connections, files with sendfile (bench/common.sh's server, this location).
nginx_config "$RUN/nginx" "$NGINX_PORT" \
  "include /etc/nginx/mime.types; sendfile on; tcp_nopush on;
  upstream php { server 127.0.0.1:$NGINX_FPM_PORT; keepalive $CHILDREN; }" \
  "root $SITE; index index.php; try_files \$uri \$uri/ /index.php?\$query_string;
    location ~ \.php\$ {
      try_files \$uri =404;
      include /etc/nginx/fastcgi_params;
      fastcgi_param SCRIPT_FILENAME \$document_root\$fastcgi_script_name;
      fastcgi_keep_conn on;
      fastcgi_pass php;
    }"
$SERVER nginx -c "$RUN/nginx/nginx.conf" &
pids+=($!)
NGINX_PID=$!

cat >"$RUN/floodgate.toml" <<CONF
[server]
listen = "127.0.0.1:$FLOODGATE_PORT"
admin_listen = "127.0.0.1:0"
workers = 1

[upstreams.php]
url = "fastcgi://127.0.0.1:$FLOODGATE_FPM_PORT"
max_requests = $CHILDREN

[[routes]]
name = "site"
upstream = "php"
root = "$SITE"
CONF
$SERVER env FLOODGATE_LOG=warn "$FLOODGATE_BIN" --config "$RUN/floodgate.toml" &
pids+=($!)
FLOODGATE_PID=$!

wait_for() {
  for _ in $(seq 100); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "no answer from $1:" >&2; curl -si "$1" >&2; cat "$RUN/nginx/error.log" >&2; exit 1
}
for port in $NGINX_PORT $FLOODGATE_PORT; do
  wait_for "http://127.0.0.1:$port/hello.php"
  [ "$(curl -s "http://127.0.0.1:$port/hello.php")" = hello ] || { echo "PHP did not answer on $port" >&2; exit 1; }
  cmp -s <(curl -s "http://127.0.0.1:$port/file4k.txt") "$SITE/file4k.txt" || { echo "the 4 KB file differs on $port" >&2; exit 1; }
done

ticks() { local user kernel; read -r user kernel < <(cpu_ticks "$1"); echo $((user + kernel)); }
# The resident set of the server process (nginx: its worker).
rss_kb() { local p=$1; [ "$p" = "$NGINX_PID" ] && p=$(pgrep -P "$NGINX_PID" | head -1); awk '/VmRSS/ {print $2}' "/proc/$p/status"; }
CLK=$(getconf CLK_TCK)
CSV=${OUT:-$RUN}/php_fpm.csv
echo "round,scenario,server,rps,mb_per_s,cpu_us_per_req,rss_before_kb,rss_peak_kb" >"$CSV"
bytes() { awk -v v="$1" 'BEGIN{ m=1; if (v ~ /GB$/) m=1024*1024*1024; else if (v ~ /MB$/) m=1024*1024; else if (v ~ /KB$/) m=1024; sub(/[KMG]?B$/,"",v); printf "%.1f", v*m/1048576 }'; }

measure() { # round scenario server pid port path connections
  local url="http://127.0.0.1:$5$6" t0 t1 o n rps mb before peak sampler
  $LOAD wrk -t1 -c"$7" -d1s "$url" >/dev/null 2>&1 || true
  before=$(rss_kb "$4")
  echo "$before" >"$RUN/peak"
  ( while sleep 0.2; do r=$(rss_kb "$4"); [ "$r" -gt "$(cat "$RUN/peak")" ] && echo "$r" >"$RUN/peak"; done ) &
  sampler=$!
  t0=$(ticks "$4")
  o=$($LOAD wrk -t1 -c"$7" -d"${DUR}s" "$url")
  t1=$(ticks "$4")
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null || true
  peak=$(cat "$RUN/peak")
  n=$(awk '/requests in/ {print $1}' <<<"$o")
  rps=$(awk '/Requests\/sec/ {print $2}' <<<"$o")
  mb=$(bytes "$(awk '/Transfer\/sec/ {print $2}' <<<"$o")")
  if grep -q "Non-2xx" <<<"$o"; then echo "$3 $2: non-2xx answers" >&2; exit 1; fi
  awk -v d=$((t1 - t0)) -v n="$n" -v c="$CLK" -v r="$1,$2,$3,$rps,$mb" -v b="$before" -v p="$peak" \
    'BEGIN{ printf "%s,%.2f,%s,%s\n", r, (n > 0 ? d / c * 1e6 / n : 0), b, p }' >>"$CSV"
}

for round in $(seq "$ROUNDS"); do
  for scenario in "php /hello.php $CONNS" "file4k /file4k.txt 64" "file100m /file100m.bin 4"; do
    read -r name path conns <<<"$scenario"
    measure "$round" "$name" nginx "$NGINX_PID" "$NGINX_PORT" "$path" "$conns"
    measure "$round" "$name" floodgate "$FLOODGATE_PID" "$FLOODGATE_PORT" "$path" "$conns"
  done
done

python3 - "$CSV" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
by = {}
for r in rows:
    by.setdefault((r["round"], r["scenario"]), {})[r["server"]] = r
print("| scenario | server | req/s median (min-max) | MB/s | CPU µs/request | peak RSS MB | floodgate/nginx req/s (paired) | floodgate/nginx CPU/req (paired) |")
print("|---|---|---|---|---|---|---|---|")
for scenario in dict.fromkeys(r["scenario"] for r in rows):
    pairs = [d for (_, s), d in by.items() if s == scenario and len(d) == 2]
    for server in ["nginx", "floodgate"]:
        rps = [float(d[server]["rps"]) for d in pairs]
        mb = statistics.median(float(d[server]["mb_per_s"]) for d in pairs)
        cpu = statistics.median(float(d[server]["cpu_us_per_req"]) for d in pairs)
        rss = max(int(d[server]["rss_peak_kb"]) for d in pairs) / 1024
        ratio = cpu_ratio = ""
        if server == "floodgate":
            r = [float(d["floodgate"]["rps"]) / float(d["nginx"]["rps"]) for d in pairs]
            c = [float(d["floodgate"]["cpu_us_per_req"]) / float(d["nginx"]["cpu_us_per_req"]) for d in pairs]
            ratio = f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"
            cpu_ratio = f"{statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f})"
        print(f"| {scenario} | {server} | {statistics.median(rps):.0f} ({min(rps):.0f}-{max(rps):.0f}) | {mb:.0f} | {cpu:.1f} | {rss:.1f} | {ratio} | {cpu_ratio} |")
PY
