#!/usr/bin/env bash
# The framework scenarios (tests/e2e/test_frameworks.py, quiet host) at other releases of
# the trainers than requirements-dev.txt's: opt-in, not in CI (it downloads them).
#
#   tests/compat/check_frameworks.sh "transformers==4.46.3 accelerate==1.0.1 lightning==2.4.0"
#
# An overlay virtual environment under ${FLARE_COMPAT_ROOT:-/tmp/flare-compat}/frameworks
# sees the dev set-up's .venv (torch, Flare editable, pytest) behind its own packages,
# takes the named releases (pip resolves their own dependencies, such as an older
# huggingface-hub, into the overlay only), and runs the scenarios with its interpreter:
# the jobs, the launchers and `flare` all run on those releases. Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: $0 \"PACKAGE==VERSION ...\"" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  echo "$0: no .venv here: run the README's set-up first" >&2
  exit 2
fi
overlay=${FLARE_COMPAT_ROOT:-/tmp/flare-compat}/frameworks
rm -rf "$overlay"
python3 -m venv "$overlay"
dev_site=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
overlay_site=$("$overlay/bin/python" -c "import site; print(site.getsitepackages()[0])")
# (a .pth line that imports runs at start-up: the dev site-packages, with its own .pth
# files, the editable Flare packages among them, comes after the overlay's)
echo "import site; site.addsitedir('$dev_site')" > "$overlay_site/flare-dev.pth"
# shellcheck disable=SC2086
"$overlay/bin/pip" install -q $1
# the dev set-up's console scripts (torchrun, flare, pytest, …) on the overlay's interpreter
for script in .venv/bin/*; do
  name=$(basename "$script")
  if [ ! -e "$overlay/bin/$name" ] && head -1 "$script" | grep -q '^#!.*python'; then
    sed "1s|.*|#!$overlay/bin/python3|" "$script" > "$overlay/bin/$name"
    chmod +x "$overlay/bin/$name"
  fi
done
"$overlay/bin/python" -c "import transformers, accelerate, lightning, torch
print('transformers', transformers.__version__, 'accelerate', accelerate.__version__,
      'lightning', lightning.__version__, 'torch', torch.__version__)"
exec "$overlay/bin/python" -m pytest -p no:cacheprovider -o addopts="-ra --import-mode=importlib" \
  -m host_variant --hosts quiet -p no:rerunfailures tests/e2e/test_frameworks.py
