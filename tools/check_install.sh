#!/usr/bin/env bash
# The package as a user installs it, away from this checkout (needs PyPI; not part of make test):
#   1. the wheel, with pyproject.toml's ranges alone (no lock), into a fresh venv; the README's
#      Python snippet, exactly as printed, in a fresh interpreter there (no XLA_FLAGS);
#   2. the Colab quickstart on a runtime that has never seen the repository: a venv with only
#      the notebook tools, the notebook and the wheel in an empty folder, as uploaded; its own
#      first cells install the package (DD_NOTEBOOK_TEST=1: the tiny model).
#   bash tools/check_install.sh [WORKDIR]      (~5 min with pip's cache warm)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-/tmp/dd_check_install}"
PYTHON="${PYTHON:-python3}"
rm -rf "$WORK" && mkdir -p "$WORK/dist" "$WORK/run" "$WORK/content"
unset XLA_FLAGS PYTHONPATH
"$PYTHON" -m pip wheel --quiet --no-deps -w "$WORK/dist" "$ROOT"
WHEEL="$(ls "$WORK"/dist/decoupled_diloco-*.whl)"
echo "[check_install] wheel: $WHEEL"

"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install --quiet "$WHEEL"
"$WORK/venv/bin/pip" freeze | grep -E '^(jax|flax|optax|orbax-checkpoint|grain|numpy|protobuf)=='
"$WORK/venv/bin/python" - "$ROOT/README.md" > "$WORK/run/snippet.py" <<'PY'
import re, sys
print(re.findall(r"```python\n(.*?)```", open(sys.argv[1]).read(), flags=re.S)[0])
PY
(cd "$WORK/run" && "$WORK/venv/bin/python" snippet.py)
test -f "$WORK/run/runs/api/report.md"
echo "[check_install] README snippet: ran in a fresh venv from the wheel"

"$PYTHON" -m venv "$WORK/colab"
"$WORK/colab/bin/pip" install --quiet nbclient nbformat ipykernel
cp "$ROOT/experiments/colab/quickstart.ipynb" "$WHEEL" "$WORK/content/"
(cd "$WORK/content" && DD_NOTEBOOK_TEST=1 "$WORK/colab/bin/python" - <<'PY'
import nbformat
from nbclient import NotebookClient

notebook = nbformat.read("quickstart.ipynb", as_version=4)
NotebookClient(notebook, timeout=900, kernel_name="python3").execute()
text = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []))
assert "installing decoupled_diloco from" in text and "global model: eval loss" in text, text
print("[check_install] notebook: installed itself from the uploaded wheel and ran")
PY
)
