#!/usr/bin/env bash
# Install a real vLLM release for CPU-only use of its scheduler-side Python
# (core scheduler, KV cache manager, OffloadingConnector scheduler, CPU
# offloading manager), e.g. for scripts/vllm_check.py.
#
# usage: scripts/install-vllm-cpu.sh VERSION [LOCK_FILE] [VENV_DIR]
#   VERSION    vLLM release, e.g. 0.33.0
#   LOCK_FILE  exact dependency pins (default: ../shared/reference/vllm-cpu-lock.txt
#              relative to the repository root)
#   VENV_DIR   where to create the environment (default: /tmp/venv-vllm-VERSION)
#
# Order matters: the CPU build of torch first (from the local wheel folder, never
# the default CUDA build), then vLLM without its dependencies, then the pinned
# dependencies without theirs. Import vLLM with VLLM_TARGET_DEVICE=cpu.
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
version=$1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
lock=${2:-$repo/../shared/reference/vllm-cpu-lock.txt}
venv=${3:-/tmp/venv-vllm-$version}
torch_version=${TORCH_VERSION:-2.13.0}
python=${PYTHON:-python3}

[[ -f $lock ]] || { echo "lock file not found: $lock" >&2; exit 1; }
export VLLM_TARGET_DEVICE=cpu

"$python" -m venv "$venv"
pip="$venv/bin/python -m pip"
# The CPU wheel carries a local version label (+cpu); pinning it keeps pip from
# picking a CUDA build. TORCH_WHEEL may name the wheel file directly; otherwise
# pip finds it through its configured local wheel folder (find-links).
$pip install --no-deps "${TORCH_WHEEL:-torch==${torch_version}+cpu}"
$pip install --no-deps "vllm==$version"
$pip install --no-deps -r "$lock"
# kvsim's own runtime dependencies, so that kvsim runs in this environment with vLLM
# deciding (decisions = "vllm", kvsim fidelity; PYTHONPATH=<repo> or pip install -e <repo>)
$pip install simpy pandas pyarrow matplotlib tomli-w orjson mypy_extensions

VLLM_TARGET_DEVICE=cpu "$venv/bin/python" - <<'PY'
import vllm
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: F401
    OffloadingConnectorScheduler,
)
print("vllm", vllm.__version__, "scheduler side imports on CPU")
PY
echo "installed: $venv (export VLLM_TARGET_DEVICE=cpu before importing vllm)"
