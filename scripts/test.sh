#!/usr/bin/env bash
# Install (scripts/setup.sh, idempotent) and run the whole test suite. Extra arguments go to pytest.
# The order is shuffled by pytest-randomly (a dev dependency); the seed is printed first:
# replay an order with --randomly-seed=N, or keep the file order with -p no:randomly.
# The whole suite (no arguments) runs its files in parallel on min(cores, 4) pytest-xdist workers (one
# file per worker at a time, so a module's fixtures are built once; the longest files first, LONGEST_FILES in
# tests/conftest.py, the others in their shuffled order); UNLEARN_TEST_WORKERS=N sets the
# count, 0 runs in this process. (A worker more than cores was measured on 2 cores: pytest 11:49 and 14:26 in two
# fresh-clone runs against 13-14 min with 2 workers; the Ray-cluster tests' workers then compete for the cores.)
# With arguments it runs in this process: under xdist a path that does not exist is not an error, only "no tests
# ran", which would pass as pytest's exit code 5.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh || { echo "setup failed" >&2; exit 1; }
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.torch_extensions}"
workers="${UNLEARN_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
case "$workers" in
  ''|*[!0-9]*) echo "UNLEARN_TEST_WORKERS must be a whole number of workers (0 = one process), got '$workers'" >&2; exit 2;;
esac
[ "$workers" -gt 4 ] && workers=4
parallel=()
# --no-loadscope-reorder: xdist would otherwise hand out the files by their number of tests (most first), over
# the shuffle and LONGEST_FILES, which left the few-test, longest files (the kill audits) for the end
[ "$workers" -ge 2 ] && [ "$#" -eq 0 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "${parallel[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  exit 0
fi
exit "$rc"
