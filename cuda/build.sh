#!/usr/bin/env bash
# cuda/build.sh: build libkdtree.so, the native test programs and the benchmark program.
#
#   cuda/build.sh --arch <sm_90|sm_90a|sm_120|native|cpu|sm_90a,sm_90,sm_120> --out DIR [--jobs N] [--debug]
#                 [--generator auto|direct|cmake] [--define NAME[=VALUE]]...
#
# --define adds a preprocessor definition to every library source (development switches, e.g.
# KDT_PAR_PROFILE for the parallel tree build's cycle probes: bench/tree_profile.py).
# Compiles go through ccache when it is on PATH (KDT_CCACHE=0: never), from the repository root
# with the paths below it made relative (CCACHE_BASEDIR), so that clones of the same sources in
# different folders share cached objects (the test suite builds many such clones).
# Needs only g++ (and nvcc for a CUDA arch): no cmake. With --generator cmake (or auto when
# cmake and nvcc are present and cuda/CMakeLists.txt exists) the same build goes through CMake.
# Every compile and link line is recorded in DIR/build_info.json (and DIR/compile_commands.txt)
# so that runs can copy them into their manifests.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
arch=""; out=""; jobs=""; debug=0; generator=direct; defines=()

die() { echo "error: build: $*" >&2; exit 4; }
usage() { sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=${2:-}; shift 2 ;;
    --out) out=${2:-}; shift 2 ;;
    --jobs) jobs=${2:-}; shift 2 ;;
    --debug) debug=1; shift ;;
    --generator) generator=${2:-}; shift 2 ;;
    --define)
      [[ "${2:-}" =~ ^[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+-]*)?$ ]] \
        || { echo "error: build: --define: '${2:-}' is not NAME or NAME=VALUE (letters, digits, _ . + -)" >&2; exit 5; }
      defines+=("$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; echo "error: build: unknown argument '$1'" >&2; exit 5 ;;
  esac
done
[ -n "$arch" ] || { usage >&2; echo "error: build: --arch is required" >&2; exit 5; }
[ -n "$out" ] || { usage >&2; echo "error: build: --out is required" >&2; exit 5; }
jobs=${jobs:-$(nproc 2>/dev/null || echo 2)}

# ---- resolve the architecture list -------------------------------------------------------
use_cuda=1
# An arch-specific target (sm_90a: wgmma, setmaxnreg) is compiled only where it is needed, so
# that no kernel exists both as an sm_90 and an sm_90a cubin (which one the driver loads is then
# never a question): sources named *_sm90a.cu get the arch-specific targets alone (their code is
# guarded by __CUDA_ARCH_FEAT_SM90_ALL; without such a target in the list they get the plain
# list and build as stubs); every other source gets the plain targets, and an arch-specific one
# only when its plain twin (sm_90 for sm_90a) is not listed.
gencode=()        # everything listed (the link line, build_info)
gencode_plain=()  # other sources
gencode_feat=()   # *_sm90a.cu
IFS=',' read -r -a archs <<<"$arch"
for a in "${archs[@]}"; do
  case "$a" in
    cpu) use_cuda=0 ;;
    native) gencode+=("-arch=native"); gencode_plain+=("-arch=native") ;;
    sm_[0-9]*a)
      n=${a#sm_}; g="-gencode=arch=compute_${n},code=sm_${n}"
      gencode+=("$g"); gencode_feat+=("$g")
      [[ ",$arch," == *",sm_${n%a},"* ]] || gencode_plain+=("$g") ;;
    sm_[0-9]*)
      n=${a#sm_}; g="-gencode=arch=compute_${n},code=sm_${n}"
      gencode+=("$g"); gencode_plain+=("$g") ;;
    *) echo "error: build: --arch: '$a' is not one of sm_NN, sm_NNa, native, cpu" >&2; exit 5 ;;
  esac
done
[ ${#gencode_feat[@]} -gt 0 ] || gencode_feat=("${gencode_plain[@]}")
if [ "$use_cuda" = 1 ] && [ ${#archs[@]} -gt 1 ] && [[ " ${archs[*]} " == *" cpu "* ]]; then
  echo "error: build: --arch: cpu cannot be combined with GPU architectures" >&2; exit 5
fi
if [ "$use_cuda" = 1 ] && ! command -v nvcc >/dev/null 2>&1; then
  die "--arch $arch needs nvcc, which is not on PATH (install the CUDA toolkit or use --arch cpu)"
fi
command -v g++ >/dev/null 2>&1 || die "g++ is not on PATH"

if [ "$generator" = auto ]; then
  if command -v cmake >/dev/null 2>&1 && [ -f "$here/CMakeLists.txt" ]; then generator=cmake; else generator=direct; fi
fi
if [ "$generator" = cmake ]; then
  [ -f "$here/cmake_build.sh" ] || die "--generator cmake: cuda/cmake_build.sh is missing"
  dbg=(); [ "$debug" = 1 ] && dbg=(--debug)
  defs=(); for d in "${defines[@]}"; do defs+=(--define "$d"); done
  exec bash "$here/cmake_build.sh" --arch "$arch" --out "$out" --jobs "$jobs" "${dbg[@]}" "${defs[@]}"
fi
[ "$generator" = direct ] || { echo "error: build: --generator must be auto, direct or cmake" >&2; exit 5; }

mkdir -p "$out/obj/prog"
out=$(cd "$out" && pwd)
log="$out/compile_commands.txt"
: >"$log"

opt=(-O3); [ "$debug" = 1 ] && opt=(-O0 -g)
cxxflags=("${opt[@]}" -std=c++17 -fPIC -fvisibility=hidden -Wall -Wextra -I"$here/include" -I"$here/src")
nvccflags=("${opt[@]}" -std=c++17 -Xcompiler=-fPIC,-fvisibility=hidden -I"$here/include" -I"$here/src"
           --expt-relaxed-constexpr)
[ "$use_cuda" = 1 ] && cxxflags+=(-DKDT_WITH_CUDA) && nvccflags+=(-DKDT_WITH_CUDA)
for d in "${defines[@]}"; do cxxflags+=("-D$d"); nvccflags+=("-D$d"); done

# ---- compile: one line per source, run in parallel, each recorded -------------------------
cmds=()
objs=()
for src in "$here"/src/*.cpp; do
  [ -e "$src" ] || continue
  obj="$out/obj/$(basename "$src").o"
  if [ "$use_cuda" = 1 ]; then
    cmds+=("nvcc ${nvccflags[*]} ${gencode_plain[*]} -x cu -c $src -o $obj")
  else
    cmds+=("g++ ${cxxflags[*]} -c $src -o $obj")
  fi
  objs+=("$obj")
done
if [ "$use_cuda" = 1 ]; then
  for src in "$here"/src/*.cu; do
    [ -e "$src" ] || continue
    obj="$out/obj/$(basename "$src").o"
    case "$src" in
      *_sm90a.cu) cmds+=("nvcc ${nvccflags[*]} ${gencode_feat[*]} -c $src -o $obj") ;;
      *) cmds+=("nvcc ${nvccflags[*]} ${gencode_plain[*]} -c $src -o $obj") ;;
    esac
    objs+=("$obj")
  done
fi
printf '%s\n' "${cmds[@]}" >>"$log"
launcher=""
if [ "${KDT_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
  launcher=ccache
  export CCACHE_BASEDIR; CCACHE_BASEDIR=$(cd "$here/.." && pwd)
  export CCACHE_NOHASHDIR=true
fi
# run_all PREFIX CMD...: the commands, $jobs at a time from the repository root, each prefixed
# with PREFIX (the launcher, or nothing); false when one fails (it is printed).
run_all() {
  local prefix=$1; shift
  (cd "$here/.." && printf '%s\n' "$@" \
    | xargs -d '\n' -P "$jobs" -I{} bash -c "$prefix"' {} || { echo "error: build: failed: {}" >&2; exit 255; }')
}
echo "build: compiling ${#cmds[@]} sources for --arch $arch with $jobs jobs${launcher:+ (through $launcher)}"
run_all "$launcher" "${cmds[@]}" || die "compilation failed (the failing command is printed above)"

# ---- link the library ----------------------------------------------------------------------
if [ "$use_cuda" = 1 ]; then
  link="nvcc ${opt[*]} -shared ${gencode[*]} -o $out/libkdtree.so ${objs[*]}"
else
  link="g++ ${opt[*]} -shared -o $out/libkdtree.so ${objs[*]} -lpthread"
fi
echo "$link" >>"$log"
$link || die "linking libkdtree.so failed"

# ---- programs: native tests (cuda/tests/*.cpp) and the benchmark (cuda/bench/*.cpp) -------
# Each compiled to an object (through the launcher), then linked.
prog_cmds=()
link_cmds=()
for src in "$here"/tests/*.cpp "$here"/bench/*.cpp; do
  [ -e "$src" ] || continue
  case "$(basename "$src")" in _*) continue ;; esac   # _*.cpp: shared helpers, included
  prog="$out/$(basename "${src%.cpp}")"
  prog_cmds+=("g++ ${cxxflags[*]} -I$here/tests -c $src -o $out/obj/prog/$(basename "$src").o")
  link_cmds+=("g++ ${opt[*]} $out/obj/prog/$(basename "$src").o -o $prog -L$out -lkdtree -Wl,-rpath,\\\$ORIGIN")
done
printf '%s\n' "${prog_cmds[@]}" "${link_cmds[@]}" >>"$log"
if [ ${#prog_cmds[@]} -gt 0 ]; then
  { run_all "$launcher" "${prog_cmds[@]}" && run_all "" "${link_cmds[@]}"; } \
    || die "building the test or benchmark programs failed"
fi

# ---- record what was built and how -------------------------------------------------------------
nvcc_version=$(command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -n 2 | tr '\n' ' ' || echo "")
launcher_version=$([ -n "$launcher" ] && "$launcher" --version | head -n 1 || echo "")
python3 - "$out" "$arch" "$use_cuda" "$nvcc_version" "$log" "$launcher_version" <<'PY'
import json, subprocess, sys, datetime
out, arch, use_cuda, nvcc, log, launcher = sys.argv[1:]
gxx = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
info = {
    "arch": arch,
    "cuda": use_cuda == "1",
    "generator": "direct",
    "nvcc": nvcc.strip() or None,
    "cxx": gxx,
    "launcher": launcher.strip() or None,  # the compiles' cache (ccache), else None
    "commands": [l for l in open(log).read().splitlines() if l.strip()],
    "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
}
json.dump(info, open(f"{out}/build_info.json", "w"), indent=2)
PY
echo "build: ok: $out/libkdtree.so ($arch), compile lines in $out/build_info.json"
