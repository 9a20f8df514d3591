#!/usr/bin/env bash
# The cost of what oomguard does under a memory cgroup (oomguard_host::memory::bound_heap:
# glibc's mmap threshold fixed at 4 MiB, so freed buffers go back to the system) against
# glibc's own dynamic threshold, which it keeps elsewhere: the demo's model on the CPU, no
# budget, no cgroup, the threshold given as MALLOC_MMAP_THRESHOLD_ (which glibc reads), rounds
# alternated; tokens/s and RssAnon from the step records (steps 3 on). Prints the medians and
# the ratios. Also 128 KiB, the smallest threshold that was tried.
#   benches/scripts/malloc.sh [ROUNDS] [STEPS]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ROUNDS="${1:-3}"; STEPS="${2:-15}"
BIN="$ROOT/target/release/oomguard"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
run() {  # run NAME [ENV...]: one run; prints "tok_s rss_mib"
  local name="$1"; shift
  env "$@" OOMGUARD_CACHE="$TMP/cache" "$BIN" train "$ROOT/configs/demo.yaml" --run-dir "$TMP/$name" \
    --max-steps "$STEPS" --set memory.budget=none --set 'memory.pressure=[]' --set train.device=cpu \
    --set train.eval_every=0 --set checkpoint.every_steps=0 2>/dev/null
  python3 - "$TMP/$name/metrics.jsonl" <<'PY'
import json, statistics, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("event") == "step"][3:]
tok = statistics.median(r["tokens_per_s"] for r in steps)
rss = max(r["memory"].get("host_rss_anon_bytes", 0) for r in steps) / 2**20
print(f"{tok:.0f} {rss:.0f}")
PY
}
fixed=(); dynamic=(); small=()
for i in $(seq "$ROUNDS"); do
  a=$(run "fixed-$i" MALLOC_MMAP_THRESHOLD_=4194304); b=$(run "dynamic-$i"); c=$(run "small-$i" MALLOC_MMAP_THRESHOLD_=131072)
  echo "round $i: fixed 4 MiB: $a | glibc's dynamic: $b | fixed 128 KiB: $c (tokens/s, peak RssAnon MiB)"
  fixed+=("$a"); dynamic+=("$b"); small+=("$c")
done
python3 - "${fixed[*]}" "${dynamic[*]}" "${small[*]}" <<'PY'
import statistics, sys
def pairs(text):
    v = list(map(float, text.split()))
    return list(zip(v[0::2], v[1::2]))
f, d, m = pairs(sys.argv[1]), pairs(sys.argv[2]), pairs(sys.argv[3])
med = lambda v, i: statistics.median(x[i] for x in v)
print(f"median tokens/s: 4 MiB {med(f,0):.0f}, glibc's {med(d,0):.0f}: ratio {med(f,0)/med(d,0):.3f}"
      f" (128 KiB: {med(m,0)/med(d,0):.3f})")
print(f"median peak RssAnon: 4 MiB {med(f,1):.0f} MiB, glibc's {med(d,1):.0f} MiB: ratio {med(f,1)/med(d,1):.3f}"
      f" (128 KiB: {med(m,1)/med(d,1):.3f})")
PY
