#!/usr/bin/env bash
# Generates the Python protobuf module for the local protocol from the repository's local.proto.
# game.py does the same by itself at start when the module is missing or stale.
# Usage: examples/python-game/generate.sh [OUT_DIR]   (PYTHON selects the interpreter)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$here/generated}"
mkdir -p "$out"
"${PYTHON:-python3}" -m grpc_tools.protoc -I "$repo/proto/proto" --python_out="$out" local.proto
echo "generated $out/local_pb2.py"
