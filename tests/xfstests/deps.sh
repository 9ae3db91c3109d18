#!/bin/bash
# What building and running xfstests needs from Debian (its README's list, less what only
# block-device file systems use), installed when missing.
set -euo pipefail
packages=(acl attr automake bc dbench e2fsprogs fio gawk gcc indent libacl1-dev libaio-dev
  libcap-dev libgdbm-dev libgdbm-compat-dev libtool libtool-bin liburing-dev libuuid1 make
  psmisc python3 quota sed sqlite3 uuid-dev uuid-runtime xfsprogs xfslibs-dev xz-utils)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "xfstests: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
