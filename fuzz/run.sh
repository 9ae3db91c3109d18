#!/usr/bin/env bash
# Coverage-guided fuzzing of every decoder of layer data (src/fuzzing.rs) with libFuzzer:
# cargo-fuzz and a nightly toolchain are installed when missing. Each target runs SECONDS
# (default 120) with its corpus in fuzz/corpus/TARGET; what libFuzzer finds that covers more
# is added there, and the corpus minimised (keep it: tests/fuzz.rs replays it in make test). A crash stops the
# run and leaves its input in fuzz/artifacts/TARGET/.
# Usage: fuzz/run.sh [SECONDS [TARGET...]]
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-120}; shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(ls fuzz_targets | sed 's/\.rs$//')
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
for t in "${targets[@]}"; do
  echo "== $t: $secs s"
  # 2 GiB: a forged count that allocates by what it claims, not by what the input holds, is a
  # crash here.
  cargo +nightly fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=2048 \
    -malloc_limit_mb=1024 -print_final_stats=1 2>&1 | grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::new_units_added|==[0-9]+==|SUMMARY|Done)|panicked|artifact_prefix|Test unit written" || true
  [ -z "$(ls artifacts/"$t" 2>/dev/null)" ] || { echo "$t: crash inputs in fuzz/artifacts/$t"; exit 1; }
  # The smallest set of inputs that covers as much: what the tree keeps.
  cargo +nightly fuzz cmin "$t" "corpus/$t" > /dev/null 2>&1
  echo "$t: $(ls "corpus/$t" | wc -l) inputs in the corpus"
done
