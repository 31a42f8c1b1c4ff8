#!/usr/bin/env bash
# Fails when the request path costs more instructions than bench/cost_budgets allows:
# each template there is measured with bench/request_cost.sh (callgrind counts, which a
# loaded machine does not change) and compared with its budget plus 2 %. Options after
# the budget: `headers=FILE` names a file in bench/conf of request headers to send
# (request_cost.sh's HEADERS), for what a real client's request costs beside wrk's bare
# one; `log=FILTER` runs floodgate with FLOODGATE_LOG=FILTER instead of `warn` (`info`:
# with the access log, as floodgate runs by default); `load=h2` sends the requests over
# HTTP/2 with h2load (request_cost.sh's LOAD). Usage (from the repository root, after
# `cargo build --release`):
#
#   bash bench/cost_guard.sh [BINARY]
#
# BINARY defaults to target/release/floodgate.
set -euo pipefail
cd "$(dirname "$0")/.."

BINARY=${1:-target/release/floodgate}
TOLERANCE_PERCENT=2
# Templates measured at once: instruction counts do not follow the machine's load, so
# measuring two side by side changes no count and halves the guard's time on two cores.
JOBS=${COST_GUARD_JOBS:-2}
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT

# Measures template $2 (bench/conf) with options $3 into $results/$1.
measure() {
  local header_lines="" log=warn load="" option
  for option in $3; do
    case $option in
      headers=*) header_lines=$(cat "bench/conf/${option#headers=}") ;;
      log=*) log=${option#log=} ;;
      load=*) load=${option#load=} ;;
    esac
  done
  LOAD=$load FLOODGATE_LOG=$log HEADERS=$header_lines TOP=0 RUN_SECONDS=${RUN_SECONDS:-3} \
    bash bench/request_cost.sh "bench/conf/$2.toml.tmpl" "$BINARY" 2>&1 |
    awk '/instructions per request/ {print $2}' >"$results/$1" || true
}

entries=()
while read -r template budget options; do
  case $template in '' | '#'*) continue ;; esac
  for option in $options; do
    case $option in
      headers=* | log=* | load=*) ;;
      *) echo "cost guard: unknown option $option in bench/cost_budgets" >&2; exit 2 ;;
    esac
  done
  entries+=("$template|$budget|$options")
done <bench/cost_budgets

for i in "${!entries[@]}"; do
  IFS='|' read -r template _ options <<<"${entries[$i]}"
  measure "$i" "$template" "$options" &
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
done
wait

failed=0
for i in "${!entries[@]}"; do
  IFS='|' read -r template budget options <<<"${entries[$i]}"
  template_label=$(echo "$template $options" | sed 's/ *$//')
  measured=$(cat "$results/$i")
  # A run that could not start (a port taken between choosing and binding it, say) is
  # measured again, alone.
  if [ -z "$measured" ]; then
    measure "$i" "$template" "$options"
    measured=$(cat "$results/$i")
  fi
  if [ -z "$measured" ]; then
    echo "cost guard: $template_label could not be measured" >&2
    failed=1
    continue
  fi
  limit=$((budget * (100 + TOLERANCE_PERCENT) / 100))
  if [ "$measured" -gt "$limit" ]; then
    echo "cost guard: $template_label costs $measured instructions per request, over its budget of $budget (+$TOLERANCE_PERCENT %: $limit); see bench/cost_budgets" >&2
    failed=1
  else
    echo "cost guard: $template_label $measured instructions per request (budget $budget, limit $limit)"
  fi
done
exit "$failed"
