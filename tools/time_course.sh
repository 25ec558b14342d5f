#!/bin/bash
# Time the course: units 0-7 one after another in the full profile, sharing one course cache that starts empty,
# then the same in the quick profile from its own empty cache. Run it on an idle machine (nothing else running).
#   tools/time_course.sh [SCRATCH]      # default /tmp/course-time; writes runs/uN-full and runs/uN-quick
# Prints "profile unit rc seconds load" lines (also in SCRATCH/summary); render each unit's README from its run with
#   course readme N --results runs/uN-full   (and runs/uN-quick)
# and build the published site from the full runs with  course site --profile full --no-execute
set -u
scratch=${1:-/tmp/course-time}
cd "$(dirname "$0")/.."
mkdir -p "$scratch"
: > "$scratch/summary"
for prof in full quick; do
  export COURSE_LIB_HOME="$scratch/$prof/home"
  rm -rf "$scratch/$prof"; mkdir -p "$scratch/$prof"
  for u in 0 1 2 3 4 5 6 7; do
    start=$(date +%s)
    course run $u --profile $prof --out runs/u$u-$prof > "$scratch/$prof/$u.log" 2>&1
    rc=$?
    echo "$prof $u rc=$rc $(( $(date +%s) - start )) s load=$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$scratch/summary"
  done
done
awk '{t[$1] += $4} END {for (p in t) printf "%s: %d s = %.1f min\n", p, t[p], t[p] / 60}' \
  "$scratch/summary"
