#!/usr/bin/env bash
# The width ladder's queue (docs/protocol.md amendment 10), resumable on any machine:
#
#   bash experiments/studies/ladder_queue.sh FROZEN RESULTS
#
# FROZEN: a checkout of the code the runs train with (`git worktree add FROZEN COMMIT`, the commit
# named in the amendment); RESULTS: this machine's results folder. The queue asks
# `experiments.studies.ladder --next` (from this checkout) for the next sweep (the tuning, the check
# at width 32, then the confirmatory seeds in amendment 9's order) and trains it from FROZEN, one
# sweep at a time; a watcher beside it publishes every finished run into docs/results/ladder,
# rebuilds the report and commits it, so a lost machine loses only unfinished runs (on a new
# machine, `--restore-from` skips what is published). It stops where a sweep fails.
. "$(dirname "$0")/queue_lib.sh" "$@"  # main, frozen, results, py; commit FOLDER MESSAGE
rel=docs/results/ladder  # relative, so that the report's "made by" line holds on any clone
pub=$main/$rel
touch "$results/commands" "$results/done"

study() {  # the ladder over the published folders and this machine's own published runs
  (cd "$main" && "$py" -m experiments.studies.ladder "$rel"/tune "$rel"/confirmatory-* "$results"/pub/* "$@")
}


publish() {  # every sweep's finished runs into RESULTS/pub/N, then the report, committed
  (
    flock 9
    local i=0 cmd n
    while IFS= read -r cmd; do
      i=$((i + 1))
      (cd "$frozen" && "$py" ${cmd#python } --finished-only --publish "$results/pub/$i" </dev/null >/dev/null 2>&1)
    done < "$results/commands"
    study --out "$rel" || exit 1
    n=$(find "$results" -path '*/runs/*' -name result.json | wc -l)
    commit "$rel" "width ladder: $n finished runs on this machine (protocol amendment 10)"
  ) 9>"$results/.publish.lock"
}

watch() {  # publishes whenever the count of finished runs changes
  local seen=-1 now
  while sleep 60; do
    now=$(find "$results" -path '*/runs/*' -name result.json 2>/dev/null | wc -l)
    if [ "$now" != "$seen" ]; then publish; seen=$now; fi
  done
}

slug=$(cd "$main" && "$py" -m experiments.studies.ladder --register-cpu "$pub/cpus.json") || exit 1
echo "$(date -u +%T) ladder queue on $slug: runs train from $(git -C "$frozen" rev-parse --short HEAD)"
watch & watcher=$!
trap 'kill $watcher 2>/dev/null' EXIT
while true; do
  publish
  cmd=$(study --next --results "$results" | head -1)
  if [ -z "$cmd" ]; then echo "$(date -u +%T) nothing left to train"; break; fi
  if grep -qxF "$cmd" "$results/done"; then  # it ran whole and is asked again: a diverged run
    echo "$(date -u +%T) $cmd ran and is still wanted (a diverged run?): see $rel/report.md; stop"; break
  fi
  grep -qxF "$cmd" "$results/commands" || echo "$cmd" >> "$results/commands"
  restore=()
  for folder in "$pub"/tune "$pub"/confirmatory-*; do
    [ -f "$folder/curves.json.xz" ] && restore+=("$folder")
  done
  [ ${#restore[@]} -gt 0 ] && restore=(--restore-from "${restore[@]}")
  echo "$(date -u +%T) $cmd"
  (cd "$frozen" && "$py" ${cmd#python } "${restore[@]}") || { echo "failed: $cmd"; publish; exit 1; }
  echo "$cmd" >> "$results/done"
done
publish
