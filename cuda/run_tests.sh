#!/usr/bin/env bash
# cuda/run_tests.sh: run every native test program of a build folder and write JUnit XML.
#
#   cuda/run_tests.sh --build DIR --bundles DIR --junit FILE [--timeout SECONDS] [--logs DIR]
#
# Runs each executable DIR/test_* (built from cuda/tests/*.cpp) as `PROG --bundles BUNDLES`,
# without ctest. Programs report one line per case (cuda/tests/_harness.hpp):
#   KDT_CASE <tab> name <tab> PASS|FAIL|SKIP <tab> seconds <tab> message   ...   KDT_RESULT ...
# A program killed by a signal, timed out, exiting nonzero without a failed case, or ending
# without its KDT_RESULT line counts as a failed case of its own. Skipped CUDA cases (no GPU,
# or a CPU-only build) are listed at the end with the reason. Logs: LOGS/<prog>.log (default:
# the JUnit file's folder/native_logs). Exit code: 0 all passed, 1 a failure, 5 bad usage.
set -uo pipefail

build=""; bundles=""; junit=""; timeout_s=900; logs=""
usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
bad() { usage >&2; echo "error: run_tests: $*" >&2; exit 5; }
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=${2:-}; shift 2 ;;
    --bundles) bundles=${2:-}; shift 2 ;;
    --junit) junit=${2:-}; shift 2 ;;
    --timeout) timeout_s=${2:-}; shift 2 ;;
    --logs) logs=${2:-}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) bad "unknown argument '$1'" ;;
  esac
done
[ -n "$build" ] || bad "--build is required"
[ -n "$junit" ] || bad "--junit is required"
[ -d "$build" ] || bad "--build $build: no such folder (build first: cuda/build.sh --arch ... --out $build)"
[ -z "$bundles" ] || [ -d "$bundles" ] || bad "--bundles $bundles: no such folder (python -m engine.kdtr generate --out $bundles)"
[ -n "$logs" ] || logs="$(dirname "$junit")/native_logs"
mkdir -p "$logs" "$(dirname "$junit")" || bad "cannot create $logs"

progs=()
for p in "$build"/test_*; do
  [ -f "$p" ] && [ -x "$p" ] && progs+=("$p")
done
[ ${#progs[@]} -gt 0 ] || bad "no test programs (test_*) in $build: was it built with cuda/build.sh?"

results="$logs/results.tsv"   # prog <tab> KDT_CASE line fields, or a synthetic failure
: >"$results"
overall=0
for p in "${progs[@]}"; do
  name=$(basename "$p")
  log="$logs/$name.log"
  args=()
  [ -n "$bundles" ] && args=(--bundles "$bundles")
  echo "run_tests: $name ${args[*]}"
  start=$(date +%s.%N)
  timeout --signal=KILL "$timeout_s" "$p" "${args[@]}" >"$log" 2>&1
  rc=$?
  secs=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$start" "$(date +%s.%N)")
  tab=$'\t'
  grep "^KDT_CASE$tab" "$log" | sed "s|^KDT_CASE|$name|" >>"$results"
  failed_cases=$(grep -c "^KDT_CASE$tab[^$tab]*${tab}FAIL$tab" "$log")
  if [ "$rc" -ge 128 ] || [ "$rc" = 124 ]; then
    if [ "$rc" = 137 ] || [ "$rc" = 124 ]; then why="killed (timeout after ${timeout_s}s, or out of memory)"
    else why="died with signal $((rc - 128))"; fi
    printf '%s\t%s\tFAIL\t%s\t%s\n' "$name" "(program)" "$secs" "$why; see $log" >>"$results"
  elif ! grep -q '^KDT_RESULT ' "$log"; then
    printf '%s\t%s\tFAIL\t%s\t%s\n' "$name" "(program)" "$secs" \
      "exit code $rc without a KDT_RESULT line (crashed or not a harness program); see $log" >>"$results"
  elif [ "$rc" != 0 ] && [ "$failed_cases" = 0 ]; then
    printf '%s\t%s\tFAIL\t%s\t%s\n' "$name" "(program)" "$secs" "exit code $rc with no failed case; see $log" >>"$results"
  fi
  summary=$(grep '^KDT_RESULT ' "$log" | tail -n 1)
  echo "run_tests: $name: exit $rc ${summary:-(no result line)} (${secs}s)"
done

python3 - "$results" "$junit" <<'PY' || overall=1
import sys
from collections import defaultdict
from xml.sax.saxutils import escape, quoteattr

results, junit = sys.argv[1:]
suites = defaultdict(list)
for line in open(results, encoding="utf-8", errors="replace"):
    parts = line.rstrip("\n").split("\t")
    if len(parts) < 5:
        continue
    prog, case, verdict, secs, msg = parts[0], parts[1], parts[2], parts[3], "\t".join(parts[4:])
    suites[prog].append((case, verdict, secs, msg))
out = ['<?xml version="1.0" encoding="UTF-8"?>', "<testsuites>"]
fails = skips = total = 0
cuda_skips = defaultdict(int)
for prog, cases in suites.items():
    nf = sum(v == "FAIL" for _, v, _, _ in cases)
    ns = sum(v == "SKIP" for _, v, _, _ in cases)
    t = sum(float(s) for _, _, s, _ in cases if s.replace(".", "", 1).isdigit())
    out.append(f'  <testsuite name={quoteattr(prog)} tests="{len(cases)}" failures="{nf}" '
               f'skipped="{ns}" errors="0" time="{t:.3f}">')
    for case, verdict, secs, msg in cases:
        out.append(f'    <testcase classname={quoteattr("native." + prog)} name={quoteattr(case)} '
                   f'time={quoteattr(secs)}>')
        if verdict == "FAIL":
            out.append(f"      <failure message={quoteattr(msg[:500])}>{escape(msg)}</failure>")
        elif verdict == "SKIP":
            out.append(f"      <skipped message={quoteattr(msg)}/>")
            if "CUDA" in msg:
                cuda_skips[msg] += 1
        out.append("    </testcase>")
    out.append("  </testsuite>")
    fails, skips, total = fails + nf, skips + ns, total + len(cases)
out.append("</testsuites>")
open(junit, "w").write("\n".join(out) + "\n")
for msg, n in cuda_skips.items():
    print(f"run_tests: note: {n} CUDA case(s) skipped: {msg}")
print(f"run_tests: {total} cases, {fails} failed, {skips} skipped; JUnit XML in {junit}")
for prog, cases in suites.items():
    for case, verdict, _, msg in cases:
        if verdict == "FAIL":
            print(f"run_tests: FAIL {prog} {case}: {msg}", file=sys.stderr)
sys.exit(1 if fails else 0)
PY
exit $overall
