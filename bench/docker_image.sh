#!/usr/bin/env bash
# Builds the container image for real and checks it running: the cold build time, the
# image size, the time to healthy, a request through the published port (RateLimit
# headers), the uid, /metrics through the published admin port, docs/operations.md "Mount a
# configuration" steps as written, and `docker stop`'s exit code. Not part of CI (.ci/run
# does not call it): it needs root, a Docker engine and the network. Usage, from the
# repository root:
#
#   bash bench/docker_image.sh
#
# Base images: used when the engine has them or can pull them; otherwise made here, as
# stand-ins with the same names (for machines that cannot reach Docker Hub), by
# bench/docker_bases.sh (which says how):
#   debian:bookworm-slim   debootstrap --variant=minbase bookworm, from the apt mirror this
#                          machine uses (MIRROR)
#   rust:1-slim-bookworm   the same plus gcc, libc6-dev, ca-certificates, this machine's
#                          extra CA certificates and cargo config, and its active rustup
#                          toolchain in /usr/local/{cargo,rustup} as in the official image
# It starts dockerd (vfs storage, no iptables: published ports go through docker-proxy)
# when no engine answers, and installs docker.io and debootstrap with apt-get when they
# are missing. Knobs: TAG (floodgate:0.1.0), ROOTFS (/tmp/floodgate-rootfs, removed
# afterwards unless KEEP_ROOTFS=1), HTTP_PORT (18080), ADMIN_PORT (19901), CACHE=1 to
# build with the layer cache (default: --no-cache, a cold build).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${TAG:-floodgate:0.1.0}
HTTP_PORT=${HTTP_PORT:-18080}
ADMIN_PORT=${ADMIN_PORT:-19901}
NAME=floodgate-bench
# shellcheck source=bench/docker_bases.sh
source bench/docker_bases.sh

docker_engine # no extra tools

# ---- base images ------------------------------------------------------------------------
trap cleanup_rootfs EXIT
base_debian
base_rust
cleanup_rootfs

# ---- build --------------------------------------------------------------------------------
step "docker build ($([ "${CACHE:-0}" = 1 ] && echo "layer cache" || echo "cold: --no-cache"))"
no_cache=(--no-cache)
[ "${CACHE:-0}" = 1 ] && no_cache=()
start=$(now)
docker build --network host "${no_cache[@]}" -t "$TAG" . 2>&1 | tee /tmp/floodgate-docker-build.log \
  | grep -E '^Step |Compiling floodgate|Finished|floodgate [0-9]|^Successfully|^ERROR|error' || true
[ "${PIPESTATUS[0]}" = 0 ] || { echo "build failed: /tmp/floodgate-docker-build.log" >&2; exit 1; }
build_time=$(since "$start")
echo "build: ${build_time} s"
docker image ls "$TAG"
size=$(docker image ls --format '{{.Size}}' "$TAG")

# ---- run ----------------------------------------------------------------------------------
seconds() { date -d "${1% UTC}" +%s.%N; } # Docker prints "... +0000 UTC" or RFC 3339
docker rm -f "$NAME" >/dev/null 2>&1 || true
step "docker run -d -p $HTTP_PORT:8080 -p $ADMIN_PORT:9901 $TAG"
start=$(now)
docker run -d --name "$NAME" -p "$HTTP_PORT:8080" -p "$ADMIN_PORT:9901" "$TAG" >/dev/null
run_time=$(since "$start")
healthy=$(wait_healthy "$NAME" "$start")
started=$(seconds "$(docker inspect --format '{{.State.StartedAt}}' "$NAME")")
probe=$(seconds "$(docker inspect --format '{{(index .State.Health.Log 0).End}}' "$NAME")")
first_probe=$(awk -v a="$started" -v b="$probe" 'BEGIN { printf "%.1f", b - a }')
echo "docker run returned after ${run_time} s; healthy after ${healthy} s" \
  "(the first probe, which Docker runs --interval after the start, passed ${first_probe} s after it)"
curl -si "localhost:$HTTP_PORT/" | tee /tmp/floodgate-docker-response.txt | head -n 12
grep -qi '^ratelimit-policy:' /tmp/floodgate-docker-response.txt
grep -qi '^ratelimit:' /tmp/floodgate-docker-response.txt
uid=$(docker exec "$NAME" sh -c 'grep ^Uid: /proc/1/status' | awk '{ print $2 }')
echo "PID 1 runs as uid $uid ($(docker inspect --format '{{.Config.User}}' "$NAME"))"
[ "$uid" = 10001 ]
curl -sf "localhost:$ADMIN_PORT/metrics" | grep -m3 '^floodgate_'
start=$(now)
docker stop "$NAME" >/dev/null
stop_time=$(since "$start")
exit_code=$(docker inspect --format '{{.State.ExitCode}}' "$NAME")
echo "docker stop: ${stop_time} s, exit code $exit_code"
docker logs "$NAME" 2>&1 | tail -n 3
docker rm "$NAME" >/dev/null

# ---- docs/operations.md "Mount a configuration", as written ----------------------------------------------
step "docs/operations.md: Mount a configuration"
conf_dir=$(mktemp -d)
(
  cd "$conf_dir"
  set -x
  mkdir conf && docker run --rm --entrypoint cat "$TAG" /etc/floodgate/gateway.toml > conf/gateway.toml
  docker run --rm -v "$PWD/conf:/etc/floodgate:ro" "$TAG" check
  docker run -d --name floodgate -p 8080:8080 -p 127.0.0.1:9901:9901 \
    -v "$PWD/conf:/etc/floodgate:ro" "$TAG"
)
wait_healthy floodgate "$(now)" >/dev/null
metrics=$(curl -s -o /dev/null -w '%{http_code}' localhost:9901/metrics || true)
echo "curl localhost:9901/metrics: $metrics"
docker rm -f floodgate >/dev/null
# The step it replaces, `cp gateway.toml conf/`: the shipped file's admin_listen is
# 127.0.0.1, the container's own loopback, so the published port answers nothing while
# the health check (which probes inside the container) says healthy.
cp gateway.toml "$conf_dir/conf/gateway.toml"
docker run -d --name floodgate -p 8080:8080 -p 127.0.0.1:9901:9901 \
  -v "$conf_dir/conf:/etc/floodgate:ro" "$TAG" >/dev/null
wait_healthy floodgate "$(now)" >/dev/null
old_metrics=$(curl -s -o /dev/null -w '%{http_code}' localhost:9901/metrics || true)
echo "with the shipped gateway.toml instead: healthy, curl localhost:9901/metrics: $old_metrics"
docker rm -f floodgate >/dev/null
rm -rf "$conf_dir"
[ "$metrics" = 200 ]

step "summary"
base=$(docker image ls --format '{{.Size}}' debian:bookworm-slim)
echo "$([ "${CACHE:-0}" = 1 ] && echo "build (layer cache)" || echo "cold build"): ${build_time} s; image $TAG: $size (base debian:bookworm-slim: $base);" \
  "healthy after ${healthy} s (first probe passed ${first_probe} s after the start);" \
  "docker stop: ${stop_time} s, exit code $exit_code; uid $uid;" \
  "documented mount path /metrics: $metrics (shipped file: $old_metrics)"
