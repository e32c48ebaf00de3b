#!/usr/bin/env bash
# Build the peer of bench_sam.py's comparison: Arctic Inference's suffix-decoding extension,
# which vLLM's `speculative_config={"method": "suffix"}` imports
# (`from arctic_inference.suffix_decoding import SuffixDecodingCache`).
#   usage: bash benchmarks/setup_suffix_peer.sh [python]   (default: the current stack's)
#
# Why not `pip install arctic-inference`: PyPI has no wheel of 0.3.0 for this platform, only
# its sdist, whose build requirements pull torch>=2.10, protobuf, grpcio-tools (its
# SwiftKV / embedding / custom-op parts, which a CPU benchmark does not use) and which
# declares a vLLM general plugin that patches vLLM on import. Only the suffix-decoding
# extension is needed: it builds from the sdist's own csrc/suffix_decoding/CMakeLists.txt
# with nanobind (a C++20 compiler, CMake >= 3.18). This script does exactly that, in a
# scratch venv, and lays out the package's suffix_decoding modules and the built _C next to
# each other under $ASCEND_RL_CACHE/peers/ (never in a stack venv); bench_sam.py puts that
# folder on sys.path. Prints the folder.
set -euo pipefail
py=${1:-${ASCEND_RL_CACHE:-$HOME/.cache/ascend-rl}/stacks/current/venv/bin/python}
version=0.3.0
nanobind=2.9.2  # the sdist's build-system pin
cache=${ASCEND_RL_CACHE:-$HOME/.cache/ascend-rl}
dest=$cache/peers/arctic_inference-$version
if [ -f "$dest/.done" ]; then echo "$dest"; exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m venv "$work/venv"
"$work/venv/bin/pip" -q install "nanobind==$nanobind" ninja >&2
# the sdist alone; its metadata step imports torch, which the stack's interpreter has
# (--no-build-isolation: nothing is installed anywhere for it)
"$py" -m pip -q download --no-deps --no-build-isolation "arctic-inference==$version" -d "$work" >&2
tar xzf "$work/arctic_inference-$version.tar.gz" -C "$work"
src=$work/arctic_inference-$version
cmake -S "$src/csrc/suffix_decoding" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_MAKE_PROGRAM="$work/venv/bin/ninja" -DPython_EXECUTABLE="$work/venv/bin/python" \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$work/out" >&2
cmake --build "$work/build" >&2
rm -rf "$dest"
mkdir -p "$dest/arctic_inference/suffix_decoding"
cp "$src/arctic_inference/__init__.py" "$dest/arctic_inference/"
cp "$src/arctic_inference/suffix_decoding/__init__.py" "$src/arctic_inference/suffix_decoding/cache.py" \
   "$src/LICENSE" "$dest/arctic_inference/suffix_decoding/"
cp "$work"/out/_C*.so "$dest/arctic_inference/suffix_decoding/"
"$py" -c "import sys; sys.path.insert(0, '$dest'); from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(24, 16)" >&2
touch "$dest/.done"
echo "$dest"
