#!/usr/bin/env bash
# The free-threading check: build a free-threaded CPython (`--disable-gil`) from Debian's copy of
# the upstream source, build kvoffload for it, check that importing it leaves the GIL off, and
# run the thread tests, the rest of the suite that runs there, and the 8-thread stress
# (tools/stress.py) with the GIL off (`-X gil=0`).
#
#   tools/freethreaded.sh [--python auto|3.14|3.13] [--seconds N] [--threads N]
#                         [--build-only] [--no-suite]
#
# Which interpreter: PyO3 0.30 supports free-threaded CPython 3.14 and later only, so 3.14t is
# the real target (Debian unstable/testing's python3.14 source). Where that cannot be fetched
# (`auto`, the default, tries it first), 3.13t from Debian trixie is built instead and kvoffload
# is built against a copy of pyo3-ffi whose version gate alone is lowered from 3.14 to 3.13
# (PyO3 0.30 still carries the 3.13t struct layouts; only its build script refuses 3.13t). That
# copy is passed to cargo with --config for this build only; Cargo.toml is untouched and
# Cargo.lock is restored afterwards. A 3.13t result is evidence about kvoffload's own locking,
# not a supported configuration.
#
# Everything is cached under ${XDG_CACHE_HOME:-~/.cache}/kvoffload: the interpreter in
# python3.1Xt/ (built once: ~11 min on 2 busy cores), its venv in venv-3.1Xt/. Only
# deb.debian.org and PyPI are needed (not python.org or GitHub); the source's sha256 is pinned.
# Needs a C toolchain and the usual CPython build headers (libssl, libffi, zlib, bz2, lzma,
# sqlite3, readline, ncurses, uuid); as root it installs missing ones with apt-get. Not part of
# scripts/test or CI: from cold ~30 min (interpreter 11, wheels 1, kvoffload 3, tests and stress
# 13), warm ~13 min with the default 60 s per stress run (docs/reliability.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

want=auto
seconds=60
threads=8
build_only=0
suite=1
usage="usage: $0 [--python auto|3.14|3.13] [--seconds N] [--threads N] [--build-only] [--no-suite]"
while [ $# -gt 0 ]; do
  case "$1" in
    --python) want="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --no-suite) suite=0; shift ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done

step() { printf '\n==> %s\n' "$*" >&2; }

cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvoffload"
mirror=http://deb.debian.org/debian
jobs="${JOBS:-2}"
mkdir -p "$cache/src"

# Pinned sources: Debian ships CPython's upstream tarball unchanged as pythonX.Y_V.orig.tar.xz.
# 3.14: unstable's; when Debian has moved on (its pool keeps current versions only) the newest
# of unstable or testing is found in a Sources index whose hash is in a gpgv-checked InRelease.
declare -A pin_version=([3.14]=3.14.10 [3.13]=3.13.5)
declare -A pin_sha256=(
  [3.14]=de414a57119abef52784d8993e341d53aed635fc2b05c2607d9f98a2c5b72032
  [3.13]=93e583f243454e6e9e4588ca2c2662206ad961659863277afcdb96801647d640
)

# Print "VERSION SHA256" of the newest pythonX.Y orig tarball in Debian unstable or testing.
discover_tarball() {
  local minor="$1" suite tmp want
  tmp="$(mktemp -d)"
  for suite in unstable testing; do
    curl -fsS -o "$tmp/InRelease" "$mirror/dists/$suite/InRelease" || continue
    gpgv --keyring /usr/share/keyrings/debian-archive-keyring.gpg "$tmp/InRelease" 2>/dev/null \
      || { echo "InRelease of $suite: bad signature" >&2; continue; }
    curl -fsS -o "$tmp/Sources.xz" "$mirror/dists/$suite/main/source/Sources.xz" || continue
    want="$(awk '/^SHA256:/{p=1; next} /^[A-Z]/{p=0}
      p && $3 == "main/source/Sources.xz" {print $1}' "$tmp/InRelease")"
    echo "$want  $tmp/Sources.xz" | sha256sum -c --quiet - || continue
    xz -dc "$tmp/Sources.xz" | awk -v pkg="python$minor" '
      $0 == "Package: " pkg {p = 1} /^$/ {p = 0}
      p && length($1) == 64 && index($3, pkg "_") == 1 && $3 ~ /\.orig\.tar\.xz$/ {
        v = substr($3, length(pkg) + 2); sub(/\.orig\.tar\.xz$/, "", v); print v, $1 }' \
      | sort -V | tail -1
    break
  done
  rm -rf "$tmp"
}

# Fetch pythonX.Y's source into $cache/src; sets $tarball and $tarball_sha256. Fails quietly
# (status 1) when Debian does not serve it.
fetch_source() {
  local minor="$1" version="${pin_version[$1]}" sha="${pin_sha256[$1]}"
  tarball="python${minor}_${version}.orig.tar.xz"
  tarball_sha256="$sha"
  [ -f "$cache/src/$tarball" ] && return 0
  if ! curl -fsS --retry 3 -o "$cache/src/$tarball.part" \
      "$mirror/pool/main/p/python$minor/$tarball" 2>/dev/null; then
    [ "$minor" = 3.14 ] || return 1
    read -r version sha <<<"$(discover_tarball "$minor")"
    [ -n "$version" ] || return 1
    tarball="python${minor}_${version}.orig.tar.xz"
    tarball_sha256="$sha"
    [ -f "$cache/src/$tarball" ] && return 0
    curl -fsS --retry 3 -o "$cache/src/$tarball.part" \
      "$mirror/pool/main/p/python$minor/$tarball" 2>/dev/null || return 1
    echo "CPython $version (pin it in ${BASH_SOURCE[0]}: sha256 $sha)" >&2
  fi
  mv "$cache/src/$tarball.part" "$cache/src/$tarball"
}

build_interpreter() {
  local minor="$1" prefix="$2"
  step "build deps"
  local deps=(build-essential pkg-config libssl-dev libffi-dev zlib1g-dev libbz2-dev liblzma-dev
              libsqlite3-dev libreadline-dev libncurses-dev uuid-dev)
  local missing=() dep
  for dep in "${deps[@]}"; do
    dpkg -s "$dep" >/dev/null 2>&1 || missing+=("$dep")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get install -y --no-install-recommends "${missing[@]}"
    else
      echo "missing build deps (optional modules may be skipped): ${missing[*]}" >&2
    fi
  fi
  echo "$tarball_sha256  $cache/src/$tarball" | sha256sum -c -
  step "configure --disable-gil && make -j$jobs && make install (prefix $prefix)"
  local build="$cache/src/build-${minor}t"
  rm -rf "$build"
  mkdir -p "$build"
  tar -xJf "$cache/src/$tarball" -C "$build" --strip-components=1
  (
    cd "$build"
    ./configure --disable-gil --prefix="$prefix" --with-ensurepip=install >configure.log 2>&1 \
      || { tail -40 configure.log; exit 1; }
    make -j"$jobs" >make.log 2>&1 || { tail -60 make.log; exit 1; }
    # Optional modules that could not be built are listed; the build goes on without them.
    grep -A3 -E 'necessary bits to build these optional modules|Failed to build these modules' \
      make.log || true
    make install >install.log 2>&1 || { tail -40 install.log; exit 1; }
  )
  rm -rf "$build"
}

# The interpreter: an installed one, else one whose source Debian serves.
minor=
for candidate in 3.14 3.13; do
  if [ "$want" != auto ] && [ "$want" != "$candidate" ]; then
    continue
  fi
  if [ -x "$cache/python${candidate}t/bin/python${candidate}t" ]; then
    minor="$candidate"
    break
  fi
  step "CPython $candidate source (Debian's .orig.tar.xz)"
  if fetch_source "$candidate"; then
    build_interpreter "$candidate" "$cache/python${candidate}t"
    minor="$candidate"
    break
  fi
  rm -f "$cache/src/$tarball.part"
  echo "Debian does not serve python$candidate's source here" >&2
done
[ -n "$minor" ] || { echo "no free-threaded CPython could be built ($usage)" >&2; exit 1; }
python="$cache/python${minor}t/bin/python${minor}t"
venv="$cache/venv-${minor}t"
"$python" -c 'import sys, sysconfig
assert sysconfig.get_config_var("Py_GIL_DISABLED"), "not a free-threaded build"
print(sys.version)'

if [ ! -x "$venv/bin/python" ]; then
  step "venv $venv"
  "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
step "pip install maturin numpy pytest hypothesis pytest-benchmark tqdm matplotlib typing_extensions"
# typing_extensions: vLLM's sources (the oracle tests) import it. Wheels only: a package without a
# cp31Xt wheel is not built from source (numpy 2.5: ~30 min); pip takes the newest version that
# has one.
python -m pip install -q --upgrade pip
python -m pip install -q --only-binary=:all: maturin numpy pytest hypothesis pytest-benchmark \
  tqdm matplotlib typing_extensions

# The abi3-py310 feature stays on: PyO3 and maturin fall back to a version-specific cp31Xt
# extension for a free-threaded interpreter (a warning, no error), which is what this needs.
maturin_args=(--release)
if [ "$minor" = 3.13 ]; then
  ffi_version="$(awk '/^name = "pyo3-ffi"$/ {getline; gsub(/[^0-9.]/, ""); print}' Cargo.lock)"
  ffi_src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"pyo3-ffi-$ffi_version" | head -1)"
  ffi_copy="$cache/pyo3-ffi-$ffi_version-313t"
  if [ ! -d "$ffi_copy" ]; then
    [ -d "$ffi_src" ] || cargo fetch --locked
    ffi_src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"pyo3-ffi-$ffi_version" | head -1)"
    cp -r "$ffi_src" "$ffi_copy.part"
    sed -i 's/^const MIN_FREE_THREADED_VERSION: PythonVersion = PY_3_14;$/const MIN_FREE_THREADED_VERSION: PythonVersion = PythonVersion { major: 3, minor: 13 };/' \
      "$ffi_copy.part/build.rs"
    grep -q 'MIN_FREE_THREADED_VERSION: PythonVersion = PythonVersion { major: 3, minor: 13 }' \
      "$ffi_copy.part/build.rs" || { echo "pyo3-ffi's version gate has changed" >&2; exit 1; }
    mv "$ffi_copy.part" "$ffi_copy"
  fi
  maturin_args+=(--config "patch.crates-io.pyo3-ffi.path=\"$ffi_copy\"")
  cp Cargo.lock "$cache/Cargo.lock.saved"
  trap 'cp "$cache/Cargo.lock.saved" Cargo.lock' EXIT
fi
step "maturin develop ${maturin_args[*]}"
CARGO_BUILD_JOBS="$jobs" maturin develop "${maturin_args[@]}"
if [ "$minor" = 3.13 ]; then
  cp "$cache/Cargo.lock.saved" Cargo.lock
fi
if [ "$build_only" = 1 ]; then
  exit 0
fi

# Without -X gil=0: a free-threaded interpreter runs without the GIL by default and turns it
# back on (with a RuntimeWarning) when it imports an extension that does not declare
# free-threading support. kvoffload and its native module must leave it off (an error here);
# what the submodules' third-party imports (matplotlib, ...) do is reported.
step "the GIL stays off once kvoffload is imported"
python -c 'import importlib, pkgutil, sys, warnings
with warnings.catch_warnings():
    warnings.simplefilter("error")
    import kvoffload, kvoffload._native
assert not sys._is_gil_enabled(), "importing kvoffload re-enabled the GIL"
print(sys.version, "| GIL enabled after importing kvoffload:", sys._is_gil_enabled())
skipped, enabling = [], []
for mod in pkgutil.walk_packages(kvoffload.__path__, "kvoffload."):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            importlib.import_module(mod.name)
        except ImportError as e:  # optional dependencies (vLLM, torch, libcachesim) absent
            skipped.append(f"{mod.name} ({e})")
    enabling += [f"{mod.name}: {w.message}" for w in caught if "GIL" in str(w.message)]
print("submodules not importable here:", "; ".join(skipped) or "none")
print("submodule imports that re-enable the GIL:", "; ".join(enabling) or "none")
print("GIL enabled after importing every submodule:", sys._is_gil_enabled())'

# From here the GIL is forced off (-X gil=0 in this process, PYTHON_GIL=0 for any interpreter
# a test starts), whatever the test dependencies declare.
export PYTHON_GIL=0
status=0
step "pytest tests/test_threads.py tests/test_host_jobs.py (GIL off, KVOFFLOAD_STRESS_SECONDS=20)"
KVOFFLOAD_STRESS_SECONDS=20 python -X gil=0 -m pytest -x -q -s -p no:cacheprovider \
  tests/test_threads.py tests/test_host_jobs.py || status=1

step "tools/stress.py: $threads threads, $seconds s per policy, lru arc sieve (+ HostPool rounds)"
python -X gil=0 tools/stress.py --seconds "$seconds" --threads "$threads" \
  --policies lru arc sieve || status=1
step "tools/stress.py --long-prompts: $threads threads, $seconds s (calls of 130-200 keys)"
python -X gil=0 tools/stress.py --seconds "$seconds" --threads "$threads" --long-prompts \
  || status=1
step "tools/stress.py --tier arc: $threads threads, $seconds s (lru and a second tier, arc)"
python -X gil=0 tools/stress.py --seconds "$seconds" --threads "$threads" --tier arc \
  || status=1

if [ "$suite" = 1 ]; then
  # vLLM's kv_offload sources (cached); without them the vLLM tests skip.
  python tools/fetch_vllm.py || true
  step "pytest (the whole suite, GIL off; what cannot install here skips)"
  python -X gil=0 -m pytest -q -p no:cacheprovider || status=1
fi
exit "$status"
