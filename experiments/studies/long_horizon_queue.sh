#!/usr/bin/env bash
# The long horizon's queue (docs/protocol.md amendments 8 and 9), resumable on any machine:
#
#   bash experiments/studies/long_horizon_queue.sh FROZEN RESULTS
#
# FROZEN: a checkout of the code the runs train with (amendment 8: stage 1 and 2 train from
# 5f416d8, `git worktree add FROZEN 5f416d8`); RESULTS: this machine's results folder. The
# queue asks `experiments.studies.tuned_rates --next` (from this checkout) for the next sweep of
# this machine's CPU type, trains it from FROZEN, and stops where the confirmatory runs begin
# (they need the tuning report committed first and a checkout frozen for them). A watcher beside
# it publishes every finished run into docs/results/long-horizon-tuning and commits it, so a lost
# machine loses only unfinished runs; on a new machine of the same type `--restore-from` skips
# what is published. It refuses to train on a CPU whose name is known with another family or
# model (amendment 9: a type is name, family and model; the records keep the name only).
set -uo pipefail
shopt -s nullglob
main=$(cd "$(dirname "$0")/../.." && pwd)
frozen=$(cd "$1" && pwd)
results=$(mkdir -p "$2" && cd "$2" && pwd)
py=${PYTHON:-python}
rel=docs/results/long-horizon-tuning  # relative, so that the report's "made by" line holds on any clone
pub=$main/$rel

cpu_type() {  # prints this CPU's folder suffix; fails on a known name with another family/model
  (cd "$main" && "$py" - "$pub/cpus.json" <<'EOF'
import json, pathlib, sys
from experiments.harness import provenance
from experiments.studies import tuned_rates
path, mine = pathlib.Path(sys.argv[1]), provenance.cpu_type()
known = json.loads(path.read_text()) if path.exists() else {}
if known.setdefault(mine["cpu"], mine) != mine:
  sys.exit(f"refused: {mine} is not the {known[mine['cpu']]} whose runs carry this name (amendment 9)")
path.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
print(tuned_rates.slug(mine["cpu"]))
EOF
  )
}

study() {  # tuned_rates over every published stage and this machine's own published runs
  (cd "$main" && "$py" -m experiments.studies.tuned_rates --grid "$rel/t9600" \
     --check "$rel"/t38400-* "$results"/pub/* "$@")
}

publish() {  # every finished stage-2 run of this machine, one folder per rate, then the report
  local rates rate n
  rates=$(ls "$results/t38400/runs" 2>/dev/null | sed -n 's/.*_lr\([0-9.e-]*\)_n38400_s0_.*/\1/p' | sort -u)
  for rate in $rates; do
    (cd "$frozen" && "$py" -m experiments.sweep --preset cpu --warmup-steps 28 --stages 16 --steps 38400 \
       --lr "$rate" --methods pipedream nesterov rotation muon --seeds 0 --out "$results/t38400" \
       --finished-only --publish "$results/pub/lr$rate" >/dev/null 2>&1)
  done
  study --out "$rel" || return
  n=$(find "$results/t38400/runs" -name result.json | wc -l)
  git -C "$main" add "$pub" && git -C "$main" commit -q -m "long-horizon tuning: $n finished stage-2 runs on $slug (seed 0, T = 38,400; protocol amendments 8 and 9)" -- "$pub" \
    || echo "$(date -u +%T) nothing to commit"
}

watch() {  # publishes whenever the count of finished runs changes
  local seen=-1 now
  while sleep 60; do
    now=$(find "$results/t38400/runs" -name result.json 2>/dev/null | wc -l)
    if [ "$now" != "$seen" ]; then publish; seen=$now; fi
  done
}

slug=$(cpu_type) || exit 1
echo "$(date -u +%T) CPU type $slug; frozen checkout $(git -C "$frozen" rev-parse --short HEAD)"
watch & watcher=$!
trap 'kill $watcher 2>/dev/null' EXIT
while pgrep -f "experiments.sweep .*--out $results/t38400" >/dev/null; do sleep 60; done  # one at a time
while true; do
  cmd=$(study --next --results "$results" | head -1)
  case "$cmd" in
    "") echo "$(date -u +%T) nothing left to train"; break ;;
    *confirmatory*) echo "$(date -u +%T) stage 2 complete: commit the tuning report, freeze a checkout, then run the confirmatory sweeps"; break ;;
    *"--steps 9600"*) echo "$(date -u +%T) stage 1 wants $cmd: amendment 9 keeps stage 1 as trained; stop"; break ;;
  esac
  restore=()
  [ -f "$pub/t38400-$slug/curves.json.xz" ] && restore=(--restore-from "$pub/t38400-$slug")
  echo "$(date -u +%T) $cmd"
  (cd "$frozen" && "$py" ${cmd#python } "${restore[@]}") || { echo "failed: $cmd"; break; }
done
publish
