# Makes a test copy of alerts/gpu-orphan.rules.yml whose GPUOrphanMemory
# fires within seconds instead of minutes, for `make run` (scripts/run.sh)
# and `make e2e` (e2e/loop_test.go):
#
#   awk -v age=3 -v for_=2s -f shorten-rules.awk alerts/gpu-orphan.rules.yml
#
# Only two things change, both in the GPUOrphanMemory rule: the number in
# `gpu_orphan_unowned_memory_age_seconds > N` (the exporter's age clock,
# 120 s in the shipped file) becomes `age`, and its `for:` (1m) becomes
# `for_`. Every other byte of the file is copied, so Prometheus evaluates
# the project's own expressions, labels and annotations. It fails when it
# does not find exactly one of each, rather than copy the file unchanged
# and leave a demo waiting three minutes.
BEGIN {
  if (age == "") age = 3
  if (for_ == "") for_ = "2s"
  print "# GENERATED TEST COPY of alerts/gpu-orphan.rules.yml by"
  print "# scripts/e2e-config/shorten-rules.awk. Only GPUOrphanMemory's time"
  print "# thresholds are shortened, to age > " age " s and for: " for_ " (the line"
  print "# marked 'shortened' names the shipped values). Edit the shipped file."
}
/^[ \t]*#/ { print; next }
/^[ \t]*-[ \t]+(alert|record):/ {
  in_rule = ($0 ~ /-[ \t]+alert:[ \t]+GPUOrphanMemory[ \t]*$/)
}
in_rule && /gpu_orphan_unowned_memory_age_seconds[ \t]*>[ \t]*[0-9.]+/ {
  match($0, /gpu_orphan_unowned_memory_age_seconds[ \t]*>[ \t]*[0-9.]+/)
  old_age = substr($0, RSTART, RLENGTH)
  sub(/.*>[ \t]*/, "", old_age)
  n_age += gsub(/gpu_orphan_unowned_memory_age_seconds[ \t]*>[ \t]*[0-9.]+/, "gpu_orphan_unowned_memory_age_seconds > " age)
}
in_rule && /^[ \t]+for:[ \t]/ {
  old_for = $0
  sub(/^[ \t]+for:[ \t]*/, "", old_for)
  sub(/[ \t]*(#.*)?$/, "", old_for)
  match($0, /^[ \t]+/)
  $0 = substr($0, 1, RLENGTH) "for: " for_ "  # shortened from " old_for "; the age threshold above from > " old_age
  n_for++
}
{ print }
END {
  if (n_age != 1 || n_for != 1) {
    printf "shorten-rules.awk: expected one age threshold and one for: in GPUOrphanMemory, found %d and %d\n", n_age, n_for > "/dev/stderr"
    exit 1
  }
}
