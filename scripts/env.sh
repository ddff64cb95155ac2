# Sourced by the other scripts and by people (`source scripts/env.sh`): make (once) and activate
# Tidepool's Python environment.
#
# The virtual environment lives outside the clone, keyed on the dependency spec
# (pyproject.toml + scripts/constraints.txt), so every clone and CI run on one machine reuses
# the multi-GB torch install; only `pip install -e .` (seconds) is redone, pointing the
# environment at the current clone. Sets $PY.
#
# It leaves the sourcing shell's options alone (an interactive shell must not start exiting on its
# first failing command): each step that can fail is checked, and a failure returns 1 from `source`
# (the scripts, which set -euo pipefail themselves, stop there).
TIDEPOOL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TIDEPOOL_CACHE="${TIDEPOOL_CACHE:-$HOME/.cache/tidepool}"
_key="$(cat "$TIDEPOOL_ROOT/pyproject.toml" "$TIDEPOOL_ROOT/setup.py" "$TIDEPOOL_ROOT/scripts/constraints.txt" | sha256sum | cut -c1-16)"
# TIDEPOOL_VENV (optional) names an existing environment to use instead, e.g. one per working tree
# when several clones are worked on at once (the editable install below points it at this clone).
TIDEPOOL_VENV="${TIDEPOOL_VENV:-$TIDEPOOL_CACHE/venv-$_key}"
if [[ ! -f "$TIDEPOOL_VENV/.complete" ]]; then
  echo "== creating Python environment $TIDEPOOL_VENV (first run on this machine: a few minutes)"
  rm -rf "$TIDEPOOL_VENV"
  if ! { python3 -m venv "$TIDEPOOL_VENV" \
    && "$TIDEPOOL_VENV/bin/pip" install --quiet --upgrade pip "setuptools>=77" \
    && "$TIDEPOOL_VENV/bin/pip" install --quiet -c "$TIDEPOOL_ROOT/scripts/constraints.txt" \
      -e "$TIDEPOOL_ROOT[test,bench]" \
    && touch "$TIDEPOOL_VENV/.complete"; }; then
    echo "scripts/env.sh: creating $TIDEPOOL_VENV failed (see pip's output above)" >&2
    return 1 2>/dev/null || exit 1
  fi
fi
_log="$(mktemp)"
if ! "$TIDEPOOL_VENV/bin/pip" install --quiet --no-deps --no-build-isolation -e "$TIDEPOOL_ROOT" >"$_log" 2>&1; then
  cat "$_log" >&2
  rm -f "$_log"
  return 1 2>/dev/null || exit 1
fi
rm -f "$_log"
# Run tools by their entry points (pytest, ruff, tidepool), never `python -m` from the repo root:
# the current directory would go first on sys.path and `operator/` would shadow the standard library.
PY="$TIDEPOOL_VENV/bin/python"
export PATH="$TIDEPOOL_VENV/bin:$PATH"

# The demo's model: the trained demo target (scripts/demo_models.sh trains the pair once per machine,
# deterministically; instant afterwards). Prints its folder.
demo_model() {
  bash "$TIDEPOOL_ROOT/scripts/demo_models.sh" | head -n1
}
