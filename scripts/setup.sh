#!/usr/bin/env bash
# Installs the build dependencies that a fresh Debian machine may lack (needs root for apt-get).
set -euo pipefail
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  apt-get update -qq && apt-get install -y -qq "${missing[@]}"
fi
