"""``kvsim validate``: check any scenario file by its ``schema`` without running it.

One table maps each schema of :data:`~sim.io.scenario.SCHEMAS` to the reader
that validates it and a one-line description (run/1, model/1, hardware/1,
check/1, sweep/1, storage/1).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sim.errors import InputError
from sim.io.check import load_check_file, parse_check
from sim.io.scenario import (
    SCHEMAS,
    group_spec,
    hardware_gpu,
    load_hardware_file,
    load_model_file,
    load_run,
    load_storage_file,
    read_toml,
)
from sim.io.sweepfile import describe_sweep

__all__ = ["validate_file"]


def _describe_model(path: Path) -> str:
    mf = load_model_file(path)
    parts = []
    for g in mf.groups:
        extra = f" W{g.window}" if g.window else (f" C{g.attention_chunk}" if g.attention_chunk else "")
        parts.append(f"{g.kind} bs{g.tokens_per_block}{extra} x{g.layers}")
    spec = [group_spec(g, 1) for g in mf.groups]
    per_block = max(s.shape.bytes_per_block(s.tokens_per_block) for s in spec if s.shape is not None)
    return f"model/1: {mf.name}, {len(mf.groups)} groups ({', '.join(parts)}), {per_block} B per block"


def _describe_hardware(path: Path) -> str:
    hw = load_hardware_file(path)
    fitted = "".join(f", {k} {getattr(hw, k):.3g}" for k in ("mfu", "mbu") if getattr(hw, k) is not None)
    g = hardware_gpu(hw, str(path))
    return (f"hardware/1: {hw.name} (gpu {hw.gpu}: {g.dense_bf16_flops / 1e12:g} TFLOPS, "
            f"{g.hbm_bandwidth_bytes_per_s / 1e12:g} TB/s), HBM {hw.hbm_bytes / 1e9:g} GB, "
            f"H2D {hw.h2d_bandwidth / 1e9:g} GB/s, D2H {hw.d2h_bandwidth / 1e9:g} GB/s{fitted}")


def _describe_storage(path: Path) -> str:
    st = load_storage_file(path)
    return (f"storage/1: {st.name} ({st.kind}), read {st.read_bandwidth / 1e9:g} GB/s, "
            f"write {st.write_bandwidth / 1e9:g} GB/s, {st.latency_s * 1e6:g} us per job, "
            f"{st.concurrency} jobs at once")


def _describe_check(path: Path) -> str:
    batch, items = load_check_file(path, jsonl=path.suffix == ".jsonl")
    for i, item in enumerate(items):
        source = f"{path}[{i}]" if batch else str(path)
        if isinstance(item, dict) and "__error__" in item:
            raise InputError(source, "", str(item["__error__"]))
        parse_check(item, source)
    if batch:
        return f"check/1: {len(items)} scenarios"
    return f"check/1: logic {items[0].get('window_logic', 'both')}, {len(items[0]['groups'])} groups"


def _describe_run(path: Path) -> str:
    return load_run(path).describe()


#: schema -> its reader and one-line description
_DESCRIBE: dict[str, Callable[[Path], str]] = {
    "run/1": _describe_run, "model/1": _describe_model, "hardware/1": _describe_hardware,
    "check/1": _describe_check, "sweep/1": describe_sweep, "storage/1": _describe_storage,
}


def validate_file(path: str | Path) -> str:
    """Validate any scenario file by its ``schema`` and describe it in one line.

    JSON and JSON Lines files are ``check/1`` batches.

    Raises:
        InputError: the file is invalid, or its schema is missing or unknown.
    """
    p = Path(path)
    if p.suffix in (".json", ".jsonl"):
        return _describe_check(p)
    data = read_toml(p)
    schema = data.get("schema")
    allowed = ", ".join(f'"{s}"' for s in SCHEMAS)
    if schema is None:
        raise InputError(str(p), "schema", "missing", allowed)
    if not isinstance(schema, str) or schema not in _DESCRIBE:
        raise InputError(str(p), "schema", f"{schema!r} is not a known schema", allowed)
    return _DESCRIBE[schema](p)
