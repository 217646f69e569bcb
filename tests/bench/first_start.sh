#!/bin/bash
# Launch to rank 0's first step of the reference job (8 ranks: dp 2 x tp 2 x pp 2) under `trainwarden run`,
# warm workers (the default: the first round's workers wait for the zygote's imports and fork from it) against
# --cold-workers (every rank imports torch), alternating, RUNS times each.
#   bash tests/bench/first_start.sh [RUNS]
set -u
cd "$(dirname "$0")/../.."
runs=${1:-2}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for i in $(seq 1 "$runs"); do
  for mode in warm cold; do
    flag=""; [ "$mode" = cold ] && flag="--cold-workers"
    log="$scratch/$mode-$i.log"; start=$(date +%s.%N)
    TRAINWARDEN_STATE_HOME="$scratch/$mode-$i" timeout 300 .venv/bin/python -m trainwarden.agent.cli run \
      --metrics-port 0 --nproc-per-node 8 --job fs $flag -- \
      -m trainwarden.runtime.examples.gpt --dp 2 --tp 2 --pp 2 --steps 3 --ckpt-every 100 > "$log" 2>&1 &
    pid=$!
    until grep -q "step 1 loss" "$log" 2>/dev/null || ! kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    first=$(echo "$(date +%s.%N) - $start" | bc)
    wait "$pid"; rc=$?
    echo "$mode run $i: first step after ${first} s; exit $rc"
  done
done
