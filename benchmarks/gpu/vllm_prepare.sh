#!/usr/bin/env bash
# On a CPU machine with internet, from the repository root: prepare vLLM 0.33 for the H200 image
# (Python 3.12, torch 2.11 cu130, no package index) as pieces of at most 46.3 MB in .vllm-wheels/
# (ignored by git). The device tool carries at most 64 MiB a call, so the pieces travel in
# back-to-back calls while the machine stays warm: see benchmarks/gpu/README.md.
#
# What travels:
# * vllm 0.33.0's CUDA wheel, slimmed with `zip -d` (entries removed, nothing recompressed): the
#   FlashAttention 2 library (Hopper runs FA3), the Rust front end `vllm-rs`, DeepGEMM's, FlashKDA's
#   and QuTLASS's libraries and the CUTLASS headers (JIT for Blackwell/FP8) are dropped; vLLM's
#   stable-ABI libraries (_C, _moe_C, FA3, FlashMLA, DeepSelect) stay. 336 MB -> about 175 MB.
# * only the dependencies an engine start imports that the image lacks (found by importing vLLM's
#   engine, V2 runner, Qwen3, attention backends, spec-decode and sampler modules plus the plugin
#   and the model loader (dummy, quantization registry) with every package the image lacks hidden; versions = what `pip install vllm==0.33.0`
#   resolved), plus blake3 and setproctitle (used at run time). Everything else the image has.
# The slim wheel and the dependency wheels go into one tar, split into pieces part_aa, part_ab, ...
set -euo pipefail
dir=${1:-.vllm-wheels}
max=${PIECE_BYTES:-46300000}   # with the checkout (~14 MB in December 2026), under the 64 MiB a call carries
grep -qx "/$dir/" .gitignore 2>/dev/null || grep -qx "$dir/" .gitignore || echo "$dir/" >> .gitignore
rm -rf "$dir" && mkdir -p "$dir/dl" "$dir/pack"
DL=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
DEPS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1 oss-harmony==0.0.11 openai==3.57.0
      sniffio==1.3.1 jiter==0.19.0 cachetools==8.0.2 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
      fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6
      httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 blake3==1.0.11 setproctitle==1.3.8
      compressed-tensors==0.17.0 loguru==0.7.3)
"${DL[@]}" -d "$dir/dl" vllm==0.33.0 "${DEPS[@]}" 2>&1 | grep -v "^WARNING: Location" || true
whl=$(ls "$dir"/dl/vllm-0.33.0-*.whl)
drop=('vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' 'vllm/third_party/deep_gemm/_C_extension.abi3.so'
      'vllm/_flashkda_C.abi3.so' 'vllm/_qutlass_C.abi3.so' 'vllm/third_party/*/include/*'
      'vllm/third_party/fmha_sm100/cutlass/*')
zip -q -d "$whl" "${drop[@]}"
# RECORD must not list what is gone (pip rewrites it on install)
tmp=$(mktemp -d); rec=vllm-0.33.0.dist-info/RECORD
unzip -q "$whl" "$rec" -d "$tmp"
grep -v -E '^vllm/(vllm_flash_attn/_vllm_fa2_C|vllm-rs|third_party/deep_gemm/_C_extension|_flashkda_C|_qutlass_C|third_party/[^/]+/include/|third_party/fmha_sm100/cutlass/)' \
    "$tmp/$rec" > "$tmp/RECORD.new"; mv "$tmp/RECORD.new" "$tmp/$rec"
(cd "$tmp" && zip -q "$OLDPWD/$whl" "$rec"); rm -rf "$tmp"
n=$(ls "$dir"/dl/*.whl | wc -l)
[ "$n" -eq $((${#DEPS[@]} + 1)) ] || { echo "expected $((${#DEPS[@]} + 1)) wheels, got $n" >&2; exit 1; }
(cd "$dir/dl" && ls *.whl > MANIFEST && sha256sum *.whl > SHA256SUMS && tar -cf ../pack/all.tar *.whl MANIFEST SHA256SUMS)
split -b "$max" -a 2 "$dir/pack/all.tar" "$dir/part_"
(cd "$dir" && sha256sum pack/all.tar | sed 's#pack/##' > all.tar.sha256)
rm -rf "$dir/dl" "$dir/pack"
# one folder per piece, so that each call carries exactly one
for p in "$dir"/part_*; do mkdir -p "$dir/${p##*/part_}" && mv "$p" "$dir/${p##*/part_}/"; done
mv "$dir/all.tar.sha256" "$dir/$(ls "$dir" | grep -v sha256 | sort | tail -1)/"
ls -l "$dir"/*/
echo "pieces: $(ls -d "$dir"/*/ | tr '\n' ' ')"
