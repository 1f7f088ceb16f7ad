#!/usr/bin/env bash
# The installer benchmark (issue 25): a fresh clone of HEAD set up by scripts/bootstrap.sh with uv, then with pip
# (PRORL_INSTALLER=pip), each with an empty package cache; the llama.cpp wheel is copied in from build/ so both time
# the install itself, not the compile. Prints each time, the ratio and the load average before each run.
set -euo pipefail
cd "$(dirname "$0")/.."
compgen -G "build/llama-cpp-wheels/*/llama_cpp_python-*.whl" >/dev/null \
  || { echo "bench_install: no llama-cpp-python wheel under build/: run make setup first" >&2; exit 1; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
declare -A took
for installer in uv pip; do
  git clone -q . "$scratch/$installer"
  mkdir -p "$scratch/$installer/build" && cp -r build/llama-cpp-wheels "$scratch/$installer/build/"
  echo "$installer: load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  start=$(date +%s.%N)
  (cd "$scratch/$installer" && PRORL_INSTALLER=$installer XDG_CACHE_HOME="$scratch/cache-$installer" \
    scripts/bootstrap.sh >"$scratch/$installer.log" 2>&1) || { cat "$scratch/$installer.log"; exit 1; }
  took[$installer]=$(echo "$(date +%s.%N) - $start" | bc)
  printf '%s: fresh clone to installed venv in %.1f s\n' "$installer" "${took[$installer]}"
done
printf 'pip / uv: %.1fx\n' "$(echo "${took[pip]} / ${took[uv]}" | bc -l)"
