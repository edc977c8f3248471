#!/usr/bin/env bash
# Build Horovod 0.28.1 (the newest release) from its sdist against the torch already in the venv.
#
# Why a script: the sdist compiles its torch extension as C++14, and torch >= 2.1 headers need
# C++17, so a plain `pip install horovod` fails. We raise the standard to 17 and build with
# --no-build-isolation so the build sees the pinned torch.
# A second patch: horovodrun's argument parser accepts abbreviated options and so rejects
# options of the launched program that are prefixes of its own (the trainer's --timeline is
# "ambiguous" with --timeline-filename); allow_abbrev=False leaves the command line alone.
# A third: across hosts, the Gloo context Horovod builds for the global process set
# (GlooContext::InitializeForProcessSet in horovod/common/gloo/gloo_context.cc) creates its
# device from its own interface field, which nothing ever sets, instead of the interface the
# global context was given (HOROVOD_GLOO_IFACE, from --network-interfaces). An empty interface
# makes Gloo bind whatever the host name resolves to: loopback wherever /etc/hosts maps the
# name to 127.0.x (Ubuntu's default), so a remote rank is told to connect to 127.0.x and the
# job dies with "connect [127.0.1.1]:<port>: Connection refused". The patch hands the global
# context's interface to the process set's context.
# The version becomes 0.28.1+retrain.<patch level>, so an installed build says which patches
# it has (`horovodrun --version`).
# The built wheel is kept in a cache keyed by the torch and Python versions, so a second setup
# on the same machine takes seconds (and the training image's build reuses it: docker/).
# HOROVOD_WHEEL_OUT, when set, gets a copy of the wheel installed (the image's builder stage
# hands it to the final stage that way); with HOROVOD_CACHED_ONLY set, a wheel missing from the
# cache exits 3 instead of being built (the image then installs its compilers first).
set -euo pipefail

PY=${1:-.venv/bin/python}
# cpu: PyTorch + Gloo (this machine, the tests, the local target).
# gpu: PyTorch + NCCL + MPI + Gloo (the training image; needs CUDA, NCCL and OpenMPI present).
FLAVOR=${HOROVOD_FLAVOR:-cpu}
case "$FLAVOR" in
  cpu) build_env=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1) ;;
  # The CUDA and NCCL are whatever HOROVOD_CUDA_HOME and HOROVOD_NCCL_HOME name: in the image,
  # torch's own (docker/cuda_build_env.py).
  gpu) build_env=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
                  HOROVOD_GPU_OPERATIONS=NCCL) ;;
  *) echo "HOROVOD_FLAVOR must be cpu or gpu, not '$FLAVOR'" >&2; exit 2 ;;
esac
HVD_VERSION=0.28.1
PATCH_LEVEL=p3  # bump when the patches below change, so cached wheels are rebuilt
CACHE_DIR=${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/retrain-horovod-wheels}

if [ -z "${HOROVOD_WHEEL_OUT:-}" ] && FLAVOR=$FLAVOR PATCH_LEVEL=$PATCH_LEVEL "$PY" - <<'PYEOF' 2>/dev/null; then
import os
import horovod
import horovod.torch as hvd
ok = hvd.gloo_built() and horovod.__version__.endswith("+retrain." + os.environ["PATCH_LEVEL"])
if os.environ["FLAVOR"] == "gpu":
    ok = ok and hvd.nccl_built() and hvd.mpi_built()
raise SystemExit(0 if ok else 1)
PYEOF
  echo "horovod: already installed ($FLAVOR)"
  exit 0
fi

key=$("$PY" -c 'import sys, torch; v = torch.__version__.split("+")[0]; print("torch%s-py%d%d" % (v, *sys.version_info[:2]))')
wheel_dir="$CACHE_DIR/$HVD_VERSION-$PATCH_LEVEL-$FLAVOR-$key"
if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  if [ -n "${HOROVOD_CACHED_ONLY:-}" ]; then
    echo "horovod: no cached $FLAVOR wheel for $key in $CACHE_DIR"
    exit 3
  fi
  echo "horovod: building $HVD_VERSION ($FLAVOR) for $key (a few minutes, once per machine)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$work"
  tar -xzf "$work/horovod-$HVD_VERSION.tar.gz" -C "$work"
  src="$work/horovod-$HVD_VERSION"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  sed -i "s/argparse.ArgumentParser(description='Horovod Runner')/argparse.ArgumentParser(description='Horovod Runner', allow_abbrev=False)/" \
    "$src/horovod/runner/launch.py"
  grep -q "allow_abbrev=False" "$src/horovod/runner/launch.py"
  sed -i '/^void GlooContext::InitializeForProcessSet/,/device_attr.iface = gloo_iface_;/ s/^\( *\)device_attr.iface = gloo_iface_;/\1gloo_iface_ = global_context.gloo_iface_;\n\1device_attr.iface = gloo_iface_;/' \
    "$src/horovod/common/gloo/gloo_context.cc"
  grep -q "gloo_iface_ = global_context.gloo_iface_;" "$src/horovod/common/gloo/gloo_context.cc"
  sed -i "s/^__version__ = '$HVD_VERSION'$/__version__ = '$HVD_VERSION+retrain.$PATCH_LEVEL'/" "$src/horovod/__init__.py"
  grep -q "+retrain.$PATCH_LEVEL'" "$src/horovod/__init__.py"
  if [ "$FLAVOR" = gpu ]; then
    # The CUDA runtime linked shared, as NCCL is: the process then holds torch's libcudart
    # only, not a static copy of its own beside it.
    sed -i 's/set(CMAKE_CUDA_RUNTIME_LIBRARY "Static")/set(CMAKE_CUDA_RUNTIME_LIBRARY "Shared")/' "$src/CMakeLists.txt"
    grep -q 'set(CMAKE_CUDA_RUNTIME_LIBRARY "Shared")' "$src/CMakeLists.txt"
  fi
  "$PY" -m pip install --quiet cloudpickle psutil pyyaml packaging setuptools wheel cmake
  mkdir -p "$work/out"
  # Newer toolchains: GCC 13 no longer pulls <string>, <stdexcept> and <cstdint> in through
  # other headers that Horovod's sources rely on, and CMake 4 refuses the
  # cmake_minimum_required of the bundled Gloo; neither setting changes the built code.
  env "${build_env[@]}" HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept" \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip wheel --no-deps --no-build-isolation -w "$work/out" "$src"
  mkdir -p "$wheel_dir"
  # Copy under a temporary name, then rename, so an interrupted copy never looks like a wheel.
  whl=$(ls "$work/out"/horovod-*.whl)
  cp "$whl" "$wheel_dir/.partial"
  mv "$wheel_dir/.partial" "$wheel_dir/$(basename "$whl")"
fi
"$PY" -m pip install --quiet --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
if [ -n "${HOROVOD_WHEEL_OUT:-}" ]; then
  mkdir -p "$HOROVOD_WHEEL_OUT"
  cp "$wheel_dir"/horovod-*.whl "$HOROVOD_WHEEL_OUT"/
fi
"$PY" -m pip install --quiet cloudpickle psutil pyyaml packaging
"$PY" -c 'import horovod, horovod.torch; from horovod.common.util import gloo_built; assert gloo_built(); print("horovod:", horovod.__version__, "with Gloo")'
