#!/usr/bin/env bash
# Fetch vLLM 0.33.0's wheel and unpack the few pure-Python files that tools/vllm_oracle.py imports.
#
# Usage: tools/fetch_vllm.sh [--wheel PATH] [--dest DIR]
#   --wheel PATH  use a wheel already on disk instead of downloading (about 336 MB)
#   --dest DIR    cache directory (default: .oracle/ at the repository root, or $KVOFFLOAD_VLLM_ORACLE)
# The wheel is kept in DIR (downloaded wheels only) and the files land in DIR/src/vllm/...
set -euo pipefail

version=0.33.0
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${KVOFFLOAD_VLLM_ORACLE:-$root/.oracle}
wheel=""

while [ $# -gt 0 ]; do
  case "$1" in
    --wheel) wheel=$2; shift 2 ;;
    --dest) dest=$2; shift 2 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "fetch_vllm.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done

if [ -x "$root/.venv/bin/python" ]; then python=$root/.venv/bin/python; else python=python3; fi
mkdir -p "$dest"

if [ -z "$wheel" ]; then
  wheel=$(ls "$dest"/vllm-"$version"-*.whl 2>/dev/null | head -n 1 || true)
fi
if [ -z "$wheel" ]; then
  "$python" -m pip download --no-deps --only-binary=:all: "vllm==$version" -d "$dest"
  wheel=$(ls "$dest"/vllm-"$version"-*.whl | head -n 1)
fi
[ -f "$wheel" ] || { echo "fetch_vllm.sh: no such wheel: $wheel" >&2; exit 1; }

# The wheel must be the version the oracle stands for.
found=$(unzip -p "$wheel" "vllm-$version.dist-info/METADATA" 2>/dev/null | sed -n 's/^Version: //p' | head -n 1)
if [ "$found" != "$version" ]; then
  echo "fetch_vllm.sh: $wheel is not vLLM $version (METADATA says '${found:-nothing}')" >&2
  exit 1
fi

# Only the offloading package, the two leaf modules it imports and the connector's two metrics
# modules; the package __init__ files of vllm/, vllm/v1/, vllm/utils/ ... are left out on purpose
# (vllm_oracle.py stands in for them). The same members as tools/fetch_vllm.py.
rm -rf "$dest/src"
unzip -q -o "$wheel" \
  'vllm/v1/kv_offload/*' \
  'vllm/v1/metrics/cache_hit_source.py' \
  'vllm/utils/math_utils.py' \
  'vllm/distributed/kv_transfer/kv_connector/v1/metrics.py' \
  'vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py' \
  -d "$dest/src"
echo "$version" > "$dest/src/VLLM_VERSION"
echo "vLLM $version oracle sources unpacked in $dest/src (from $wheel)"
