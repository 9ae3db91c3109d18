# Sourced by the end-to-end scripts (tests/podman, tests/containerd, tests/docker): named
# checks that print ok/FAIL with the tail of a failure's output, and the summary line.
passed=0; failed=0
check() { # name, then a command that must succeed
  local name=$1; shift
  if out=$("$@" 2>&1); then
    passed=$((passed + 1)); echo "ok   $name"
  else
    failed=$((failed + 1)); echo "FAIL $name"; echo "$out" | tail -25 | sed 's/^/     /'
  fi
}

# Prints "WHAT: N passed, M failed" and fails when any check failed.
summary() {
  echo "$1: $passed passed, $failed failed"
  [ "$failed" -eq 0 ]
}

# Fails the script at once when any of the tools after WHAT and HINT is missing; HINT says what
# installs them (tests/deps.sh installs them all).
require_tools() {
  local what=$1 hint=$2 tool
  shift 2
  for tool in "$@"; do
    command -v "$tool" >/dev/null && continue
    echo "$what: '$tool' is missing ($hint)"
    exit 1
  done
}
