# Sourced first by the study queues (ladder_queue.sh, long_horizon_queue.sh) with their arguments
# FROZEN RESULTS: sets main (this checkout), frozen, results and py, and defines `commit FOLDER
# MESSAGE`, which commits FOLDER (relative to "$main") alone while docs/results stays within the
# budget tests/test_readme.py keeps (the files a commit would hold, as the test counts them: not
# those git ignores, e.g. results.csv).
set -uo pipefail
shopt -s nullglob
main=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
frozen=$(cd "$1" && pwd)
results=$(mkdir -p "$2" && cd "$2" && pwd)
py=${PYTHON:-python}
BUDGET=3000000

commit() {
  local bytes
  bytes=$(git -C "$main" ls-files -z --cached --others --exclude-standard docs/results \
            | (cd "$main" && xargs -0 stat -c %s) | awk '{s += $1} END {print s}')
  if [ "$bytes" -ge $((BUDGET - 5000)) ]; then
    echo "$(date -u +%T) not committed: docs/results would hold $bytes bytes (budget $BUDGET); make room, then the next publish commits"
    return 1
  fi
  git -C "$main" add "$1" && git -C "$main" commit -q -m "$2" -- "$1" || echo "$(date -u +%T) nothing to commit"
}
