#!/usr/bin/env bash
# The long horizon's queue (docs/protocol.md amendments 8 and 9), resumable on any machine:
#
#   bash experiments/studies/long_horizon_queue.sh FROZEN RESULTS
#
# FROZEN: a checkout of the code the tuning runs train with (amendment 8: stages 1 and 2 train
# from 5f416d8, `git worktree add FROZEN 5f416d8`); RESULTS: this machine's results folder.
# Tuning: the queue asks `experiments.studies.tuned_rates --next` (from this checkout) for the next
# stage-2 sweep of this machine's CPU type and trains it from FROZEN; a watcher beside it publishes
# every finished run into docs/results/long-horizon-tuning and commits it.
# Confirmatory (once the tuning report with every rate chosen is committed): the runs train from
# one checkout frozen at C, the first commit whose tuning summary.json holds "chosen" (the same C
# on every machine; RESULTS/frozen-C), seed by seed in amendment 9's order (`--confirmatory
# --next`); a watcher publishes every finished run into docs/results/long-horizon/confirmatory-<cpu>,
# rebuilds the verdicts (`experiments.studies.long_horizon`) and commits them.
# So a lost machine loses only unfinished runs; on a new machine of the same type
# `--restore-from` skips what is published. It refuses to train on a CPU whose name is known with
# another family or model (amendment 9: a type is name, family and model; the records keep the
# name only), and stops where a sweep fails or a seed cannot be completed (a diverged run).
. "$(dirname "$0")/queue_lib.sh" "$@"  # main, frozen, results, py; commit FOLDER MESSAGE
rel=docs/results/long-horizon-tuning  # relative, so that the reports' "made by" lines hold on any clone
pub=$main/$rel
crel=docs/results/long-horizon
cpub=$main/$crel

cpu_type() {  # prints this CPU's folder suffix; fails on a known name with another family/model
  (cd "$main" && "$py" -m experiments.studies.ladder --register-cpu "$pub/cpus.json")
}

study() {  # tuned_rates over every published stage, this machine's own published runs and the confirmatory ones
  (cd "$main" && "$py" -m experiments.studies.tuned_rates --grid "$rel/t9600" \
     --check "$rel"/t38400-* "$results"/pub/* --confirmatory "$crel"/confirmatory-* "$@")
}


publish_tuning() {  # every finished stage-2 run of this machine, one folder per rate, then the report
  local rates rate n
  rates=$(ls "$results/t38400/runs" 2>/dev/null | sed -n 's/.*_lr\([0-9.e-]*\)_n38400_s0_.*/\1/p' | sort -u)
  for rate in $rates; do
    (cd "$frozen" && "$py" -m experiments.sweep --preset cpu --warmup-steps 28 --stages 16 --steps 38400 \
       --lr "$rate" --methods pipedream nesterov rotation muon --seeds 0 --out "$results/t38400" \
       --finished-only --publish "$results/pub/lr$rate" >/dev/null 2>&1)
  done
  study --out "$rel" || return
  n=$(find "$results/t38400/runs" -name result.json | wc -l)
  commit "$rel" "long-horizon tuning: $n finished stage-2 runs on $slug (seed 0, T = 38,400; protocol amendments 8 and 9)"
}

publish_confirmatory() {  # every finished confirmatory run of this machine, then the verdicts
  local i=0 cmd n
  while IFS= read -r cmd; do
    i=$((i + 1))
    (cd "$cfrozen" && "$py" ${cmd#python } --finished-only --publish "$results/pubc/$i" </dev/null >/dev/null 2>&1)
  done < "$results/confirmatory.commands"
  (cd "$main" && "$py" -m experiments.studies.long_horizon "$crel"/confirmatory-* "$results"/pubc/*/curves.json.xz \
     --rates "$rel/summary.json" --out "$crel") || return
  n=$(find "$results/confirmatory/runs" -name result.json | wc -l)
  commit "$crel" "long horizon, confirmatory: $n finished runs on $slug (seeds 6-11, T = 38,400; protocol amendments 8 and 9)"
}

publish() {  # one publisher at a time (the watcher and the queue both call it)
  (flock 9; if [ -n "${cfrozen:-}" ]; then publish_confirmatory; else publish_tuning; fi) 9>"$results/.publish.lock"
}

watch() {  # publishes whenever the count of finished runs in FOLDER changes
  local seen=-1 now
  while sleep 60; do
    now=$(find "$1/runs" -name result.json 2>/dev/null | wc -l)
    if [ "$now" != "$seen" ]; then publish; seen=$now; fi
  done
}

chosen_commit() {  # C: the first commit whose tuning summary.json holds every rate chosen
  local c
  for c in $(git -C "$main" log --reverse --format=%H -- "$rel/summary.json"); do
    git -C "$main" show "$c:$rel/summary.json" | "$py" -c \
      'import json, sys; sys.exit(0 if json.load(sys.stdin).get("chosen") else 1)' && { echo "$c"; return; }
  done
  return 1
}

slug=$(cpu_type) || exit 1
echo "$(date -u +%T) CPU type $slug; tuning checkout $(git -C "$frozen" rev-parse --short HEAD)"
watch "$results/t38400" & watcher=$!
trap 'kill $watcher 2>/dev/null' EXIT
while pgrep -f "experiments.sweep .*--out $results/t38400" >/dev/null; do sleep 60; done  # one at a time
while true; do
  publish  # so that --next sees every finished run
  cmd=$(study --next --results "$results" | head -1)
  case "$cmd" in
    "") echo "$(date -u +%T) nothing left to train"; exit 0 ;;
    *confirmatory*) echo "$(date -u +%T) stage 2 complete"; break ;;
    *"--steps 9600"*) echo "$(date -u +%T) stage 1 wants $cmd: amendment 9 keeps stage 1 as trained; stop"; exit 1 ;;
  esac
  restore=()
  [ -f "$pub/t38400-$slug/curves.json.xz" ] && restore=(--restore-from "$pub/t38400-$slug")
  echo "$(date -u +%T) $cmd"
  (cd "$frozen" && "$py" ${cmd#python } "${restore[@]}") || { echo "failed: $cmd"; publish; exit 1; }
done
publish  # the tuning report with its rates chosen, committed before the first confirmatory run
kill $watcher 2>/dev/null

c=$(chosen_commit) || { echo "$(date -u +%T) no committed tuning summary holds chosen rates; stop"; exit 1; }
cfrozen=$results/frozen-${c:0:7}
[ -d "$cfrozen" ] || git -C "$main" worktree add --detach "$cfrozen" "$c" || exit 1
echo "$(date -u +%T) confirmatory checkout ${c:0:7} (the first commit with the rates chosen)"
touch "$results/confirmatory.commands" "$results/confirmatory.done"
watch "$results/confirmatory" & watcher=$!
while pgrep -f "experiments.sweep .*--out $results/confirmatory" >/dev/null; do sleep 60; done
while true; do
  publish
  cmd=$(study --next --results "$results" | grep -vxF -f "$results/confirmatory.done" | head -1)
  if [ -z "$cmd" ]; then
    left=$(study --next --results "$results" | wc -l)
    if [ "$left" = 0 ]; then echo "$(date -u +%T) every confirmatory seed is complete"
    else echo "$(date -u +%T) every printed sweep ran and a seed is still incomplete (a diverged run?): see $crel/report.md"; fi
    break
  fi
  grep -qxF "$cmd" "$results/confirmatory.commands" || echo "$cmd" >> "$results/confirmatory.commands"
  restore=()
  [ -f "$cpub/confirmatory-$slug/curves.json.xz" ] && restore=(--restore-from "$cpub/confirmatory-$slug")
  echo "$(date -u +%T) $cmd"
  (cd "$cfrozen" && "$py" ${cmd#python } "${restore[@]}") || { echo "failed: $cmd"; break; }
  echo "$cmd" >> "$results/confirmatory.done"
done
publish
