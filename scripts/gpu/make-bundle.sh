#!/usr/bin/env bash
# Build, on a CPU machine with PyPI access, the wheel bundle that installs vLLM 0.20.0 and what its
# OpenAI server imports (../shared/gpu/wheels-vllm-0.20.0-cp312.txt + wheels-serve.txt here) into
# the GPU image offline, in parts small enough to carry one per call (../shared/gpu/README.md).
#   usage: scripts/gpu/make-bundle.sh OUTDIR [PART_MB]      (default PART_MB=48)
# Writes OUTDIR/p0/part, OUTDIR/p1/part, ... plus OUTDIR/bin/ (install scripts + SHA256SUMS).
# Slimming: drops vLLM's FlashAttention-2 kernels (Hopper uses FA3; FA2 import is optional) and
# xgrammar's static library (not loaded at run time).
set -euo pipefail
out=${1:?usage: make-bundle.sh OUTDIR [PART_MB]}; part_mb=${2:-48}
here=$(cd "$(dirname "$0")" && pwd); shared=${SHARED_GPU:-$here/../../../shared/gpu}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/w"
cat "$shared/wheels-vllm-0.20.0-cp312.txt" "$here/wheels-serve.txt" | grep -v "^#" | grep . > "$work/req.txt"
plat=(); for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
    manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 \
    manylinux1_x86_64; do plat+=(--platform "$p"); done
PIP_CONSTRAINT= python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -r "$work/req.txt" -d "$work/w"
slim() { # slim WHEEL PATTERN: delete members matching PATTERN and their RECORD lines
  local whl=$1 pat=$2 rec
  rec=$(unzip -Z1 "$whl" | grep '\.dist-info/RECORD$')
  zip -q -d "$whl" "$pat"
  mkdir -p "$work/r/$(dirname "$rec")"
  unzip -p "$whl" "$rec" | grep -v -F "${pat//\*/}" > "$work/r/$rec" || true
  (cd "$work/r" && zip -q "$whl" "$rec")
}
slim "$(ls "$work"/w/vllm-0.20.0-*.whl)" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so'
slim "$(ls "$work"/w/xgrammar-*.whl)" 'xgrammar/lib/libxgrammar.a'
n=$(ls "$work"/w/*.whl | wc -l)
tar -cf "$work/payload.tar" -C "$work/w" .
rm -rf "$out"; mkdir -p "$out/bin"
split -b "${part_mb}M" -d -a 1 "$work/payload.tar" "$work/payload.part"
i=0; for f in "$work"/payload.part*; do mkdir -p "$out/p$i"; mv "$f" "$out/p$i/part"; i=$((i+1)); done
(cd "$work" && sha256sum payload.tar) > "$out/bin/SHA256SUMS"
echo "$i" > "$out/bin/NPARTS"
cp "$shared/receive.sh" "$shared/install.sh" "$out/bin/"
echo "bundle: $n wheels, $(stat -c %s "$work/payload.tar") bytes, $i parts of <= ${part_mb} MiB in $out"
du -sh "$out"/p* | sed 's/^/  /'
