#!/usr/bin/env bash
# Run the test suite once per supported Triton version, each in its own virtual environment.
# Usage: bash tests/run.sh [pytest args]        (TRITON_VERSIONS="3.9.0" to run one version)
set -euo pipefail
cd "$(dirname "$0")/.."
versions=${TRITON_VERSIONS:-"3.3.1 3.6.0 3.9.0"}
venvs=${TRITONPACK_VENVS:-.venvs}
python=${PYTHON:-python3}
failed=()
for v in $versions; do
  env_dir="$venvs/triton-$v"
  if [ ! -x "$env_dir/bin/python" ]; then
    echo "== creating $env_dir (Triton $v)"
    "$python" -m venv "$env_dir"
    "$env_dir/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  fi
  # cheap when nothing changed; keeps the environment in step with pyproject.toml
  if ! "$env_dir/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]" "triton==$v" \
      > "$env_dir/pip.log" 2>&1; then
    cat "$env_dir/pip.log"
    exit 1
  fi
  echo "== Triton $v"
  if ! "$env_dir/bin/python" -m pytest -q -p no:cacheprovider "$@"; then
    failed+=("$v")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "tests failed under Triton ${failed[*]}"
  exit 1
fi
