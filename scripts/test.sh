#!/usr/bin/env bash
# Install (scripts/setup.sh, idempotent) and run the whole test suite. Extra arguments go to pytest.
# The order is shuffled by pytest-randomly (a dev dependency); the seed is printed first:
# replay an order with --randomly-seed=N, or keep the file order with -p no:randomly.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh || { echo "setup failed" >&2; exit 1; }
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.torch_extensions}"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  exit 0
fi
exit "$rc"
