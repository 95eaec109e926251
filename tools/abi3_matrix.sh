#!/usr/bin/env bash
# Run the Python test suite against one abi3 wheel under every CPython it promises (3.10+).
#
#   tools/abi3_matrix.sh                        # every python3.10 .. python3.13 found
#   tools/abi3_matrix.sh ~/.pyenv/versions/3.12.1/bin/python
#
# The wheel is built once (`maturin build --release`), as a user would download it; each
# interpreter gets a fresh venv with the wheel and its test extra from PyPI, and runs
# `pytest tests` from a copy of tests/ outside the source tree (so the installed wheel is what
# imports, not python/kvoffload). Interpreters are found on PATH or under pyenv; the run's
# own CPython (the one `.ci/run` tests) is included if it is one of them. Free-threaded
# builds have their own script (tools/freethreaded.sh): an abi3 wheel does not load there.
# Exit status: 0 if every interpreter's run passed, 1 otherwise, 2 if none was found.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)

pythons=("$@")
if [ ${#pythons[@]} -eq 0 ]; then
  for minor in 10 11 12 13; do
    found=$(command -v "python3.$minor" 2>/dev/null || true)
    if [ -z "$found" ]; then
      found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3."$minor".*/bin/python 2>/dev/null |
        sort -V | tail -n 1)
    fi
    [ -n "$found" ] && pythons+=("$found")
  done
fi
if [ ${#pythons[@]} -eq 0 ]; then
  echo "abi3_matrix: no CPython 3.10-3.13 found (pass interpreters as arguments)" >&2
  exit 2
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-abi3.XXXXXX")
if [ "${KEEP:-0}" = 1 ]; then
  echo "abi3_matrix: logs kept in $work" >&2
else
  trap 'rm -rf "$work"' EXIT
fi

maturin build --release --out "$work/dist" >&2 || exit 1
wheel=$(ls "$work"/dist/kvoffload-*-abi3-*.whl)
echo "abi3_matrix: $(basename "$wheel")" >&2

# The tree the tests read besides tests/ (README, docs, tools, benches, scripts, the Rust
# sources some tests read limits and messages from), linked.
tree="$work/tree"
mkdir -p "$tree"
cp -r tests pyproject.toml "$tree/"
for path in README.md docs tools benches scripts rust; do
  ln -s "$repo/$path" "$tree/$path"
done

status=0
summary=()
for py in "${pythons[@]}"; do
  version=$("$py" -c 'import platform; print(platform.python_version())') || continue
  venv="$work/venv-$version"
  log="$work/pytest-$version.log"
  echo "abi3_matrix: CPython $version ($py)" >&2
  if ! "$py" -m venv "$venv" ||
    ! "$venv/bin/pip" install --quiet "$wheel[test]" >"$work/pip-$version.log" 2>&1; then
    summary+=("$version: could not install the wheel and its test extra")
    tail -n 20 "$work/pip-$version.log" >&2
    status=1
    continue
  fi
  # vLLM's sources, as scripts/test takes them: in place (or fetched), the vLLM tests must run.
  # (Any value of KVOFFLOAD_REQUIRE_VLLM requires them, so it is set or unset, never 0.)
  require=(-u KVOFFLOAD_REQUIRE_VLLM)
  if (cd "$tree" && "$venv/bin/python" tools/fetch_vllm.py >/dev/null 2>&1); then
    require=(KVOFFLOAD_REQUIRE_VLLM=1)
  fi
  (cd "$tree" && env "${require[@]}" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests >"$log" 2>&1)
  rc=$?
  summary+=("$version: $(tail -n 1 "$log")")
  if [ "$rc" != 0 ]; then
    status=1
    tail -n 40 "$log" >&2
  fi
done

printf 'abi3_matrix: %s\n' "${summary[@]}"
exit "$status"
