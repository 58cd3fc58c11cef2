#!/usr/bin/env bash
# Make the Python environment pdeformer runs in; `make setup` (and so `make run`,
# `make test`) calls this. Idempotent: a second call only checks and returns.
#
# 1. Find a Python that imports dolfinx, petsc4py and mpi4py:
#    $PDEFORMER_PYTHON if set, else `python3` on PATH (a cluster module, conda, spack),
#    else /usr/bin/python3 (the candidates can be replaced by $PDEFORMER_SETUP_CANDIDATES). If none can and this is Debian with root, install the Debian
#    packages below and use /usr/bin/python3; without root, say what to install.
# 2. Build the venv .venv from that Python with --system-site-packages; a venv made by
#    another Python (the other Debian release, a different module) is rebuilt.
# 3. Install pdeformer editable into it (console script `pdeformer`), with pip barred
#    from touching numpy, mpi4py and petsc4py (no deps, and a constraints file).
# On Debian the BLAS is OpenBLAS (libopenblas0-pthread): the attention kernel is matrix
# products, several times faster than with the reference BLAS.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
DEBIAN_PACKAGES=(python3-dolfinx-real python3-petsc4py-real python3-mpi4py openmpi-bin
                 python3-venv python3-pip python3-setuptools python3-pytest python3-pytest-xdist python3-scipy
                 python3-h5py python3-matplotlib python3-dev gcc libc6-dev git
                 libopenblas0-pthread)
say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 2; }

# a Python that imports dolfinx, petsc4py and mpi4py prints "executable version dolfinx-version"
probe() { "$1" -c 'import sys, dolfinx, petsc4py, mpi4py; print(sys.executable, sys.version.split()[0], dolfinx.__version__)' 2>/dev/null; }
on_debian() { [ -f /etc/debian_version ] && command -v apt-get >/dev/null && command -v dpkg-query >/dev/null; }
is_root() { [ "$(id -u)" = 0 ]; }

missing_debian_packages() {
  local p missing=()
  for p in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  echo "${missing[@]:-}"
}

install_debian_packages() {
  local missing
  missing=$(missing_debian_packages)
  [ -n "$missing" ] || return 0
  say "installing Debian packages: $missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || die "apt-get update failed"
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $missing >/dev/null \
    || die "apt-get install $missing failed"
}

# ---- 1. the base Python -------------------------------------------------------------
base="" base_id=""
if [ -n "${PDEFORMER_PYTHON:-}" ]; then
  base_id=$(probe "$PDEFORMER_PYTHON") || die "PDEFORMER_PYTHON=$PDEFORMER_PYTHON cannot import dolfinx, petsc4py and mpi4py"
  base=$PDEFORMER_PYTHON
else
  for cand in ${PDEFORMER_SETUP_CANDIDATES:-python3 /usr/bin/python3}; do
    exe=$(command -v "$cand" 2>/dev/null) || continue
    case "$exe" in "$PWD/$VENV"/*) continue ;; esac
    if base_id=$(probe "$exe"); then base=$exe; break; fi
  done
fi
if [ -z "$base" ] || [ "$base" = /usr/bin/python3 ]; then
  # Debian's dolfinx (or none yet): the Debian packages are the dependencies.
  if on_debian && is_root; then
    install_debian_packages
    base=/usr/bin/python3
  elif [ -z "$base" ]; then
    if on_debian; then
      die "dolfinx not found. Install it as root:  apt-get install ${DEBIAN_PACKAGES[*]}  (or load a dolfinx module / conda env, or set PDEFORMER_PYTHON), then run this again"
    fi
    die "dolfinx not found. Install dolfinx (tested: 0.5 and 0.9) with petsc4py and mpi4py (e.g. conda install -c conda-forge fenics-dolfinx mpich pytest, or your cluster's module), make it importable by python3 or set PDEFORMER_PYTHON, then run this again"
  else
    missing=$(missing_debian_packages)
    [ -z "$missing" ] || say "warning: Debian packages missing (need root to install): $missing"
  fi
fi
[ -n "$base_id" ] || base_id=$(probe "$base") || die "$base cannot import dolfinx, petsc4py and mpi4py"
base=$("$base" -c 'import sys; print(sys.executable)')

# ---- 2. the venv ----------------------------------------------------------------------
stamp="$VENV/.pdeformer-setup"
if [ -d "$VENV" ]; then
  venv_id=$("$VENV/bin/python" -c 'import sys, dolfinx; print(sys._base_executable if hasattr(sys, "_base_executable") else sys.executable, sys.version.split()[0], dolfinx.__version__)' 2>/dev/null || true)
  recorded=$(head -n 1 "$stamp" 2>/dev/null || true)
  if [ "$recorded" != "$base_id" ] || [ -z "$venv_id" ]; then
    say "rebuilding $VENV (made by another Python: '${recorded:-unknown}', now '$base_id')"
    rm -rf "$VENV"
  fi
fi
if [ ! -d "$VENV" ]; then
  say "creating $VENV from $base (--system-site-packages)"
  "$base" -m venv --system-site-packages "$VENV" || die "'$base -m venv' failed (Debian: apt-get install python3-venv)"
fi
py="$VENV/bin/python"

# ---- 3. pdeformer, editable -----------------------------------------------------------
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ -x "$VENV/bin/pdeformer" ] \
   && "$py" -c 'import pdeformer, pytest' >/dev/null 2>&1; then
  exit 0
fi
# numpy, mpi4py and petsc4py stay exactly as the base Python has them.
"$py" - >"$VENV/constraints.txt" <<'PY'
import importlib.metadata as md
for name in ("numpy", "mpi4py", "petsc4py"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
pipi() { PIP_CONSTRAINT="$VENV/constraints.txt" "$py" -m pip install -q --disable-pip-version-check "$@"; }
say "installing pdeformer (editable) into $VENV"
pipi --no-deps --no-build-isolation -e . || die "pip install -e . failed"
if ! "$py" -c 'import pytest' >/dev/null 2>&1; then
  say "installing pytest into $VENV"
  pipi pytest || die "could not install pytest"
fi
"$py" -c 'import pdeformer' || die "pdeformer does not import in $VENV"
echo "$base_id" >"$stamp"
say "ready: $VENV ($("$py" -c 'import sys, dolfinx, petsc4py; print("Python", sys.version.split()[0], "dolfinx", dolfinx.__version__, "petsc4py", petsc4py.__version__)'))"
