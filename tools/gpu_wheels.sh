#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the exact wheels the GPU check (python -m tools.gpu_check) needs on the lent GPU
# machine, which has no network.  Run in the checkout's root, on a machine with network:
#
#   tools/gpu_wheels.sh [--image FILE] [NAME==VERSION ...]
#
# What it downloads (cp312, x86-64 manylinux wheels, --no-deps: every dependency is named here):
#   * every package of requirements.txt that the image lacks (FILE: the image's package list, one name a line;
#     default ../shared/gpu/image-packages.txt or ../../shared/gpu/image-packages.txt), except cupy-cuda12x
#     and nvidia-cuda-nvrtc-cu12 (the image has cupy-cuda13x, which towers uses as it is; two CuPy packages
#     break each other), nvidia-nccl-cu12, pytest (there) and ray (64-76 MiB: the cluster tests skip there);
#     pooch brings platformdirs;
#   * GPU_WHEELS below: the cuDNN frontend and nvmath-python at the versions towers is tested against, and
#     cuda-core / cuda-pathfinder (nvmath-python's dependencies) when the image's list lacks them;
#   * the NAME==VERSION words given.
# The cuDNN frontend's own dependencies (nvidia-cutlass-dsl, apache-tvm-ffi: hundreds of MiB) serve its
# Python engines, which convolutions do not use (they are opt-in, CUDNN_FRONTEND_ENABLE_FROST_ENGINES): not carried.
# Prints the wheels and their total size: the working tree and .whl together must stay under 64 MiB.
# On the GPU machine the check's command installs them (docs/performance.md, "On a GPU"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
set -euo pipefail
GPU_WHEELS=(nvidia-cudnn-frontend==1.32.0 nvmath-python==1.0.0)
NVMATH_DEPS=(cuda-core==0.5.0 cuda-pathfinder==1.5.1)  # carried only when the image lacks them (nvmath's minimums)

[[ -f requirements.txt && -d towers ]] || { echo "gpu_wheels: run this in the checkout's root"; exit 2; }
image=""
if [[ ${1:-} == --image ]]; then image=${2:?--image needs a file}; shift 2; fi
if [[ -z $image ]]; then
  for f in ../shared/gpu/image-packages.txt ../../shared/gpu/image-packages.txt; do
    [[ -f $f ]] && { image=$f; break; }
  done
fi
[[ -n $image && -f $image ]] || { echo "gpu_wheels: the image's package list is missing: pass --image FILE"; exit 2; }
norm() { tr 'A-Z_.' 'a-z--'; }
have=$(grep -v '^\s*#' "$image" | norm)
want=()
while read -r line; do
  name=$(echo "$line" | sed 's/[<>=!~ ;\[].*//' | norm)
  case $name in ''|-e|cupy-cuda12x|nvidia-cuda-nvrtc-cu12|nvidia-nccl-cu12|ray|pytest) continue ;; esac
  grep -qx "$name" <<<"$have" || want+=("$name")
done < <(grep -v '^\s*#' requirements.txt | sed '/^\s*$/d')
# towers' runtime dependencies (pyproject.toml) that the image lacks: requirements.txt installs them through -e .
while read -r name; do
  grep -qx "$name" <<<"$have" || [[ " ${want[*]:-} " == *" $name "* ]] || want+=("$name")
done < <(python3 - <<'EOF'
import re, tomllib
for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    print(re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower().replace("_", "-").replace(".", "-"))
EOF
)
[[ " ${want[*]:-} " == *" pooch "* ]] && want+=(platformdirs)
want+=("${GPU_WHEELS[@]}")
for dep in "${NVMATH_DEPS[@]}"; do
  grep -qx "${dep%%==*}" <<<"$have" || want+=("$dep")
done
want+=("$@")
mkdir -p .whl
rm -f .whl/*.whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .git/info/exclude
echo "gpu_wheels: downloading ${want[*]}"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${want[@]}"
ls -s --block-size=K .whl
echo "gpu_wheels: $(ls .whl/*.whl | wc -l) wheels, $(du -sm .whl | cut -f1) MiB in .whl (with the working tree: under 64 MiB)"
