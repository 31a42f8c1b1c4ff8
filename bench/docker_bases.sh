# shellcheck shell=bash
# Sourced by bench/docker_image.sh and bench/compose_example.sh (not run on its own): a
# Docker engine for them, and the base images they need, used when the engine has them or
# can pull them, otherwise made here as stand-ins with the same names (for machines that
# cannot reach Docker Hub). Each base_* function makes one image:
#   debian:bookworm-slim   debootstrap --variant=minbase bookworm, from the apt mirror this
#                          machine uses (MIRROR), slimmed as the official image is
#   rust:1-slim-bookworm   the same plus gcc, libc6-dev, ca-certificates, this machine's
#                          extra CA certificates (/usr/local/share/ca-certificates) and
#                          cargo config, and its active rustup toolchain (without its docs)
#                          in /usr/local/{cargo,rustup} as in the official image
#   redis:7-bookworm       Debian's redis-server (7.0) and redis-cli; CMD redis-server
#   php:8.2-fpm            Debian's php8.2-fpm laid out as the official image: `php-fpm`
#                          in PATH as CMD, /usr/local/etc/php-fpm.conf including
#                          /usr/local/etc/php-fpm.d/*.conf, whose docker.conf and
#                          zz-docker.conf say what the official ones say (errors to stderr,
#                          daemonize = no, listen = 9000, pool www as www-data);
#                          WORKDIR /var/www/html
#   golang:1-bookworm      Debian's golang-go (Go 1.19) with git and ca-certificates
#   gcr.io/distroless/static-debian12:nonroot
#                          debian:bookworm-slim with USER 65532:65532 and an /etc/passwd
#                          entry "nonroot" for it (distroless has no shell; this one does)
#   prom/prometheus:v3.7.3 Debian's prometheus package (2.42, not 3.x) as the official
#                          image runs it: ENTRYPOINT /bin/prometheus (merged /usr: Debian's
#                          /usr/bin/prometheus), user nobody, /prometheus owned by it
# Knobs: ROOTFS (/tmp/floodgate-rootfs, removed by cleanup_rootfs unless KEEP_ROOTFS=1),
# MIRROR (the bookworm mirror of this machine's apt sources).

ROOTFS=${ROOTFS:-/tmp/floodgate-rootfs}
MIRROR=${MIRROR:-$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
  2>/dev/null | sed -n 's/^URIs: *//p; s/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\) bookworm .*/\2/p' \
  | grep -v security | head -n1 || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

step() { printf '\n== %s\n' "$*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
wait_healthy() { # CONTAINER START: prints the seconds from START to its health check passing
  for _ in $(seq 900); do
    case $(docker inspect --format '{{.State.Health.Status}}' "$1") in
      healthy) since "$2"; return 0 ;;
      unhealthy) docker logs --tail 20 "$1" >&2; return 1 ;;
    esac
    sleep 0.1
  done
  return 1
}

# Root, the tools (apt-get install of the missing ones: the packages named as arguments
# "command:package"), and an engine: dockerd with vfs storage and no iptables (published
# ports go through docker-proxy) when none answers. vfs copies every layer whole: the stand-ins
# and a few builds of the images fill tens of GB of /var/lib/docker (`docker system prune -af`).
# shellcheck disable=SC2120 # the extra tools are optional
docker_engine() {
  [ "$(id -u)" = 0 ] || { echo "run as root (debootstrap, chroot, dockerd)" >&2; exit 1; }
  local missing=() spec
  for spec in docker:docker.io debootstrap:debootstrap curl:curl "$@"; do
    command -v "${spec%%:*}" >/dev/null || missing+=("${spec#*:}")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
  fi
  if ! docker info >/dev/null 2>&1; then
    step "starting dockerd (log: /tmp/dockerd.log)"
    dockerd --storage-driver=vfs --iptables=false >/tmp/dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null
  fi
  docker version --format 'engine {{.Server.Version}}, client {{.Client.Version}}'
}

have() { docker image inspect "$1" >/dev/null 2>&1 || timeout 120 docker pull "$1" >/dev/null 2>&1; }
cleanup_rootfs() { [ "${KEEP_ROOTFS:-0}" = 1 ] || rm -rf "$ROOTFS"; }

debian_rootfs() {
  if [ ! -x "$ROOTFS/debian/usr/bin/apt-get" ]; then
    rm -rf "$ROOTFS/debian"
    mkdir -p "$ROOTFS"
    debootstrap --variant=minbase bookworm "$ROOTFS/debian" "$MIRROR" >"$ROOTFS/debootstrap.log"
    slim "$ROOTFS/debian"
  fi
}

# What the official image adds to a minbase Debian (debuerreotype's slim variant and its
# apt settings): no documentation, manual pages or translations, and apt leaves no package
# files or caches behind in the layer that installs them (without this, the runtime
# stage's `apt-get install ca-certificates` layer is 90 MB instead of a few).
slim() {
  cat >"$1/etc/dpkg/dpkg.cfg.d/docker" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
CFG
  cat >"$1/etc/apt/apt.conf.d/docker-clean" <<'CFG'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
CFG
  echo 'Acquire::Languages "none";' >"$1/etc/apt/apt.conf.d/docker-no-languages"
  find "$1/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  rm -rf "$1"/usr/share/{groff,info,linda,locale,man}/* "$1"/var/lib/apt/lists/* \
    "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb "$1"/var/log/*.log
}

base_debian() {
  have debian:bookworm-slim && return 0
  step "debian:bookworm-slim: debootstrap from $MIRROR"
  debian_rootfs
  tar -C "$ROOTFS/debian" -c . | docker import --change 'CMD ["bash"]' - debian:bookworm-slim
}

base_rust() {
  have rust:1-slim-bookworm && return 0
  step "rust:1-slim-bookworm: Debian + gcc + this machine's rustup toolchain"
  debian_rootfs
  local root=$ROOTFS/rust sysroot toolchain cargo_home config tool
  rm -rf "$root"
  cp -a "$ROOTFS/debian" "$root"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  # The CA certificates this machine trusts besides the system ones (a proxy's, a private
  # registry's), so that cargo in the image reaches the registry as it does here.
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp -a /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
  chroot "$root" apt-get update -q
  chroot "$root" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends gcc libc6-dev ca-certificates >/dev/null
  chroot "$root" update-ca-certificates
  chroot "$root" sh -c 'apt-get clean && rm -rf /var/lib/apt/lists/*'
  # The toolchain: rustup (the cargo, rustc, ... proxies) and the active toolchain.
  sysroot=$(rustc --print sysroot)
  toolchain=$(basename "$sysroot")
  mkdir -p "$root/usr/local/cargo/bin" "$root/usr/local/rustup/toolchains"
  cp "$(command -v rustup)" "$root/usr/local/cargo/bin/rustup"
  for tool in cargo rustc rustdoc cargo-clippy clippy-driver rustfmt cargo-fmt; do
    ln -s rustup "$root/usr/local/cargo/bin/$tool"
  done
  tar -C "$sysroot" --exclude=./share/doc -c . | (mkdir "$root/usr/local/rustup/toolchains/$toolchain" \
    && tar -C "$root/usr/local/rustup/toolchains/$toolchain" -x)
  printf 'version = "12"\ndefault_toolchain = "%s"\nprofile = "minimal"\nauto_self_update = "disable"\n' \
    "$toolchain" >"$root/usr/local/rustup/settings.toml"
  cargo_home=${CARGO_HOME:-$HOME/.cargo}
  for config in config.toml config; do
    if [ -f "$cargo_home/$config" ]; then cp "$cargo_home/$config" "$root/usr/local/cargo/$config"; fi
  done
  chmod -R a+rwX "$root/usr/local/cargo" "$root/usr/local/rustup"
  rm -f "$root/etc/resolv.conf"
  tar -C "$root" -c . | docker import \
    --change 'ENV RUSTUP_HOME=/usr/local/rustup' \
    --change 'ENV CARGO_HOME=/usr/local/cargo' \
    --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' \
    - rust:1-slim-bookworm
  docker run --rm rust:1-slim-bookworm cargo --version
}

# A stand-in built FROM debian:bookworm-slim with the Dockerfile on stdin: TAG.
build_base() {
  local tag=$1 log
  log=/tmp/stand-in-$(printf '%s' "$tag" | tr -c 'A-Za-z0-9.-' _).log
  nice -n 10 docker build --network host -t "$tag" - >"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; echo "building $tag failed: $log" >&2; return 1; }
}

# The official image's redis-server is built with protected mode off (its Dockerfile
# patches the default), so a redis-server with no password and no config file, as the
# example runs it, answers clients on other hosts; Debian's keeps it on. The entrypoint
# adds "--protected-mode no" to a redis-server command, and drops root for user redis.
base_redis() {
  have redis:7-bookworm && return 0
  base_debian
  step "redis:7-bookworm: Debian's redis-server"
  build_base redis:7-bookworm <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* && install -d -o redis -g redis /data \
 && printf '%s\n' '#!/bin/sh' 'set -e' \
      'if [ "$1" = redis-server ]; then set -- "$@" --protected-mode no; fi' \
      'if [ "$1" = redis-server ] && [ "$(id -u)" = 0 ]; then' \
      '  exec setpriv --reuid=redis --regid=redis --init-groups "$@"' 'fi' \
      'exec "$@"' > /usr/local/bin/docker-entrypoint.sh \
 && chmod 755 /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
DOCKERFILE
}

# The official image (docker-library/php, 8.2/bookworm/fpm/Dockerfile) builds PHP into
# /usr/local: `php-fpm` reads /usr/local/etc/php-fpm.conf, which includes
# /usr/local/etc/php-fpm.d/*.conf: www.conf (the default pool, as www-data), docker.conf
# (error_log = /proc/self/fd/2, access.log to stderr, clear_env = no,
# catch_workers_output, decorate_workers_output = no) and zz-docker.conf (daemonize = no,
# [www] listen = 9000); no php.ini, so sessions are files in /tmp; WORKDIR /var/www/html;
# STOPSIGNAL SIGQUIT; CMD php-fpm. Here Debian's php-fpm8.2 reads that file in place of
# its own /etc/php/8.2/fpm/php-fpm.conf, and a conf.d file sets what the official image
# has and Debian's php.ini does not (session.save_path, docker-fpm.ini's
# fastcgi.logging = Off).
base_php() {
  have php:8.2-fpm && return 0
  base_debian
  step "php:8.2-fpm: Debian's php8.2-fpm, laid out as the official image"
  build_base php:8.2-fpm <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends php8.2-fpm \
 && rm -rf /var/lib/apt/lists/* \
 && install -d /usr/local/etc/php-fpm.d /var/www/html \
 && chown www-data:www-data /var/www/html \
 && ln -s /usr/sbin/php-fpm8.2 /usr/local/sbin/php-fpm \
 && printf '%s\n' '[global]' 'include=/usr/local/etc/php-fpm.d/*.conf' > /usr/local/etc/php-fpm.conf \
 && ln -sf /usr/local/etc/php-fpm.conf /etc/php/8.2/fpm/php-fpm.conf \
 && sed -e 's/^listen = .*/listen = 127.0.0.1:9000/' /etc/php/8.2/fpm/pool.d/www.conf \
      > /usr/local/etc/php-fpm.d/www.conf \
 && printf '%s\n' '[global]' 'error_log = /proc/self/fd/2' 'log_limit = 8192' '' '[www]' \
      'access.log = /proc/self/fd/2' 'clear_env = no' 'catch_workers_output = yes' \
      'decorate_workers_output = no' > /usr/local/etc/php-fpm.d/docker.conf \
 && printf '%s\n' '[global]' 'daemonize = no' '' '[www]' 'listen = 9000' \
      > /usr/local/etc/php-fpm.d/zz-docker.conf \
 && printf '%s\n' 'fastcgi.logging = Off' 'session.save_path = /tmp' \
      > /etc/php/8.2/fpm/conf.d/99-docker.ini \
 && php-fpm -t
WORKDIR /var/www/html
STOPSIGNAL SIGQUIT
EXPOSE 9000
CMD ["php-fpm"]
DOCKERFILE
}

base_golang() {
  have golang:1-bookworm && return 0
  base_debian
  step "golang:1-bookworm: Debian's golang-go"
  build_base golang:1-bookworm <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends golang-go git ca-certificates \
 && rm -rf /var/lib/apt/lists/*
ENV GOPATH=/go PATH=/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /go
DOCKERFILE
}

base_distroless() {
  have gcr.io/distroless/static-debian12:nonroot && return 0
  base_debian
  step "gcr.io/distroless/static-debian12:nonroot: debian slim as uid 65532"
  build_base gcr.io/distroless/static-debian12:nonroot <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN groupadd --gid 65532 nonroot \
 && useradd --uid 65532 --gid 65532 --home-dir /home/nonroot --create-home --shell /sbin/nologin nonroot
USER 65532:65532
WORKDIR /home/nonroot
DOCKERFILE
}

base_prometheus() {
  have prom/prometheus:v3.7.3 && return 0
  base_debian
  step "prom/prometheus:v3.7.3: Debian's prometheus (2.x)"
  build_base prom/prometheus:v3.7.3 <<'DOCKERFILE'
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o nobody -g nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
DOCKERFILE
}
