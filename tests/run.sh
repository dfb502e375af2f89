#!/usr/bin/env bash
# Run the test suite once per supported Triton version, each in its own virtual environment, and each on its own
# Python, so that the same runs cover requires-python's range (3.10+):
#   Triton 3.3.1 on Python 3.10 (oldest with oldest), 3.6.0 on 3.12 (the Python of the H200 fixture's launcher
#   stubs), 3.9.0 on 3.13 (newest with newest; 3.9.0 has no wheel for 3.10). Other versions run on python3.
# Python X.Y is pyenv's newest X.Y.* ($(pyenv root)/versions, else ~/.pyenv/versions), else pythonX.Y on PATH;
# where neither runs, python3 runs that version instead, with a note saying which Python it is.
# Usage: bash tests/run.sh [pytest args]
#   TRITON_VERSIONS="3.9.0"  run one version          PYTHON=python3.11  run every version on that Python
#   TRITONPACK_VENVS=DIR     where the environments go (default .venvs), one a pair: DIR/triton-3.3.1-py3.10
set -euo pipefail
cd "$(dirname "$0")/.."
versions=${TRITON_VERSIONS:-"3.3.1 3.6.0 3.9.0"}
venvs=${TRITONPACK_VENVS:-.venvs}

# The Python (X.Y) each Triton version is tested on; none: python3.
python_for_triton() {
  case $1 in
    3.3.1) echo 3.10 ;;
    3.6.0) echo 3.12 ;;
    3.9.0) echo 3.13 ;;
  esac
}

# Whether $1 runs and is Python $2 (X.Y): a pyenv shim of a version not activated is on PATH, but fails.
is_python() {
  "$1" -c 'import sys; sys.exit("%d.%d" % sys.version_info[:2] != sys.argv[1])' "$2" > /dev/null 2>&1
}

# The interpreter of Python $1 (X.Y): pyenv's newest $1.*, else python$1 on PATH; nothing when neither runs.
find_python() {
  local root candidate
  root=$(pyenv root 2> /dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
  while IFS= read -r candidate; do
    if is_python "$candidate" "$1"; then
      echo "$candidate"
      return
    fi
  done < <(ls -d "$root/versions/$1".* 2> /dev/null | sort -rV | sed "s|\$|/bin/python$1|"; echo "python$1")
}

# Triton 3.0-3.4 link AMD code with ROCm's ld.lld, which their wheels lack: an LLVM lld (Debian's lld-19, which CI
# installs) links it alike, so that their AMD tests run instead of skipping. Triton 3.5+ bring their own.
if [ -z "${TRITON_HIP_LLD_PATH:-}" ]; then
  for lld in /usr/lib/llvm-*/bin/ld.lld; do
    if [ -x "$lld" ]; then
      export TRITON_HIP_LLD_PATH=$lld
    fi
  done
fi

failed=()
for v in $versions; do
  wanted=$(python_for_triton "$v")
  python=${PYTHON:-}
  if [ -z "$python" ] && [ -n "$wanted" ]; then
    python=$(find_python "$wanted")
  fi
  if [ -z "$python" ]; then
    python=python3
  fi
  py=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ -z "${PYTHON:-}" ] && [ -n "$wanted" ] && [ "$py" != "$wanted" ]; then
    echo "== note: Python $wanted not found (pyenv, python$wanted): Triton $v runs on $python, Python $py, instead"
  fi
  env_dir="$venvs/triton-$v-py$py"
  if [ ! -x "$env_dir/bin/python" ]; then
    echo "== creating $env_dir (Triton $v, Python $py: $python)"
    "$python" -m venv "$env_dir"
    "$env_dir/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  fi
  # cheap when nothing changed; keeps the environment in step with pyproject.toml
  if ! "$env_dir/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]" "triton==$v" \
      > "$env_dir/pip.log" 2>&1; then
    cat "$env_dir/pip.log"
    exit 1
  fi
  echo "== Triton $v, Python $("$env_dir/bin/python" -c 'import platform; print(platform.python_version())')"
  if ! "$env_dir/bin/python" -m pytest -q -p no:cacheprovider "$@"; then
    failed+=("Triton $v (Python $py)")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  printf 'tests failed under %s\n' "${failed[@]}"
  exit 1
fi
