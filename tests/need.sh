# Sourced by the test scripts that install what they use: `need WHO CMD:PACKAGE...` installs
# from Debian the package of each command that is missing, and fails when apt-get does.
need() {
  local who=$1 missing=() pair
  shift
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "$who: installing ${missing[*]}"
  apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
