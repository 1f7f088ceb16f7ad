#!/usr/bin/env bash
# Writes requirements.lock: the set pip resolves for this package with its test and train extras in a fresh venv, as
# CI tests it, less this package and llama-cpp-python (the bootstrap builds that one). The bootstrap installs with uv
# constrained to this file, so the faster installer gives pip's tested set, not a resolution of its own. Run after a
# bootstrap (it reuses the llama.cpp wheel that built) whenever setup.cfg's requirements change.
set -euo pipefail
cd "$(dirname "$0")/.."

wheel=$(compgen -G "build/llama-cpp-wheels/*/llama_cpp_python-*.whl" | head -1) \
  || { echo "lock: no llama-cpp-python wheel under build/llama-cpp-wheels: run make setup first" >&2; exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
.venv/bin/python -m venv "$scratch/venv"
"$scratch/venv/bin/python" -m pip install -q --upgrade pip
"$scratch/venv/bin/python" -m pip install -q --ignore-requires-python "$wheel" -e '.[test,train]'
{
  echo "# pip's resolution of nemo-gym-prorl[test,train] on Python $("$scratch/venv/bin/python" -c 'import platform; print(platform.python_version())'); written by scripts/lock.sh"
  # local version labels (+cpu) name one index's build: the public version matches any build of it
  "$scratch/venv/bin/python" -m pip freeze --exclude nemo-gym-prorl --exclude llama-cpp-python | sed -e '/^-e /d' -e '/^#/d' -e 's/+[A-Za-z0-9.]*$//'
} > requirements.lock
echo "lock: requirements.lock holds $(grep -vc '^#' requirements.lock) pins"
