#!/usr/bin/env bash
# The package as a user gets it: build the wheel, install it into a fresh venv (its dependencies from
# PyPI), and check that the CLI runs there, that the vLLM plugin entry point is registered and that
# the launcher's bootstrap ships. Everything lives in a temporary directory, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip wheel -q --no-deps . -w "$tmp/dist"
whl=$(ls "$tmp"/dist/speculators_compat-*.whl)
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "$whl"
cd "$tmp"   # not the checkout: the installed package must be the one imported
"$tmp/venv/bin/speculators-compat" doctor > doctor.txt
grep -q "^speculators-compat " doctor.txt || { cat doctor.txt; echo "doctor printed no header"; exit 1; }
"$tmp/venv/bin/python" - <<'PY'
import importlib.metadata as md
import os

import speculators_compat

eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "speculators_compat"]
assert eps and eps[0].value == "speculators_compat.plugin:register", eps
boot = os.path.join(os.path.dirname(speculators_compat.__file__), "bootstrap", "sitecustomize.py")
assert os.path.isfile(boot), boot
assert "site-packages" in speculators_compat.__file__, speculators_compat.__file__
print("wheel ok: it installs into a fresh venv, doctor runs there, the vLLM plugin is registered")
PY
