#!/usr/bin/env bash
# Installs the build dependencies that a fresh Debian machine may lack (needs root for apt-get).
set -euo pipefail
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
# scripts/test.sh builds the Python package in a virtual environment: python3 with venv and the
# headers the extension compiles against.
command -v python3 >/dev/null || missing+=(python3)
python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)
python3 -c "import os, sysconfig; assert os.path.isfile(sysconfig.get_paths()['include'] + '/Python.h')" \
  2>/dev/null || missing+=(python3-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  apt-get update -qq && apt-get install -y -qq "${missing[@]}"
fi
