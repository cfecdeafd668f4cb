#!/usr/bin/env bash
# GPU smoke test: random Llama-3-8B-shaped model (bf16) on 2 shoal servers sharing one GPU, greedy
# parity and decode tokens/s vs plain transformers on the same GPU. Prints JSON (bench/gpu_smoke.py).
#
#   bench/gpu_smoke.sh                           # --device cuda --dtype bfloat16, 32 new tokens
#   bench/gpu_smoke.sh --device cpu --tiny       # the same steps on a 4-block toy model, on the CPU
#   bench/gpu_smoke.sh --download-wheels         # on a machine WITH a package registry: fetch the
#                                                # wheels below for an offline Python 3.12 box
#
# Steps: (1) install shoal from this working tree (pip install -e . --no-deps, no build isolation,
# no network needed; falls back to PYTHONPATH), and missing runtime deps (iroh, msgpack, cryptography
# and its cffi, pycparser: what GPU images tend to lack) from wheels in
# ${SHOAL_WHEELS:-bench/wheels} if that folder exists; (2) re-exec itself through scripts/isolated
# (fresh network and PID namespaces with only loopback up, as scripts/test does: iroh's port mapper
# must not probe the network); (3) run python -m bench.gpu_smoke with the given arguments. If $OUT is set, the JSON is
# also written to $OUT/gpu_smoke.json. Needs root (or unprivileged user namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
WHEELS=${SHOAL_WHEELS:-$ROOT/bench/wheels}
# what shoal's serve/client path needs beyond torch, transformers, safetensors and numpy (which GPU
# images have), as pip requirements; the module of each is its name
EXTRA_REQS=("iroh==1.2.0" "msgpack>=1.0" "cryptography>=42" "cffi" "pycparser")
EXTRA_MODULES=("${EXTRA_REQS[@]%%[=<>]*}")

if [ "${1:-}" = "--download-wheels" ]; then
  mkdir -p "$WHEELS"
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_34_x86_64 -d "$WHEELS" "${EXTRA_REQS[@]}"
  ls -l "$WHEELS"
  exit 0
fi

if [ "${SHOAL_SMOKE_INSTALLED:-}" != 1 ]; then
  echo "gpu_smoke: $("$PY" --version) at $(command -v "$PY")" >&2
  find_missing() { "$PY" -c "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" "$@"; }
  core=$(find_missing torch transformers safetensors numpy)
  if [ -n "$core" ]; then
    echo "gpu_smoke: ERROR: $PY lacks $core (this script installs only ${EXTRA_MODULES[*]})" >&2
    exit 3
  fi
  missing=$(find_missing "${EXTRA_MODULES[@]}")
  if [ -n "$missing" ]; then
    reqs=()
    for i in "${!EXTRA_MODULES[@]}"; do
      [[ " $missing " == *" ${EXTRA_MODULES[$i]} "* ]] && reqs+=("${EXTRA_REQS[$i]}")
    done
    echo "gpu_smoke: missing: $missing; installing ${reqs[*]}" >&2
    if [ -d "$WHEELS" ]; then
      "$PY" -m pip install --no-index --find-links "$WHEELS" "${reqs[@]}" >&2 || true
    else
      "$PY" -m pip install "${reqs[@]}" >&2 || true   # works only where a registry is reachable
    fi
    still=$(find_missing "${EXTRA_MODULES[@]}")
    if [ -n "$still" ]; then
      echo "gpu_smoke: ERROR: still missing Python packages: $still" >&2
      echo "gpu_smoke: this machine cannot reach a package registry. On one that can, run" >&2
      echo "gpu_smoke:   bench/gpu_smoke.sh --download-wheels" >&2
      echo "gpu_smoke: (wheels for ${EXTRA_REQS[*]}, Python 3.12, into bench/wheels/) and bring that" >&2
      echo "gpu_smoke: folder along (or point SHOAL_WHEELS at it). iroh 1.2.0 is py3-none-manylinux_2_28_x86_64." >&2
      exit 3
    fi
  fi
  if ! "$PY" -c "import iroh, importlib.metadata as m; v = m.version('iroh'); assert v == '1.2.0', v" 2>/dev/null; then
    echo "gpu_smoke: WARNING: iroh is not version 1.2.0 ($("$PY" -c "import importlib.metadata as m; print(m.version('iroh'))" 2>&1 | tail -1)); shoal pins 1.2.0" >&2
  fi
  if "$PY" -m pip install --no-deps --no-build-isolation -q -e "$ROOT" >&2 2>/tmp/shoal-smoke-pip.log; then
    echo "gpu_smoke: installed shoal from $ROOT (editable)" >&2
  else
    echo "gpu_smoke: pip install -e failed (see /tmp/shoal-smoke-pip.log; no setuptools offline?); using PYTHONPATH=$ROOT" >&2
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export SHOAL_SMOKE_INSTALLED=1
fi

if [ "${SHOAL_LO_ONLY:-}" != 1 ]; then
  exec "$ROOT/scripts/isolated" "$0" "$@"   # checks that only loopback is there (gpu_smoke.py does too)
fi

json_args=()
if [ -n "${OUT:-}" ]; then json_args=(--json "$OUT/gpu_smoke.json"); fi
exec "$PY" -m bench.gpu_smoke "${json_args[@]}" "$@"
