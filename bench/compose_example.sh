#!/usr/bin/env bash
# Runs the compose example (examples/compose/) for real and checks what the header comment
# of its docker-compose.yml promises, printing each check (ok / FAIL) and exiting non-zero
# when one fails:
#   1. `up` (images built beforehand): every service runs, floodgate turns healthy (timed)
#   2. the header's curls: the PHP app's JSON on /, /style.css served by floodgate (PHP-FPM
#      never logs it), a PHP session counting up on one of php-a/php-b (cookie jar), the Go
#      app with an API key, /metrics on 127.0.0.1:9901 (published on loopback only), the
#      login lock-out (401 five times, then 429) and the admin DELETE lifting it for the
#      address floodgate sees (the compose network's gateway, for requests from this host);
#      limits kept in the example's Redis
#   3. `kill -s HUP floodgate` reloads (the log line, the reload counter)
#   4. the session's PHP container stopped: its session moves to the other one, no 502
#   5. with docker-compose.tls.yml: HTTPS on 443 (HTTP/2, the committed certificate), 8080
#      redirecting (308)
#   6. profile monitoring: Prometheus scrapes floodgate (target up), its rules load, a
#      query for a floodgate metric returns data. Grafana only when its image is there
#      (it is in no registry this script can use); without it, its provisioning files and
#      the dashboard are checked to parse (YAML, JSON) and Grafana is reported as not run
#   7. `down`: exits 0, removes everything; floodgate's exit code (SIGTERM, drained)
#   8. `config` of docker-compose.yml + docker-compose.acme.yml (never started: it needs a
#      public CA); with COMPOSE_SCHEMA, the three files against the Compose Specification
# Not part of CI (.ci/run does not call it): it needs root, a Docker engine, the network
# (apt mirror, crates.io) and the host ports 8080, 443, 127.0.0.1:9901 and 127.0.0.1:9090
# free. Usage, from the repository root:
#
#   bash bench/compose_example.sh
#
# Compose: `docker compose` (v2) when the client has it, with the files as they are. Else
# docker-compose 1.29 (Debian's, installed when missing), which refuses the top-level
# `name:` key (Compose Specification, v2 only): it gets a copy of docker-compose.yml
# without that line, `-p <that name>` instead, and `--project-directory examples/compose`
# so that every relative path resolves as in the original; the overlays are used as they
# are. Images: floodgate:local (the compose file's name for the top-level Dockerfile's
# image) and the Go app (go/Dockerfile) are built first with `docker build --network host`
# under the names compose looks for, and compose runs with --no-build. Base images are
# used when the engine has them or can pull them; otherwise stand-ins with the same names
# are made (bench/docker_bases.sh says how): debian:bookworm-slim, rust:1-slim-bookworm,
# redis:7-bookworm (Debian's Redis 7.0), php:8.2-fpm (Debian's PHP-FPM 8.2, laid out as
# the official image), golang:1-bookworm (Debian's Go 1.19),
# gcr.io/distroless/static-debian12:nonroot (Debian slim as uid 65532) and
# prom/prometheus:v3.7.3 (Debian's Prometheus 2.42, not 3.x).
# Knobs: NO_CACHE=1 (build floodgate:local cold, --no-cache), REF=<git revision> (build
# floodgate:local from that commit's tree, `git archive`, instead of the work tree), KEEP_UP=1 (leave the
# example running at the end instead of `down`; step 7 is then skipped),
# COMPOSE_SCHEMA=path/to/compose-spec.json (the schema from the compose-spec/compose-spec
# repository; needs python3-jsonschema), and bench/docker_bases.sh's ROOTFS, MIRROR.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/docker_bases.sh
source bench/docker_bases.sh

DIR=$PWD/examples/compose
TOKEN=compose-example-admin-token
PROJECT=$(sed -n 's/^name: *//p' "$DIR/docker-compose.yml")
PROJECT=${PROJECT:-compose}
WORK=$(mktemp -d /tmp/compose-example.XXXXXX)
trap 'cleanup_rootfs; rm -rf "$WORK"' EXIT

failures=()
pass() { printf '  ok    %s\n' "$*"; }
fail() { printf '  FAIL  %s\n' "$*"; failures+=("$*"); }
check() { # DESCRIPTION COMMAND...: runs COMMAND, ok when it succeeds
  local what=$1
  shift
  if "$@"; then pass "$what"; else fail "$what"; fi
}
# JSON field KEY (a dotted path) of the document on stdin, printed as text; nothing when
# the document is not JSON or has no such field.
field() {
  python3 -c 'import json, sys
try:
    value = json.load(sys.stdin)
    for part in sys.argv[1].split("."):
        value = value[int(part)] if isinstance(value, list) else value.get(part)
except (ValueError, LookupError, AttributeError):
    value = None
if value is not None:
    print(value if not isinstance(value, (dict, list, bool)) else json.dumps(value))' "$1"
}
status() { curl -s -o /dev/null -w '%{http_code}' "$@"; }

docker_engine docker-compose:docker-compose python3:python3
python3 -c 'import yaml' 2>/dev/null || { apt-get install -y python3-yaml >/dev/null; }
for port in 8080 443 9901 9090; do
  if ss -Hltn "sport = :$port" | grep -q .; then
    echo "port $port is in use on this host: the example publishes it" >&2
    exit 1
  fi
done

# ---- compose ----------------------------------------------------------------------------
if docker compose version >/dev/null 2>&1; then
  compose_cmd=(docker compose)
  main_file=$DIR/docker-compose.yml
  go_image=$PROJECT-go
else
  compose_cmd=(docker-compose -p "$PROJECT" --project-directory "$DIR")
  main_file=$WORK/docker-compose.yml
  sed '/^name: /d' "$DIR/docker-compose.yml" >"$main_file"
  go_image=${PROJECT}_go
fi
compose() { "${compose_cmd[@]}" "$@"; }
plain=(-f "$main_file")
tls=(-f "$main_file" -f "$DIR/docker-compose.tls.yml")
acme=(-f "$main_file" -f "$DIR/docker-compose.acme.yml")
step "compose: ${compose_cmd[*]} ($(compose version --short 2>/dev/null || compose version | head -n1))"
[ "$main_file" = "$DIR/docker-compose.yml" ] \
  || echo "docker-compose v1: $main_file is docker-compose.yml less its top-level 'name: $PROJECT' line (-p $PROJECT instead)"

# ---- images -----------------------------------------------------------------------------
step "base images (stand-ins where the engine has none and cannot pull)"
start=$(now)
for base in debian rust redis php golang distroless prometheus; do "base_$base"; done
cleanup_rootfs
echo "base images ready after $(since "$start") s"
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E \
  'debian:bookworm-slim|rust:1-slim|redis:7|php:8.2|golang:1|distroless|prometheus' || true

step "docker build floodgate:local ($([ "${NO_CACHE:-0}" = 1 ] && echo cold || echo "layer cache"))"
no_cache=()
[ "${NO_CACHE:-0}" = 1 ] && no_cache=(--no-cache)
context() { # the build context: the work tree, or REF's tree (git archive) when REF is set
  if [ -n "${REF:-}" ]; then git archive --format=tar "$REF"; fi
}
source_tree=${REF:+$(git rev-parse --short "$REF") ($REF)}
echo "source: ${source_tree:-the work tree}"
start=$(now)
if ! context | nice -n 10 docker build --network host "${no_cache[@]}" -t floodgate:local \
  "$([ -n "${REF:-}" ] && echo - || echo .)" >/tmp/compose-floodgate-build.log 2>&1; then
  tail -n 30 /tmp/compose-floodgate-build.log >&2
  echo "build failed: /tmp/compose-floodgate-build.log" >&2
  exit 1
fi
build_time=$(since "$start")
echo "floodgate:local: ${build_time} s, $(docker image ls --format '{{.Size}}' floodgate:local)"
start=$(now)
nice -n 10 docker build --network host -t "$go_image" "$DIR/go" >/tmp/compose-go-build.log 2>&1 \
  || { tail -n 30 /tmp/compose-go-build.log >&2; exit 1; }
echo "$go_image: $(since "$start") s, $(docker image ls --format '{{.Size}}' "$go_image")"

# ---- 1. up --------------------------------------------------------------------------------
compose "${plain[@]}" --profile monitoring down --remove-orphans >/dev/null 2>&1 || true
step "1. up"
container() { compose "${plain[@]}" ps -q "$1"; }
start=$(now)
compose "${plain[@]}" up -d --no-build
up_time=$(since "$start")
healthy=$(wait_healthy "$(container floodgate)" "$start") || healthy=never
echo "up -d returned after ${up_time} s; floodgate healthy ${healthy} s after up started"
check "floodgate healthy" test "$healthy" != never
for service in floodgate redis php-a php-b go; do
  state=$(docker inspect --format '{{.State.Status}}' "$(container "$service")" 2>/dev/null || echo missing)
  check "$service: $state" test "$state" = running
done
compose "${plain[@]}" ps
network=${PROJECT}_default
gateway=$(docker network inspect --format '{{(index .IPAM.Config 0).Gateway}}' "$network")
echo "network $network, gateway $gateway"

# ---- 2. the header comment's curls ----------------------------------------------------------------------
step "2. curl localhost:8080/ (the PHP app)"
curl -s -D "$WORK/index.h" localhost:8080/ >"$WORK/index.json"
head -n 12 "$WORK/index.json"
check "/: JSON from the PHP app" test "$(field app <"$WORK/index.json")" = php
client=$(field HTTP_X_REAL_IP <"$WORK/index.json")
check "/: X-Real-IP $client is the network's gateway (docker-proxy)" test "$client" = "$gateway"
check "/: no X-Powered-By (response_headers remove)" bash -c "! grep -qi '^x-powered-by:' '$WORK/index.h'"
check "/: X-Frame-Options SAMEORIGIN" grep -qi '^x-frame-options: SAMEORIGIN' "$WORK/index.h"
check "/: RateLimit headers" grep -qi '^ratelimit-policy:' "$WORK/index.h"

step "2. curl -sI localhost:8080/style.css (a static file)"
curl -sI localhost:8080/style.css | tee "$WORK/style.h"
check "/style.css: 200" grep -q '^HTTP/1.1 200' "$WORK/style.h"
check "/style.css: text/css" grep -qi '^content-type: text/css' "$WORK/style.h"
check "/style.css: the file's size" grep -qi "^content-length: $(stat -c %s "$DIR/php/style.css")" "$WORK/style.h"

step "2. curl -s -c jar -b jar localhost:8080/session.php (four times)"
jar=$WORK/jar
servers=() counts=()
for _ in 1 2 3 4; do
  curl -s -c "$jar" -b "$jar" localhost:8080/session.php >"$WORK/session.json"
  servers+=("$(field server <"$WORK/session.json")")
  counts+=("$(field n <"$WORK/session.json")")
  echo "  server ${servers[-1]}, n ${counts[-1]}"
done
session_server=${servers[3]}
check "session: requests 2-4 on one server ($session_server)" \
  test "${servers[1]}" = "$session_server" -a "${servers[2]}" = "$session_server"
check "session: n counts up (${counts[*]})" \
  test "${counts[3]}" -eq $((counts[1] + 2)) -a "${counts[2]}" -eq $((counts[1] + 1))
check "session: the server is php-a or php-b" bash -c "[[ $session_server == php-[ab] ]]"
# PHP-FPM logs every request it runs (docker.conf: access.log to stderr).
compose "${plain[@]}" logs --no-color php-a php-b >"$WORK/php.log" 2>&1
check "PHP-FPM logged session.php" grep -q 'session.php' "$WORK/php.log"
check "PHP-FPM never saw style.css (floodgate served it)" bash -c "! grep -q 'style.css' '$WORK/php.log'"

step "2. curl -s -H 'X-Api-Key: demo' localhost:8080/api/hello (the Go app)"
curl -s -H 'X-Api-Key: demo' localhost:8080/api/hello | tee "$WORK/go.json"
check "/api/hello: JSON from the Go app" test "$(field app <"$WORK/go.json")" = go
check "/api/hello: the API key arrived" test "$(field api_key_present <"$WORK/go.json")" = true
check "/api/hello: X-Real-IP $client" test "$(field x_real_ip <"$WORK/go.json")" = "$client"

step "2. curl -s localhost:9901/metrics"
curl -s localhost:9901/metrics >"$WORK/metrics"
grep -E '^floodgate_(requests_total|upstream_server_up)' "$WORK/metrics" | head -n 8
check "/metrics: floodgate's metrics" grep -q '^floodgate_requests_total' "$WORK/metrics"
check "/metrics: both PHP servers up" test "$(grep -c '^floodgate_upstream_server_up{.*php-[ab]:9000.*} 1' "$WORK/metrics")" = 2
published=$(docker port "$(container floodgate)" 9901/tcp)
check "9901 published on the host's loopback only ($published)" test "$published" = 127.0.0.1:9901
keys=$(docker exec "$(container redis)" redis-cli dbsize)
check "the limits' keys are in the example's Redis ($keys)" test "$keys" -gt 0

step "2. the login lock-out: curl -s -d 'user=demo&password=wrong' localhost:8080/login.php"
codes=()
for _ in 1 2 3 4 5 6 7; do
  codes+=("$(status -d 'user=demo&password=wrong' localhost:8080/login.php)")
done
echo "  ${codes[*]}"
check "login: 401 five times, then 429" test "${codes[*]}" = "401 401 401 401 401 429 429"
retry=$(curl -s -o /dev/null -D - -d 'user=demo&password=floodgate-demo' localhost:8080/login.php \
  | tee "$WORK/locked.h" | sed -n 's/^retry-after: *\([0-9]*\).*/\1/Ip')
check "login: the right password refused too, Retry-After ${retry:-none} (about an hour)" \
  bash -c "grep -q '^HTTP/1.1 429' '$WORK/locked.h' && [ '${retry:-0}' -gt 3500 ]"
url="localhost:9901/limits/login_failures/state?client_ip=$client"
curl -s -H "Authorization: Bearer $TOKEN" "$url" | tee "$WORK/state.json"
echo
locked=$(field locked_seconds <"$WORK/state.json")
check "state API: $client locked for ${locked}s" test "$locked" -gt 3500
[ "$client" = 172.18.0.1 ] || echo "  note: the header comment's example address is 172.18.0.1; here it is $client"
deleted=$(status -X DELETE -H "Authorization: Bearer $TOKEN" "$url")
check "DELETE $url: $deleted" bash -c "[[ $deleted == 20? ]]"
check "login: the right password now 200" \
  test "$(status -d 'user=demo&password=floodgate-demo' localhost:8080/login.php)" = 200
check "state API without the token: 401" test "$(status "$url")" = 401

# ---- 3. reload ----------------------------------------------------------------------------
step "3. kill -s HUP floodgate"
compose "${plain[@]}" kill -s HUP floodgate
reloaded=
for _ in $(seq 50); do
  reloaded=$(docker logs "$(container floodgate)" 2>&1 | grep 'configuration reloaded' || true)
  [ -n "$reloaded" ] && break
  sleep 0.1
done
echo "  ${reloaded:-no reload logged}"
check "HUP: 'configuration reloaded' logged" test -n "$reloaded"
reloads=$(curl -s localhost:9901/metrics | sed -n 's/^floodgate_config_reloads_total{result="ok"} //p')
check "HUP: floodgate_config_reloads_total{result=\"ok\"} ${reloads:-none}" test "${reloads:-0}" -ge 1
check "HUP: floodgate still running" test "$(docker inspect --format '{{.State.Status}}' "$(container floodgate)")" = running

# ---- 4. one PHP container stopped -----------------------------------------------------------
other=php-a
[ "$session_server" = php-a ] && other=php-b
step "4. stop $session_server (the session's server)"
compose "${plain[@]}" stop "$session_server"
codes=() servers=() counts=()
for _ in 1 2 3 4 5 6; do
  codes+=("$(curl -s -o "$WORK/session.json" -w '%{http_code}' -c "$jar" -b "$jar" localhost:8080/session.php)")
  servers+=("$(field server <"$WORK/session.json")")
  counts+=("$(field n <"$WORK/session.json")")
done
echo "  statuses ${codes[*]}; servers ${servers[*]}; n ${counts[*]}"
check "no 502: every request 200" test "${codes[*]}" = "200 200 200 200 200 200"
check "the session moved to $other" test "${servers[*]}" = "$other $other $other $other $other $other"
check "and counts up there" test "${counts[5]}" -eq $((counts[0] + 5))
compose "${plain[@]}" start "$session_server"

# ---- 5. HTTPS ---------------------------------------------------------------------------
step "5. -f docker-compose.yml -f docker-compose.tls.yml up"
start=$(now)
compose "${tls[@]}" up -d --no-build
container() { compose "${tls[@]}" ps -q "$1"; }
healthy_tls=$(wait_healthy "$(container floodgate)" "$start") || healthy_tls=never
echo "floodgate (HTTPS) healthy ${healthy_tls} s after up started"
check "floodgate (HTTPS) healthy" test "$healthy_tls" != never
curl -si localhost:8080/session.php | head -n 2 | tee "$WORK/redirect.h"
check "8080: 308 to https://localhost/session.php" bash -c \
  "grep -q '^HTTP/1.1 308' '$WORK/redirect.h' && grep -qi '^location: https://localhost/session.php' '$WORK/redirect.h'"
version=$(curl -s --cacert "$DIR/tls/site.crt" -o "$WORK/tls.json" -w '%{http_version}' https://localhost/)
check "https://localhost/ (--cacert tls/site.crt): the PHP app over HTTP/$version" \
  test "$(field app <"$WORK/tls.json")/$version" = php/2
check "PHP sees X-Forwarded-Proto https" test "$(field headers.HTTP_X_FORWARDED_PROTO <"$WORK/tls.json")" = https
curl -sk -H 'X-Api-Key: demo' https://localhost/api/hello >"$WORK/tls-go.json"
check "curl -k https://localhost/api/hello: the Go app" test "$(field app <"$WORK/tls-go.json")" = go
check "curl -k https://localhost/style.css: 200" test "$(status -k https://localhost/style.css)" = 200
check "curl -k https://localhost/session.php: 200" test "$(status -k https://localhost/session.php)" = 200
check "/metrics: floodgate_tls_certificate_expiry_timestamp_seconds" bash -c \
  "curl -s localhost:9901/metrics | grep -q '^floodgate_tls_certificate_expiry_timestamp_seconds'"

# ---- 6. monitoring ------------------------------------------------------------------------
step "6. --profile monitoring up (plain configuration again)"
container() { compose "${plain[@]}" ps -q "$1"; }
monitoring=(prometheus)
if have grafana/grafana:12.2.1; then monitoring+=(grafana); fi
start=$(now)
compose "${plain[@]}" --profile monitoring up -d --no-build "${monitoring[@]}"
wait_healthy "$(container floodgate)" "$start" >/dev/null || fail "floodgate healthy again"
# A new floodgate (the plain configuration again): a request, so that its request
# counter has a series for Prometheus to scrape.
check "floodgate answers again: 200" test "$(status localhost:8080/)" = 200
prometheus_version=$(curl -s --retry 10 --retry-connrefused --retry-delay 1 \
  localhost:9090/api/v1/status/buildinfo | field data.version || echo unknown)
echo "Prometheus $prometheus_version (the example names prom/prometheus:v3.7.3)"
target=
for _ in $(seq 60); do
  target=$(curl -s localhost:9090/api/v1/targets | field data.activeTargets.0)
  [[ $target == *'"health": "up"'* ]] && break
  sleep 1
done
echo "  $target" | cut -c1-300
check "Prometheus: target floodgate:9901 up" bash -c "[[ '$target' == *'\"health\": \"up\"'* && '$target' == *floodgate:9901* ]]"
curl -s localhost:9090/api/v1/rules >"$WORK/rules.json"
rules=$(python3 -c 'import json, sys
groups = json.load(sys.stdin)["data"]["groups"]
rules = [r for g in groups for r in g["rules"]]
bad = [r["name"] for r in rules if r.get("health") == "err"]
print(len(groups), len(rules), len(bad), " ".join(bad))' <"$WORK/rules.json")
read -r groups nrules nbad bad <<<"$rules"
echo "  $groups rule groups, $nrules rules, $nbad in error ${bad:-}"
check "Prometheus: the rules load ($nrules rules, none in error)" test "$nrules" -gt 0 -a "$nbad" = 0
result=
for _ in $(seq 60); do
  result=$(curl -s -G localhost:9090/api/v1/query --data-urlencode 'query=floodgate_requests_total' \
    | field data.result.0)
  [ -n "$result" ] && break
  sleep 1
done
echo "  $result" | cut -c1-300
check "Prometheus: floodgate_requests_total has data" bash -c "[[ '$result' == *floodgate_requests_total* ]]"
if [[ " ${monitoring[*]} " == *" grafana "* ]]; then
  check "Grafana: health" bash -c "curl -s --retry 30 --retry-connrefused --retry-delay 1 localhost:3000/api/health | grep -q ok"
else
  echo "  Grafana NOT run: no grafana/grafana:12.2.1 image here and none can be pulled or made"
  check "Grafana provisioning: YAML parses" python3 -c 'import sys, yaml
for f in sys.argv[1:]: yaml.safe_load(open(f))' monitoring/grafana/provisioning/*/*.yml
  check "Grafana dashboard: JSON parses" python3 -c 'import json, sys; json.load(open(sys.argv[1]))' \
    monitoring/grafana/floodgate.json
fi

# ---- 7. down ------------------------------------------------------------------------------
if [ "${KEEP_UP:-0}" = 1 ]; then
  step "7. skipped (KEEP_UP=1): the example stays up"
else
  step "7. down"
  id=$(container floodgate)
  docker wait "$id" >"$WORK/exit" &
  waiter=$!
  start=$(now)
  down_rc=0
  compose "${plain[@]}" --profile monitoring down || down_rc=$?
  down_time=$(since "$start")
  wait "$waiter" || true
  exit_code=$(cat "$WORK/exit")
  echo "down: rc $down_rc after ${down_time} s; floodgate exited with $exit_code"
  check "down: exit status 0" test "$down_rc" = 0
  check "floodgate's exit code 0" test "$exit_code" = 0
  left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
  check "down: no container left ($left)" test "$left" = 0
  check "down: network $network removed" bash -c "! docker network inspect '$network' >/dev/null 2>&1"
fi

# ---- 8. ACME: config only ---------------------------------------------------------------------
step "8. -f docker-compose.yml -f docker-compose.acme.yml config"
check "acme: config is valid" bash -c "$(printf '%q ' "${compose_cmd[@]}" "${acme[@]}") config >'$WORK/acme.yml'"
check "acme: floodgate mounts gateway.acme.toml" grep -q 'gateway.acme.toml' "$WORK/acme.yml"
if [ -n "${COMPOSE_SCHEMA:-}" ]; then
  for file in docker-compose.yml docker-compose.tls.yml docker-compose.acme.yml; do
    check "$file: valid against $(basename "$COMPOSE_SCHEMA")" python3 -c 'import json, sys, yaml, jsonschema
schema = json.load(open(sys.argv[1]))
jsonschema.validators.validator_for(schema)(schema).validate(yaml.safe_load(open(sys.argv[2])))' \
      "$COMPOSE_SCHEMA" "$DIR/$file" 2>/dev/null
  done
fi

step "summary"
echo "floodgate:local build ${build_time} s; up -d ${up_time} s, healthy after ${healthy} s;" \
  "HTTPS variant healthy after ${healthy_tls} s; client address $client; Prometheus $prometheus_version;" \
  "$([ "${KEEP_UP:-0}" = 1 ] && echo "left up" || echo "down rc $down_rc in ${down_time} s, floodgate exit $exit_code")"
if [ "${#failures[@]}" -gt 0 ]; then
  printf 'FAILED: %s\n' "${failures[@]}"
  exit 1
fi
echo "all checks passed"
