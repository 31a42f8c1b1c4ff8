# floodgate container image.
#
#   docker build -t floodgate .
#   docker run --rm -p 8080:8080 -p 9901:9901 floodgate
#   docker run --rm -p 8080:8080 -p 9901:9901 -v "$PWD/conf:/etc/floodgate:ro" floodgate
#                                     (a directory holding your gateway.toml)
#
# Two stages: a Rust builder (dependencies compiled in their own cached layer) and a
# Debian slim runtime holding the binary, CA certificates (for rediss://) and the config.
# tests/dockerfile.rs checks the properties this file promises.

ARG RUST_VERSION=1

# ---- builder -------------------------------------------------------------------------
FROM rust:${RUST_VERSION}-slim-bookworm AS builder
WORKDIR /build
ENV CARGO_PROFILE_RELEASE_STRIP=symbols

# The image builds one target, the floodgate binary, and the build context holds src/ but
# not benches/, examples/ or tests/ (.dockerignore). Cargo refuses a manifest that declares
# a target whose file is missing ("can't find `request_path` bench"), so both builds use
# Cargo.toml less its target tables ([lib], [[bin]], [[bench]], [[example]], [[test]]; the
# awk line): cargo then finds the library and the binary where it looks by default,
# src/lib.rs and src/main.rs. The rest (package, dependencies, features, profiles) is the
# manifest as it is, so Cargo.lock applies (--locked), the dependencies compile as for the
# real manifest, and no target added to Cargo.toml can break this build. (A stand-in file
# per declared target would have to follow every target added; BuildKit cache mounts are
# rejected by the legacy builder that a Docker CLI without buildx falls back to.)
# tests/dockerfile.rs replays this stage and has cargo read the manifest with the files
# the stage has at each cargo build.
#
# Dependencies first: with only the manifest and the lock file, build stand-ins for
# src/main.rs and src/lib.rs, so that this layer (every dependency, compiled) is reused
# until Cargo.toml or Cargo.lock change.
COPY Cargo.toml Cargo.lock ./
RUN awk '/^\[/ { target = /^\[\[?(lib|bin|bench|example|test)\]/ } !target' Cargo.toml > Cargo.toml.new \
 && mv Cargo.toml.new Cargo.toml \
 && mkdir src \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && cargo build --release --locked --bin floodgate \
 && rm -r src

# The crate itself. Touch the roots so that cargo rebuilds over the stand-ins whatever the
# copied files' timestamps are.
COPY src ./src
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked --bin floodgate \
 && ./target/release/floodgate --version

# The shipped gateway.toml, for a container: the admin listener must be reachable from
# outside the container (port mapping, Prometheus, compose health), so it binds 0.0.0.0
# instead of the file's 127.0.0.1; everything else is the shipped file as is. The build
# fails if the substitution no longer applies or the result does not validate.
COPY gateway.toml ./gateway.toml
RUN sed -i 's/^admin_listen = "127\.0\.0\.1:9901"/admin_listen = "0.0.0.0:9901"/' gateway.toml \
 && grep -q '^admin_listen = "0\.0\.0\.0:9901"' gateway.toml \
 && grep -q '^listen = "0\.0\.0\.0:8080"' gateway.toml \
 && ./target/release/floodgate check --config gateway.toml

# ---- runtime -------------------------------------------------------------------------
FROM debian:bookworm-slim AS runtime

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="floodgate" \
      org.opencontainers.image.description="A rate-limiting HTTP reverse proxy (Redis or in-process limits) for apps that cannot protect themselves" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.base.name="docker.io/library/debian:bookworm-slim"

# ca-certificates: rediss:// and ACME CAs are checked against the system roots.
# /var/lib/floodgate: the user's own directory, for [server.tls.acme]'s storage (mount a
# volume there so that certificates outlive the container).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 floodgate \
 && useradd --system --uid 10001 --gid floodgate --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin floodgate \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/floodgate

COPY --from=builder /build/target/release/floodgate /usr/local/bin/floodgate
COPY --from=builder /build/gateway.toml /etc/floodgate/gateway.toml

# Every floodgate command (the gateway, `check`, `healthcheck`) reads this file; mount
# another one over it, or point FLOODGATE_CONFIG elsewhere (the health check follows).
ENV FLOODGATE_CONFIG=/etc/floodgate/gateway.toml

# Numeric, so that runAsNonRoot-style checks can verify it without /etc/passwd.
USER 10001:10001

# The binary runs on this base and the config validates here too.
RUN ["floodgate", "check"]

EXPOSE 8080 9901

# floodgate drains in-flight requests on SIGTERM within server.shutdown_grace (10s in the
# shipped file): give `docker stop` a longer timeout (--stop-timeout / stop_grace_period).
STOPSIGNAL SIGTERM

# GET /healthz on the admin listener (a wildcard address is probed on loopback); no curl.
HEALTHCHECK --interval=10s --timeout=5s --start-period=5s --retries=3 \
  CMD ["floodgate", "healthcheck", "--timeout", "2s"]

ENTRYPOINT ["floodgate"]
