#!/usr/bin/env bash
# cuda/cmake_build.sh: the cuda/build.sh build through CMake (build.sh --generator cmake|auto
# runs this). Same outputs in OUT: libkdtree.so, the test and benchmark programs, and
# build_info.json / compile_commands.txt with every compile line (from compile_commands.json)
# and link line (from CMake's link.txt files).
#
#   cuda/cmake_build.sh --arch <sm_90|sm_90a|sm_120|sm_90,sm_120|native|cpu> --out DIR [--jobs N] [--debug]
#                       [--define NAME[=VALUE]]...
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
arch=""; out=""; jobs=""; debug=0; defines=""
die() { echo "error: build: $*" >&2; exit 4; }
usage() { sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=${2:-}; shift 2 ;;
    --out) out=${2:-}; shift 2 ;;
    --jobs) jobs=${2:-}; shift 2 ;;
    --debug) debug=1; shift ;;
    --define)
      [[ "${2:-}" =~ ^[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+-]*)?$ ]] \
        || { echo "error: build: --define: '${2:-}' is not NAME or NAME=VALUE (letters, digits, _ . + -)" >&2; exit 5; }
      defines="${defines:+$defines;}$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; echo "error: build: unknown argument '$1'" >&2; exit 5 ;;
  esac
done
[ -n "$arch" ] || { usage >&2; echo "error: build: --arch is required" >&2; exit 5; }
[ -n "$out" ] || { usage >&2; echo "error: build: --out is required" >&2; exit 5; }
jobs=${jobs:-$(nproc 2>/dev/null || echo 2)}
command -v cmake >/dev/null 2>&1 || die "cmake is not on PATH (use cuda/build.sh --generator direct)"
if [ "$arch" != cpu ] && ! command -v nvcc >/dev/null 2>&1; then
  die "--arch $arch needs nvcc, which is not on PATH (install the CUDA toolkit or use --arch cpu)"
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
btype=Release; [ "$debug" = 1 ] && btype=Debug
cuda_compiler=()
[ "$arch" != cpu ] && cuda_compiler=(-DCMAKE_CUDA_COMPILER="$(command -v nvcc)")
echo "build: cmake configure for --arch $arch in $out/cmake"
cmake -S "$here" -B "$out/cmake" -DKDT_ARCH="$arch" -DKDT_OUT="$out" -DCMAKE_BUILD_TYPE="$btype" \
  -DKDT_DEFINES="$defines" \
  "${cuda_compiler[@]}" >"$out/cmake_configure.log" 2>&1 \
  || { tail -n 30 "$out/cmake_configure.log" >&2; die "cmake configure failed (log: $out/cmake_configure.log)"; }
echo "build: cmake --build with $jobs jobs"
cmake --build "$out/cmake" --parallel "$jobs" >"$out/cmake_build.log" 2>&1 \
  || { tail -n 40 "$out/cmake_build.log" >&2; die "cmake build failed (log: $out/cmake_build.log)"; }
[ -f "$out/libkdtree.so" ] || die "cmake finished but $out/libkdtree.so is missing"

nvcc_version=$(command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -n 2 | tr '\n' ' ' || echo "")
python3 - "$out" "$arch" "$nvcc_version" <<'PY'
import datetime, glob, json, os, subprocess, sys
out, arch, nvcc = sys.argv[1:]
cmds = [c["command"] if "command" in c else " ".join(c["arguments"])
        for c in json.load(open(f"{out}/cmake/compile_commands.json"))]
for link in sorted(glob.glob(f"{out}/cmake/CMakeFiles/*.dir/link.txt")):
    cmds += [l.strip() for l in open(link) if l.strip()]
open(f"{out}/compile_commands.txt", "w").write("\n".join(cmds) + "\n")
gxx = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
info = {
    "arch": arch,
    "cuda": arch != "cpu",
    "generator": "cmake",
    "cmake": subprocess.run(["cmake", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
    "nvcc": nvcc.strip() or None,
    "cxx": gxx,
    "commands": cmds,
    "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
}
json.dump(info, open(f"{out}/build_info.json", "w"), indent=2)
PY
echo "build: ok: $out/libkdtree.so ($arch, cmake), compile lines in $out/build_info.json"
