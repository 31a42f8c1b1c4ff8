#!/usr/bin/env bash
# Writes to stdout ../shared/bench/conf/floodgate/local-high.toml.tmpl with an override
# table of N (default 10000) entries that the benchmark's client (127.0.0.1) matches none
# of: what a large table costs a request. Usage:
#
#   bash bench/overrides_template.sh 10000 > /tmp/local-high-overrides.toml.tmpl
#   bash bench/request_cost.sh /tmp/local-high-overrides.toml.tmpl
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-10000}
python3 - "$N" <<'PY'
import sys
n = int(sys.argv[1])
base = open("../shared/bench/conf/floodgate/local-high.toml.tmpl").read()
entries = "".join(f'  {{ key = ["10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"], burst = 2000000 }},\n' for i in range(n))
sys.stdout.write(base.replace("burst = 1000000\n", "burst = 1000000\noverrides = [\n" + entries + "]\n", 1))
PY
