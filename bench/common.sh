# Sourced by the bench scripts: what they share. A run's scratch directory and the
# processes it starts, all gone when the script exits; and the nginx configurations.

# start_run: makes RUN_DIR, a new temporary directory, and `pids`, where the script adds
# every process it starts (pids+=($!)); on exit each is stopped and RUN_DIR removed.
start_run() {
  RUN_DIR=$(mktemp -d)
  pids=()
  trap stop_run EXIT
}
stop_run() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$RUN_DIR"
}

# nginx_config DIR PORT HTTP_BLOCK LOCATION_BLOCK writes DIR/nginx.conf: one worker on
# 127.0.0.1:PORT, no access log, keep-alive connections without a request limit, every
# file nginx writes in DIR.
nginx_config() {
  mkdir -p "$1"
  cat >"$1/nginx.conf" <<CONF
worker_processes 1;
daemon off;
pid $1/nginx.pid;
error_log $1/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $1; proxy_temp_path $1; fastcgi_temp_path $1; uwsgi_temp_path $1; scgi_temp_path $1;
  keepalive_requests 10000000;
  $3
  # Three loopback addresses, so that a gateway can list one upstream as three servers.
  server { listen 127.0.0.1:$2; listen 127.0.0.2:$2; listen 127.0.0.3:$2; location / { $4 } }
}
CONF
}

# The upstream every comparison proxies to: a fixed 200 from memory.
UPSTREAM_LOCATION="default_type text/plain; return 200 'ok';"

# proxy_upstream PORT: the http block of a keep-alive reverse proxy to 127.0.0.1:PORT.
proxy_upstream() { echo "upstream app { server 127.0.0.1:$1; keepalive 128; }"; }
PROXY_LOCATION="proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection \"\";"

# User and kernel clock ticks of a process and its children (nginx's worker).
cpu_ticks() {
  local user=0 kernel=0 pid u k
  for pid in "$1" $(pgrep -P "$1" || true); do
    read -r u k < <(awk '{print $14, $15}' "/proc/$pid/stat")
    user=$((user + u))
    kernel=$((kernel + k))
  done
  echo "$user $kernel"
}

# php_fpm_config FILE DIR PORT CHILDREN writes FILE: a PHP-FPM pool in the foreground on
# 127.0.0.1:PORT, pm static with CHILDREN workers, its pid and log in DIR (named after
# PORT); run it with `php-fpm8.2 -F -R -y FILE`.
php_fpm_config() {
  cat >"$1" <<CONF
[global]
pid = $2/fpm-$3.pid
error_log = $2/fpm-$3.log
daemonize = no
[www]
listen = 127.0.0.1:$3
pm = static
pm.max_children = $4
CONF
}
