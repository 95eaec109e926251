"""vLLM 0.33.0's own ``CPUOffloadingManager``, importable without torch or the rest of vLLM.

``tools/fetch_vllm.sh`` unpacks the offloading package of the vLLM wheel into ``.oracle/src``. The
manager's import chain reaches a few heavy modules (torch, vLLM's logger, the KV-hints protocol,
the connector metrics module); ``load()`` puts small stand-ins for those in ``sys.modules``, gives
the ``vllm`` packages whose ``__init__`` would import the world empty package objects, and imports
the real manager, policies and ``ReqContext`` from the unpacked tree. The CPU offloading spec
(``cpu/spec.py``) and ``OffloadingSpecFactory`` are imported too: their GPU-side imports (torch,
triton, vLLM's custom ops, the platform, CUDA runtime and shared-memory helpers) get opaque
stand-ins and the platform reports no GPU, so everything scheduler-side runs and nothing on a
device can. The tiering's file system tier names its files through the connector's
canonical-layout module (torch): its stand-in refuses the canonical layout, which the oracle's
configs leave off. Nothing of vLLM is copied here: the stand-ins expose only what is touched.

``state_of(manager)`` reads vLLM's internal state into kvoffload's introspection layout
(``resident``, ``policy_state``, ``tracker_state``, ``pool_state``), for debugging divergences
below the public observables.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
#: Third-party modules vLLM's kv_offload sources import that no stand-in replaces.
_NEEDED_MODULES = ("typing_extensions",)

#: The environment variable naming the oracle directory (its sources are in DIR/src).
ORACLE_ENV = "KVOFFLOAD_VLLM_ORACLE"
#: Where tools/fetch_vllm.sh unpacks a local wheel.
DEFAULT_ORACLE_DIR = Path(__file__).resolve().parent.parent / ".oracle"
#: When set (scripts/test sets it after fetching), a missing oracle fails the vLLM tests.
REQUIRE_ENV = "KVOFFLOAD_REQUIRE_VLLM"


def user_cache_dir() -> Path:
    """Where tools/fetch_vllm.py caches the sources: ${XDG_CACHE_HOME:-~/.cache}/kvoffload."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvoffload" / f"vllm-{VLLM_VERSION}"


_MANAGER_MODULE = "vllm.v1.kv_offload.cpu.manager"
_POLICY_MODULES = ("vllm.v1.kv_offload.cpu.policies.lru", "vllm.v1.kv_offload.cpu.policies.arc")
# Packages whose real __init__ is heavy or not unpacked: they become empty package objects.
_HOLLOW_PACKAGES = (
    "vllm",
    "vllm.v1",
    "vllm.v1.metrics",
    "vllm.utils",
    "vllm.distributed",
    "vllm.distributed.device_communicators",
)
#: Imported after the manager: the spec, its factory and the config dataclasses.
_SPEC_MODULES = (
    "vllm.v1.kv_offload.config",
    "vllm.v1.kv_offload.factory",
    "vllm.v1.kv_offload.cpu.spec",
)
_METRICS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics"
_CANONICAL_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping"


def source_dir() -> Path:
    """The vLLM sources: $KVOFFLOAD_VLLM_ORACLE/src, else .oracle/src, else the user cache."""
    env = os.environ.get(ORACLE_ENV)
    if env:
        return Path(env) / "src"
    local = DEFAULT_ORACLE_DIR / "src"
    if (local / "VLLM_VERSION").is_file():
        return local
    return user_cache_dir() / "src"


def unavailable_reason() -> str | None:
    """Why the oracle cannot be loaded, or None when it can."""
    src = source_dir()
    stamp = src / "VLLM_VERSION"
    needed = ("vllm/v1/kv_offload/cpu/manager.py", _METRICS_MODULE.replace(".", "/") + ".py")
    if not all((src / path).is_file() for path in needed) or not stamp.is_file():
        return (
            f"vLLM {VLLM_VERSION} oracle not unpacked in {src}: run tools/fetch_vllm.py "
            "(its kv_offload files only, ~1.4 MB of range requests), or tools/fetch_vllm.sh "
            "[--wheel PATH] (the whole wheel)"
        )
    found = stamp.read_text().strip()
    if found != VLLM_VERSION:
        return f"oracle in {src} is vLLM {found}, not {VLLM_VERSION}: rerun tools/fetch_vllm.sh"
    loaded = sys.modules.get("vllm")
    if loaded is not None and not getattr(loaded, "__kvoffload_oracle__", False):
        return "a real 'vllm' package is already imported in this process"
    for module in _NEEDED_MODULES:
        if module not in sys.modules and importlib.util.find_spec(module) is None:
            return f"vLLM {VLLM_VERSION}'s sources import {module}: pip install {module}"
    return None


class _QuietLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """vLLM's logger adds ``*_once`` methods; the oracle only needs them to exist."""

    def warning_once(self, msg: str, *args: object, **kwargs: Any) -> None:
        """Log a warning (no deduplication needed here)."""
        self.warning(msg, *args, **kwargs)

    def info_once(self, msg: str, *args: object, **kwargs: Any) -> None:
        """Log an info line."""
        self.info(msg, *args, **kwargs)

    def debug_once(self, msg: str, *args: object, **kwargs: Any) -> None:
        """Log a debug line."""
        self.debug(msg, *args, **kwargs)


def _module(name: str, package_dir: Path | None = None, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__kvoffload_oracle__ = True  # type: ignore[attr-defined]
    # A spec, as imported modules have: `importlib.util.find_spec` raises on a module in
    # sys.modules without one (a stand-in left there by an earlier load that failed).
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package_dir is not None)
    if package_dir is not None:
        module.__path__ = [str(package_dir)]
        module.__spec__.submodule_search_locations = module.__path__
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _stand_ins(src: Path) -> dict[str, types.ModuleType]:
    """Build the modules put in sys.modules before vLLM's own files are imported."""
    mods: dict[str, types.ModuleType] = {}
    for name in _HOLLOW_PACKAGES:
        mods[name] = _module(name, src.joinpath(*name.split(".")))
    # The packages above the connector's metrics module are empty; the module itself (with
    # vLLM's OffloadingConnectorStats) and the connector's base metrics module are vLLM's own.
    # What those reach beyond: vLLM's config classes, the connector factory and Prometheus.
    parts = _METRICS_MODULE.split(".")
    for i in range(2, len(parts)):
        name = ".".join(parts[:i])
        mods[name] = _module(name, src.joinpath(*parts[:i]))
    mods["vllm.config"] = _opaque_module("vllm.config")
    factory = "vllm.distributed.kv_transfer.kv_connector.factory"
    mods[factory] = _opaque_module(factory)
    if importlib.util.find_spec("prometheus_client") is None:
        mods["prometheus_client"] = _opaque_module("prometheus_client")
    mods["vllm.logger"] = _module(
        "vllm.logger",
        init_logger=lambda name: _QuietLogger(logging.getLogger(name), {}),
    )

    def canonical_format_id(kv_cache_layout: str) -> str:
        """The oracle's configs keep the direct layout (``canonical_layout`` off)."""
        raise NotImplementedError("the oracle does not run vLLM's canonical KV layout")

    # vLLM's file system tier names its files with ``file_mapper``, which imports this from the
    # connector's canonical-layout module (torch and the KV-cache specs: left out).
    mods[_CANONICAL_MODULE] = _module(_CANONICAL_MODULE, canonical_format_id=canonical_format_id)

    class KvHintsEnvelope:
        """Placeholder for the KV-hints envelope (only named in annotations)."""

    class KvHintAction:
        """Placeholder for the KV-hint action type."""

    mods["vllm.v1.kv_hints"] = _module(
        "vllm.v1.kv_hints", KvHintsEnvelope=KvHintsEnvelope, KvHintAction=KvHintAction
    )
    return mods


class _OpaqueMeta(type):
    """Placeholder classes whose attributes are placeholder classes (``torch.cuda.Stream``)."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _opaque_class(f"{cls.__name__}.{name}")


def _opaque_class(name: str) -> type:
    return _OpaqueMeta(name, (), {"__init__": lambda self, *args, **kwargs: None})


def _opaque_module(name: str) -> types.ModuleType:
    """A module whose every attribute is a placeholder class (annotations, decorators, names)."""
    module = _module(name)
    made: dict[str, type] = {}

    def attr(attr_name: str) -> type:
        if attr_name.startswith("__"):
            raise AttributeError(attr_name)
        if attr_name not in made:
            made[attr_name] = _opaque_class(attr_name)
        return made[attr_name]

    module.__getattr__ = attr  # type: ignore[method-assign]
    return module


class _NoGpuPlatform:
    """Stand-in for vLLM's ``current_platform`` on a machine without an accelerator."""

    def is_cuda_alike(self) -> bool:
        """No CUDA or ROCm device."""
        return False

    def is_rocm(self) -> bool:
        """Not ROCm."""
        return False

    def is_xpu(self) -> bool:
        """Not XPU."""
        return False


def _gpu_side_stand_ins() -> dict[str, types.ModuleType]:
    """The GPU-side modules cpu/spec.py's worker imports reach (none of them runs here)."""
    return {
        "vllm.platforms": _module("vllm.platforms", current_platform=_NoGpuPlatform()),
        "vllm._custom_ops": _opaque_module("vllm._custom_ops"),
        "vllm.triton_utils": _module(
            "vllm.triton_utils",
            HAS_TRITON=False,
            triton=_opaque_module("triton"),
            tl=_opaque_module("triton.language"),
        ),
        "vllm.utils.torch_utils": _module("vllm.utils.torch_utils", PIN_MEMORY=False),
        "vllm.distributed.device_communicators.shm_broadcast": _opaque_module(
            "vllm.distributed.device_communicators.shm_broadcast"
        ),
        "vllm.distributed.device_communicators.cuda_wrapper": _opaque_module(
            "vllm.distributed.device_communicators.cuda_wrapper"
        ),
    }


class _ByteTensor:
    """numpy stand-in for the one tensor the scheduler side makes.

    That is the bytes of the tiering spec's shared region (``torch.frombuffer``), which its
    primary tier shows the secondary tiers as a memoryview of one row per chunk: zero-copy, as
    vLLM checks.
    """

    def __init__(self, array: Any) -> None:
        self._array = array

    def view(self, *shape: int) -> _ByteTensor:
        """The same bytes in ``shape``."""
        return _ByteTensor(self._array.reshape(shape))

    def numpy(self) -> Any:
        """The array itself (no copy)."""
        return self._array

    def data_ptr(self) -> int:
        """The address of the first byte."""
        return int(self._array.ctypes.data)


def _frombuffer(buffer: Any, dtype: Any) -> _ByteTensor:
    import numpy as np

    return _ByteTensor(np.frombuffer(buffer, dtype=dtype))


def _torch_stand_in() -> types.ModuleType:
    # base.py and the worker modules name torch types in annotations evaluated at import time;
    # the tiering spec's region wraps its mapping in a tensor on the scheduler side too.
    torch = _opaque_module("torch")
    torch.frombuffer = _frombuffer  # type: ignore[attr-defined]
    torch.int8 = "int8"  # type: ignore[attr-defined]
    return torch


@dataclass(frozen=True)
class Oracle:
    """The imported vLLM pieces the differential driver uses."""

    CPUOffloadingManager: type
    ReqContext: type
    base: types.ModuleType
    manager_module: types.ModuleType
    #: ``vllm.v1.kv_offload.config``, ``.factory`` and ``.cpu.spec``.
    config: types.ModuleType
    factory: types.ModuleType
    cpu_spec: types.ModuleType


_loaded: Oracle | None = None


def load() -> Oracle:
    """Import vLLM 0.33.0's manager from the unpacked wheel (once per process)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    src = source_dir()
    for name, module in {**_stand_ins(src), **_gpu_side_stand_ins()}.items():
        sys.modules.setdefault(name, module)
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, sys.modules[name])
    # torch is only needed while base.py is imported; afterwards the real one (if any) or none.
    previous_torch = sys.modules.get("torch")
    if previous_torch is None:
        sys.modules["torch"] = _torch_stand_in()
    try:
        manager_module = importlib.import_module(_MANAGER_MODULE)
        for name in _POLICY_MODULES:  # the policy factory imports these lazily
            importlib.import_module(name)
        base = importlib.import_module("vllm.v1.kv_offload.base")
        config, factory, cpu_spec = (importlib.import_module(name) for name in _SPEC_MODULES)
    finally:
        if previous_torch is None:
            del sys.modules["torch"]
    _loaded = Oracle(
        CPUOffloadingManager=manager_module.CPUOffloadingManager,
        ReqContext=base.ReqContext,
        base=base,
        manager_module=manager_module,
        config=config,
        factory=factory,
        cpu_spec=cpu_spec,
    )
    return _loaded


def offloading_config(
    oracle: Oracle,
    num_chunks: int,
    extra_config: dict[str, Any],
    enable_kv_cache_events: bool = True,
) -> Any:
    """A one-worker, one-group ``OffloadingConfig`` whose CPU spec sizes exactly ``num_chunks``.

    Each chunk takes one page (vLLM aligns chunks to the page size), and ``cpu_bytes_to_use`` is
    set to ``num_chunks`` pages plus a remainder smaller than one (so it is never 0).
    """
    c = oracle.config
    page = oracle.cpu_spec.CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    return c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=page,
        enable_kv_cache_events=enable_kv_cache_events,
        extra_config={"cpu_bytes_to_use": num_chunks * page + page - 1, **extra_config},
        engine_id="engine-0",
        model=c.OffloadingModelConfig(name="model", dtype="float16", max_model_len=4096),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def state_of(manager: Any) -> dict[str, Any]:
    """Read vLLM's internal state into kvoffload's introspection layout (see the driver)."""
    policy = manager._policy
    if hasattr(policy, "t1"):
        entries = {**policy.t1, **policy.t2}
        policy_state: dict[str, Any] = {
            "policy": "arc",
            "t1": list(policy.t1),
            "t2": list(policy.t2),
            "b1": list(policy.b1),
            "b2": list(policy.b2),
            # vLLM's clamps can leave an int here (max(x, 0), min(x, capacity)).
            "target_t1_size": float(policy.target_t1_size),
        }
    else:
        entries = dict(policy.chunks)
        # vLLM pre-increments its counter, so its first rank is 1 where kvoffload's layout
        # (ranks issued from 0, next_rank = the next to issue) has 0: shift by one.
        ranks = {key: (major - 1, minor) for key, (major, minor) in policy._ranks.items()}
        policy_state = {"policy": "lru", "ranks": ranks, "next_rank": policy._next_rank}
    counts = manager.counts
    return {
        "resident": {key: (chunk.chunk_id, chunk.ref_cnt) for key, chunk in entries.items()},
        "policy_state": policy_state,
        "tracker_state": None if counts is None else list(counts.items()),
        "pool_state": (manager._num_allocated_chunks, list(manager._free_list)),
    }


if __name__ == "__main__":
    why = unavailable_reason()
    if why is not None:
        sys.exit(why)
    oracle = load()
    print(f"vLLM {VLLM_VERSION} oracle: {oracle.CPUOffloadingManager} from {source_dir()}")
