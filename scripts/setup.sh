#!/usr/bin/env bash
# Installs what oomguard needs to build, once per machine, into a cache keyed by version:
# PyTorch from PyPI (the only source of libtorch 2.13 here) in its own venv, and the Debian
# packages the build needs. Links the cache's torch into ./.libtorch for .cargo/config.toml.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=versions.env
. "$ROOT/scripts/versions.env"
CACHE="${OOMGUARD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/oomguard}"
# `setup.sh --torch VERSION`: only that torch's venv (scripts/gpu-kit.sh builds against it);
# it prints the venv's path and links nothing.
ONLY_TORCH=""
if [ "${1:-}" = "--torch" ]; then
  ONLY_TORCH=1
  TORCH_VERSION="${2:?usage: setup.sh [--torch VERSION]}"
fi
VENV="$CACHE/torch-$TORCH_VERSION"

say() { echo "setup: $*" >&2; }
die() { echo "setup: $*" >&2; exit 1; }

# What the build needs and cannot install itself: a C++ compiler, a new-enough Rust, python3.
check_prerequisites() {
  command -v g++ >/dev/null || die "g++ is missing: install it (Debian: apt-get install g++), then run this again"
  command -v python3 >/dev/null || die "python3 is missing: install it (Debian: apt-get install python3 python3-venv)"
  command -v rustc >/dev/null || die "rustc is missing: install Rust with rustup (https://rustup.rs, the default profile: make test needs rustfmt and clippy), then run this again"
  local need have
  need="$(sed -n 's/^rust-version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml")"
  have="$(rustc --version | awk '{print $2}')"
  if [ -n "$need" ] && [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n 1)" != "$need" ]; then
    if command -v rustup >/dev/null; then
      die "rustc $have is older than $need (Cargo.toml's rust-version): run 'rustup update stable'"
    fi
    die "rustc $have is older than $need (Cargo.toml's rust-version), and Debian's packaged Rust is too old: install Rust with rustup (https://rustup.rs), then run this again"
  fi
}

# torch-sys's Python extension and pyo3 compile against python3's Python.h and link its
# libpython: Debian's python3 has them in python3-dev; another Python must bring its own.
check_python_dev() {
  local inc py
  py="$(command -v python3)"
  inc="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  [ -n "$inc" ] && [ -e "$inc/Python.h" ] && return 0
  case "$(readlink -f "$py")" in
    /usr/bin/python3*) apt_install python3-dev "$inc/Python.h" ;;
    *) die "$py has no development headers ($inc/Python.h is missing): install them for that Python, or put Debian's python3 (with apt-get install python3-dev) first on PATH, then run this again" ;;
  esac
}

apt_install() {  # apt_install PACKAGE CHECK_PATH
  [ -e "$2" ] && return 0
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    sudo=sudo
    say "not root: installing Debian package $1 with sudo"
  else
    say "installing Debian package $1"
  fi
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$1" >/dev/null
}

install_torch() {
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock 9  # two clones setting up at once share one install
  [ -f "$VENV/.complete" ] && return 0
  rm -rf "$VENV"
  say "installing torch==$TORCH_VERSION from PyPI into $VENV (about 5 GB, once per machine)"
  python3 -c 'import ensurepip' 2>/dev/null || apt_install python3-venv /usr/lib/python3/dist-packages/ensurepip
  python3 -m venv "$VENV"
  # shellcheck disable=SC2086 # a list of packages
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir "torch==$TORCH_VERSION" $PYTHON_PACKAGES
  echo "$PYTHON_PACKAGES" > "$VENV/.packages"
  touch "$VENV/.complete"
}

# A cache made before a package joined PYTHON_PACKAGES gets it added.
install_python_packages() {
  [ "$(cat "$VENV/.packages" 2>/dev/null)" = "$PYTHON_PACKAGES" ] && return 0
  exec 9>"$CACHE/.lock"
  flock 9
  say "installing $PYTHON_PACKAGES into $VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir $PYTHON_PACKAGES
  echo "$PYTHON_PACKAGES" > "$VENV/.packages"
}

# The development packages (TEST_PYTHON_PACKAGES: maturin, pytest, transformers, ...; then
# TEST_PYTHON_NODEPS without their dependencies), kept out of the image.
install_test_packages() {
  local want="$TEST_PYTHON_PACKAGES $TEST_PYTHON_NODEPS"
  [ "$(cat "$VENV/.test-packages" 2>/dev/null)" = "$want" ] && return 0
  exec 9>"$CACHE/.lock"
  flock 9
  say "installing $want into $VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir $TEST_PYTHON_PACKAGES
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps $TEST_PYTHON_NODEPS
  echo "$want" > "$VENV/.test-packages"
}

# The `oomguard` Python package (python/: the policy crate as an abi3 extension, and the
# Python front) built into a wheel under python/target/wheels and installed into the venv;
# rebuilt only when its sources changed (a hash of them, stamped in the venv). A machine
# without a Rust toolchain can pip-install a wheel built elsewhere.
install_python_package() {
  local hash
  hash="$(cd "$ROOT" && find python/Cargo.toml python/Cargo.lock python/pyproject.toml python/src python/oomguard \
    crates/policy crates/host crates/console crates/runfiles crates/exchange -type f \( -name '*.rs' -o -name '*.py' -o -name '*.toml' -o -name '*.lock' \) \
    -not -path '*/target/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
  local wheels="$ROOT/python/target/wheels"
  # Built for these sources, installed, and this clone has the wheel (tests install it elsewhere).
  if [ "$(cat "$VENV/.oomguard-python" 2>/dev/null)" = "$hash" ] && ls "$wheels"/oomguard-*.whl >/dev/null 2>&1; then
    return 0
  fi
  exec 9>"$CACHE/.lock"
  flock 9
  say "building the oomguard Python package (python/) and installing it into $VENV"
  rm -rf "$wheels"
  (cd "$ROOT/python" && CARGO_TARGET_DIR="$ROOT/python/target" "$VENV/bin/maturin" build --release --quiet -i "$VENV/bin/python" -o "$wheels" >&2)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheels"/oomguard-*.whl
  echo "$hash" > "$VENV/.oomguard-python"
}

check_prerequisites
check_python_dev
apt_install "$GLOO_PACKAGE" "$GLOO_HEADER"
install_torch
install_python_packages
if [ -n "$ONLY_TORCH" ]; then
  echo "$VENV"
  exit 0
fi
install_test_packages
install_python_package
TORCH_DIR="$(ls -d "$VENV"/lib/python3*/site-packages/torch | head -n 1)"
ln -sfn "$TORCH_DIR" "$ROOT/.libtorch"
ln -sfn "$VENV" "$ROOT/.venv"
say "libtorch $TORCH_VERSION at $TORCH_DIR"
