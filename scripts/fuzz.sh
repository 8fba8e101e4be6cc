#!/usr/bin/env bash
# Runs every Go fuzz target for a bounded number of inputs (FUZZTIME each,
# default 20000x): the webhook payload parser, the /proc parsers and the
# simulated driver's state files. `make test` runs it; `FUZZTIME=5m make
# fuzz` digs deeper. The default is a count, not a duration: with a duration,
# Go 1.26's coordinator can report its own deadline as a failure
# ("context deadline exceeded", no input written; go.dev/issue/75804, fixed
# in Go 1.27). A count has no deadline to race, so a failure here is a
# finding.
# Each target's output goes to RUN_DIR/fuzz/PACKAGE.TARGET.log (RUN_DIR is
# .run by default), and is printed when the target fails.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime=${FUZZTIME:-20000x}
logdir=${RUN_DIR:-.run}/fuzz
mkdir -p "$logdir"
# Minimising each new input may take up to a minute by default; a stall
# there outlasts a short -fuzztime and fails with "context deadline
# exceeded". A bounded minimisation keeps short runs honest.
minimize=${FUZZMINIMIZE:-100x}
# .tools/ holds other projects' sources (scripts/tools.sh): only ours.
grep -rl --include='*_test.go' --exclude-dir=.tools --exclude-dir=.run --exclude-dir=dist '^func Fuzz' . | while read -r file; do
  pkg=./$(dirname "${file#./}")
  for target in $(grep -o '^func Fuzz[A-Za-z0-9_]*' "$file" | sed 's/^func //'); do
    echo "fuzz: $pkg $target for $fuzztime"
    log=$logdir/$(echo "${pkg#./}" | tr / .).$target.log
    go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" -fuzzminimizetime "$minimize" "$pkg" >"$log" 2>&1 || { cat "$log"; exit 1; }
  done
done
