"""kvoffload inside vLLM 0.33.0, selected by configuration (see docs/vllm.md).

Two ways in, both through vLLM's own extension points:

- ``KVOffloadCPUOffloadingSpec``: a subclass of vLLM's ``CPUOffloadingSpec`` whose
  scheduler-side manager is kvoffload's Rust manager (``KVOffloadCPUOffloadingManager``), which
  returns vLLM's own classes (``LookupResult``, ``PrepareStoreOutput``, ``CPULoadStoreSpec``,
  ``OffloadingEvent``, ``OffloadingConnectorStats``, ...). Select it with
  ``kv_connector_extra_config = {"spec_name": "KVOffloadCPUOffloadingSpec",
  "spec_module_path": "kvoffload.integrations.vllm", "cpu_bytes_to_use": ...}``; every other key
  of vLLM's CPU spec keeps its meaning. The worker side is vLLM's unless ``"host_pool":
  "kvoffload"`` is set: then it is ``KVOffloadHostPoolWorker``, which copies between host-memory
  KV caches and a ``kvoffload.HostPool`` (no GPU copies; see ``vllm_worker``).
- ``KVOffloadTieringOffloadingSpec``: a subclass of vLLM's ``TieringOffloadingSpec`` (a CPU
  primary tier and secondary tiers: storage, network, ...) whose primary tier is kvoffload's Rust
  manager (``KVOffloadCPUPrimaryTier``). Select it with ``"spec_name":
  "KVOffloadTieringOffloadingSpec"``; ``secondary_tiers`` and every other key of vLLM's tiering
  spec keep their meaning. The secondary tiers and the orchestration between the tiers are
  vLLM's own.
- ``RustLRU`` and ``RustARC``: vLLM ``CachePolicy`` subclasses backed by kvoffload-core's LRU
  and ARC, for vLLM's own Python manager: ``"eviction_policy": "RustLRU",
  "cache_policy_module_path": "kvoffload.integrations.vllm"``. Likewise kvoffload's other
  built-in policies: ``RustFIFO``, ``RustSIEVE``, ``RustS3FIFO``, ``Rust2Q``, ``RustSLRU``,
  ``RustLFU`` and ``RustARCPaper`` (``RUST_POLICIES`` maps each class name to its policy).

This module imports without vLLM. The classes above are built from vLLM's base classes the first
time they are looked up (module ``__getattr__``), which is when vLLM's factories import them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

from kvoffload import _native
from kvoffload._common import BUILTIN_POLICIES
from kvoffload.errors import InvalidArgumentError, KVOffloadError
from kvoffload.integrations.vllm_worker import HostPoolWorker
from kvoffload.manager import CPUOffloadingManager
from kvoffload.policies import POLICY_METHODS

__all__ = [
    "HOST_POOLS",
    "HOST_POOL_KEY",
    "KVOFFLOAD_POLICIES",
    "RUST_POLICIES",
    "SPEC_MODULE_PATH",
    "SPEC_NAME",
    "TIERING_SPEC_NAME",
    "VLLM_VERSION",
    # Built from vLLM's classes on first access (module __getattr__ below).
    "KVOffloadCPUOffloadingManager",  # noqa: F822
    "KVOffloadCPUOffloadingSpec",  # noqa: F822
    "KVOffloadCPUPrimaryTier",  # noqa: F822
    "KVOffloadHostPoolWorker",  # noqa: F822
    "KVOffloadTieringOffloadingSpec",  # noqa: F822
    "Rust2Q",  # noqa: F822
    "RustARC",  # noqa: F822
    "RustARCPaper",  # noqa: F822
    "RustFIFO",  # noqa: F822
    "RustLFU",  # noqa: F822
    "RustLRU",  # noqa: F822
    "RustS3FIFO",  # noqa: F822
    "RustSIEVE",  # noqa: F822
    "RustSLRU",  # noqa: F822
    "vllm_types",
]

#: The vLLM release this adapter is written and tested against.
VLLM_VERSION = "0.33.0"
#: ``spec_name`` and ``spec_module_path`` of ``kv_connector_extra_config``.
SPEC_NAME = "KVOffloadCPUOffloadingSpec"
#: ``spec_name`` of the tiering spec (a primary tier of kvoffload's and vLLM's secondary tiers).
TIERING_SPEC_NAME = "KVOffloadTieringOffloadingSpec"
SPEC_MODULE_PATH = "kvoffload.integrations.vllm"
#: ``eviction_policy`` values the Rust manager runs itself (vLLM's lru and arc, and kvoffload's
#: own policies); any other policy is run by vLLM's own manager (as ``CPUOffloadingSpec`` would),
#: for example ``RustLRU`` from this module.
KVOFFLOAD_POLICIES = BUILTIN_POLICIES
#: The extra-config key choosing the worker's CPU buffer, and its values: ``"vllm"`` (the
#: default: vLLM's ``CPUOffloadingWorker``) or ``"kvoffload"`` (``KVOffloadHostPoolWorker``).
HOST_POOL_KEY = "host_pool"
HOST_POOLS = ("vllm", "kvoffload")

_MANAGER_MODULE = "vllm.v1.kv_offload.cpu.manager"
_POLICY_BASE_MODULE = "vllm.v1.kv_offload.cpu.policies.base"
_SPEC_MODULE = "vllm.v1.kv_offload.cpu.spec"
_BASE_MODULE = "vllm.v1.kv_offload.base"
_TIERING_SPEC_MODULE = "vllm.v1.kv_offload.tiering.spec"
_TIERING_MANAGER_MODULE = "vllm.v1.kv_offload.tiering.manager"


#: The extra-config key for ``CPUOffloadingManager(pending_write_timeout=...)``.
PENDING_WRITE_TIMEOUT_KEY = "pending_write_timeout"

_built: dict[str, Any] = {}
_log = logging.getLogger(__name__)


def vllm_types() -> types.SimpleNamespace:
    """Return vLLM's result classes, under the names kvoffload's manager looks them up by.

    Taken from the namespace of vLLM's ``cpu/manager.py``, so they are exactly the classes
    vLLM's own manager returns.
    """
    if "types" not in _built:
        m = importlib.import_module(_MANAGER_MODULE)
        _register_context(m.ReqContext)
        _built["types"] = types.SimpleNamespace(
            LookupResult=m.LookupResult,
            PrepareStoreOutput=m.PrepareStoreOutput,
            CPULoadStoreSpec=m.CPULoadStoreSpec,
            OffloadingEvent=m.OffloadingEvent,
            Medium=m.Medium,
            OffloadingStats=m.OffloadingConnectorStats,
            RequestOffloadingContext=m.RequestOffloadingContext,
            CacheHitSource=m.CacheHitSource,
        )
    namespace: types.SimpleNamespace = _built["types"]
    return namespace


def _register_context(cls: type) -> None:
    # vLLM's ReqContext keeps its state and token positions in two plain dicts, as kvoffload's
    # does: the bindings read them directly instead of calling the methods. Only a speed-up, so
    # a class already registered in this process is left in place.
    with contextlib.suppress(KVOffloadError):
        _native.register_context_type(cls)


def _build_manager() -> type:
    vllm_manager_base: Any = importlib.import_module(_BASE_MODULE).OffloadingManager

    class KVOffloadCPUOffloadingManager(CPUOffloadingManager, vllm_manager_base):  # type: ignore[misc]
        """kvoffload's Rust manager as a vLLM ``OffloadingManager`` returning vLLM's classes."""

        _types = vllm_types()

    KVOffloadCPUOffloadingManager.__qualname__ = "KVOffloadCPUOffloadingManager"
    KVOffloadCPUOffloadingManager.__module__ = __name__
    return KVOffloadCPUOffloadingManager


def _build_worker() -> type:
    base: Any = importlib.import_module(_BASE_MODULE)

    class KVOffloadHostPoolWorker(HostPoolWorker, base.OffloadingWorker):  # type: ignore[misc]
        """kvoffload's host-pool worker as a vLLM ``OffloadingWorker`` (host-memory caches only).

        Returns vLLM's ``TransferResult``; see ``kvoffload.integrations.vllm_worker``.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("result_type", base.TransferResult)
            super().__init__(*args, **kwargs)

    KVOffloadHostPoolWorker.__qualname__ = "KVOffloadHostPoolWorker"
    KVOffloadHostPoolWorker.__module__ = __name__
    return KVOffloadHostPoolWorker


def _build_spec() -> type:
    vllm_spec: Any = importlib.import_module(_SPEC_MODULE).CPUOffloadingSpec
    vllm_manager: Any = importlib.import_module(_MANAGER_MODULE).CPUOffloadingManager
    manager_cls = _lookup("KVOffloadCPUOffloadingManager")
    worker_cls = _lookup("KVOffloadHostPoolWorker")

    class KVOffloadCPUOffloadingSpec(vllm_spec):  # type: ignore[misc]
        """vLLM's CPU offloading spec with kvoffload's manager on the scheduler side.

        Sizing (``cpu_bytes_to_use``), metrics and config info are vLLM's. The manager takes
        the same extra-config keys as vLLM's: ``eviction_policy``, ``cache_policy_module_path``,
        ``store_threshold``, ``max_tracker_size``. A policy that is not one of kvoffload's built-in
        names (``lru``, ``arc``, ``sieve``, ...) runs in vLLM's own manager, as with
        ``CPUOffloadingSpec``. kvoffload's own key
        ``pending_write_timeout`` (seconds) turns on the expiry of writes whose completion never
        arrives (kvoffload's manager only). The worker is vLLM's, or with
        ``"host_pool": "kvoffload"`` kvoffload's ``KVOffloadHostPoolWorker``.
        """

        _manager: Any  # set to None by CPUOffloadingSpec.__init__
        _worker: Any  # likewise

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            # Held while the manager or the worker is built on first use: two threads' first
            # calls build one, not two (the worker's pool takes seconds to map; other specs are
            # not held up).
            self._building = threading.Lock()
            self.host_pool = self.extra_config.get(HOST_POOL_KEY, "vllm")
            if self.host_pool not in HOST_POOLS:
                raise InvalidArgumentError(
                    f"{HOST_POOL_KEY} must be one of {HOST_POOLS}, got {self.host_pool!r}"
                )

        def get_worker(self, kv_caches: Any) -> Any:
            """The worker-side transfer engine, built on first use."""
            if self.host_pool == "vllm":
                return super().get_worker(kv_caches)
            with self._building:
                if not self._worker:
                    self._worker = worker_cls.from_spec(self, kv_caches)
                return self._worker

        def get_manager(self) -> Any:
            """The scheduler-side manager, built on first use."""
            with self._building:
                return self._build_manager()

        def _build_manager(self) -> Any:
            if not self._manager:
                extra = self.extra_config
                kwargs: dict[str, Any] = {
                    "num_chunks": self.num_chunks,
                    "cache_policy": self.eviction_policy,
                    "cache_policy_module_path": self.cache_policy_module_path,
                    "enable_events": self.kv_events_config.enable_kv_cache_events,
                    # The defaults of vLLM's CPUOffloadingSpec: no store filter, 64,000 entries,
                    # read with int() as vLLM reads them.
                    "store_threshold": _int_key(extra, "store_threshold", 0),
                    "max_tracker_size": _int_key(extra, "max_tracker_size", 64_000),
                    "info": self.cpu_info,
                }
                expiry = _write_expiry(extra, self.eviction_policy, "manager")
                if self.eviction_policy in KVOFFLOAD_POLICIES:
                    self._manager = manager_cls(**kwargs, **expiry)
                else:
                    self._manager = vllm_manager(**kwargs)
            return self._manager

    KVOffloadCPUOffloadingSpec.__qualname__ = "KVOffloadCPUOffloadingSpec"
    KVOffloadCPUOffloadingSpec.__module__ = __name__
    return KVOffloadCPUOffloadingSpec


def _build_primary_tier() -> type:
    manager_cls = _lookup("KVOffloadCPUOffloadingManager")

    class KVOffloadCPUPrimaryTier(manager_cls):  # type: ignore[misc,valid-type]
        """kvoffload's Rust manager as the CPU primary tier of vLLM's ``TieringOffloadingManager``.

        The interface of vLLM's ``CPUPrimaryTierOffloadingManager``: the manager's calls (the
        GPU's loads and stores), and under the secondary tiers' names, a read of chunks out of
        this tier (``prepare_read``, ``complete_read``) and a write into it (``prepare_write``,
        ``complete_write``: a promotion). A read pins without recording a request access.
        ``mmap_region`` is the scheduler's ``SharedOffloadRegion``: its bytes are what
        ``get_kv_memoryview`` shows the secondary tiers, and ``shutdown`` releases it.
        """

        def __init__(
            self,
            num_chunks: int,
            mmap_region: Any,
            cache_policy: str = "lru",
            cache_policy_module_path: str | None = None,
            enable_events: bool = False,
            info: Any = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(
                num_chunks=num_chunks,
                cache_policy=cache_policy,
                cache_policy_module_path=cache_policy_module_path,
                enable_events=enable_events,
                info=info,
                **kwargs,
            )
            self._mmap_region = mmap_region
            self._kv_memoryview = mmap_region.create_kv_memoryview()
            # The secondary tiers' names for the manager's calls, bound to the same callables
            # (the core's own methods for the hot ones).
            self.complete_read = self.complete_load
            self.prepare_write = self.prepare_store
            self.complete_write = self.complete_store

        def get_kv_memoryview(self) -> memoryview:
            """The region's bytes, one row per chunk (a secondary tier reads chunk c as row c)."""
            view: memoryview = self._kv_memoryview
            return view

        def shutdown(self) -> None:
            """Release the view of the region, then the region."""
            super().shutdown()
            self._kv_memoryview.release()
            self._mmap_region.cleanup()

    KVOffloadCPUPrimaryTier.__qualname__ = "KVOffloadCPUPrimaryTier"
    KVOffloadCPUPrimaryTier.__module__ = __name__
    return KVOffloadCPUPrimaryTier


def _build_tiering_spec() -> type:
    tiering_spec: Any = importlib.import_module(_TIERING_SPEC_MODULE)
    tiering_manager: Any = importlib.import_module(_TIERING_MANAGER_MODULE)
    primary_cls = _lookup("KVOffloadCPUPrimaryTier")

    class KVOffloadTieringOffloadingSpec(tiering_spec.TieringOffloadingSpec):  # type: ignore[misc]
        """vLLM's tiering spec with kvoffload's manager as the CPU primary tier.

        Everything but the primary tier is vLLM's: the shared region, the secondary tiers
        (``secondary_tiers``), the ``TieringOffloadingManager`` that orchestrates them, the
        worker, metrics and config info. The primary tier takes the keys of vLLM's tiering spec
        (``eviction_policy``, ``cache_policy_module_path``; ``store_threshold`` of 2 or more is
        refused, as vLLM refuses it) and kvoffload's ``pending_write_timeout``. A policy that is
        not one of kvoffload's built-in names runs in vLLM's own primary tier.
        """

        _manager: Any  # set to None by TieringOffloadingSpec.__init__

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            # Held while the manager is built on first use: two threads' first calls build one.
            self._building = threading.Lock()

        def get_manager(self) -> Any:
            """The scheduler-side ``TieringOffloadingManager``, built on first use."""
            with self._building:
                if not self._manager:
                    self._manager = self._build_tiering_manager()
                return self._manager

        def _build_tiering_manager(self) -> Any:
            extra = self.extra_config
            if _int_key(extra, "store_threshold", 0) >= 2:
                raise InvalidArgumentError(
                    "store_threshold is not supported by the tiering spec (as in vLLM's)"
                )
            expiry = _write_expiry(extra, self.eviction_policy, "primary tier")
            region = primary = None
            tiers: list[Any] = []
            try:
                # The scheduler's view of the region (rank None) the workers map too.
                region = tiering_spec.SharedOffloadRegion(
                    engine_id=self._engine_id,
                    num_chunks=self.num_chunks,
                    rank=None,
                    kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                    cpu_page_size=self.cpu_page_size_per_worker,
                )
                self._scheduler_mmap = region
                kwargs: dict[str, Any] = {
                    "num_chunks": self.num_chunks,
                    "mmap_region": region,
                    "cache_policy": self.eviction_policy,
                    "cache_policy_module_path": self.cache_policy_module_path,
                    "enable_events": self.kv_events_config.enable_kv_cache_events,
                    "info": self.cpu_info,
                }
                if self.eviction_policy in KVOFFLOAD_POLICIES:
                    primary = primary_cls(**kwargs, **expiry)
                else:
                    primary = tiering_manager.CPUPrimaryTierOffloadingManager(**kwargs)
                view = primary.get_kv_memoryview()
                for tier_config in self.secondary_tier_configs:
                    tiers.append(
                        tiering_spec.SecondaryTierFactory.create_secondary_tier(
                            tier_config, view, self
                        )
                    )
                return tiering_manager.TieringOffloadingManager(
                    primary_tier=primary,
                    secondary_tiers=tiers,
                    tier_poll_interval_s=self.tier_poll_interval_s,
                )
            except BaseException:
                _release(tiers, primary, region)
                self._scheduler_mmap = None
                raise

    KVOffloadTieringOffloadingSpec.__qualname__ = "KVOffloadTieringOffloadingSpec"
    KVOffloadTieringOffloadingSpec.__module__ = __name__
    return KVOffloadTieringOffloadingSpec


def _write_expiry(extra: Any, policy: str, runner: str) -> dict[str, Any]:
    """The constructor keyword of ``pending_write_timeout`` (none when the key is unset).

    A policy kvoffload does not run goes to vLLM's own ``runner``, which has no write expiry:
    the key would be silently ignored there, so it is refused.
    """
    timeout = extra.get(PENDING_WRITE_TIMEOUT_KEY)
    if timeout is None:
        return {}
    if policy not in KVOFFLOAD_POLICIES:
        raise InvalidArgumentError(
            f"{PENDING_WRITE_TIMEOUT_KEY} needs one of kvoffload's built-in policies "
            f"{KVOFFLOAD_POLICIES}, run by kvoffload's {runner}; eviction_policy {policy!r} "
            f"runs in vLLM's {runner}, which has no write expiry"
        )
    return {"pending_write_timeout": timeout}


def _release(tiers: list[Any], primary: Any, region: Any) -> None:
    """Shut down what a failed build made, the last made first.

    The region goes with the primary tier, which releases it, or alone when there is none. Each
    failure is logged; the caller raises the build's error.
    """
    for part in [*reversed(tiers), primary]:
        if part is None:
            continue
        try:
            part.shutdown()
        except Exception:
            _log.exception("shutting down %r after a failed build", part)
    if primary is None and region is not None:
        try:
            region.cleanup()
        except Exception:
            _log.exception("releasing the shared region after a failed build")


def _int_key(extra: Any, name: str, default: int) -> int:
    """Read ``int(extra.get(name, default))``, as vLLM's spec reads the key.

    A value ``int()`` refuses is an `InvalidArgumentError` (a ValueError) naming the key.
    """
    value = extra.get(name, default)
    try:
        return int(value)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}: {e}") from e


def _build_policy(kind: str, name: str) -> type:
    cache_policy: Any = importlib.import_module(_POLICY_BASE_MODULE).CachePolicy
    _register_context(importlib.import_module(_BASE_MODULE).ReqContext)

    class RustPolicy(cache_policy):  # type: ignore[misc]
        # The methods below state the API and satisfy the ABC; __init__ shadows each with the
        # native core's bound method, so a call from vLLM's manager goes straight to Rust (one
        # crossing, no Python frame).

        def __init__(self, cache_capacity: int) -> None:
            super().__init__(cache_capacity)
            # PolicyCore refuses what is not an int in [0, 2**32 - 1] (bools included).
            self._core = _native.PolicyCore(kind, cache_capacity)
            # Each method answered by PolicyCore directly, unless a subclass overrides it (its
            # override must run, and reaches the core through super()).
            cls = type(self)
            for method in POLICY_METHODS:
                if getattr(cls, method) is getattr(RustPolicy, method):
                    setattr(self, method, getattr(self._core, method))

        def get(self, key: bytes) -> Any:
            """The chunk of ``key``, or None."""
            return self._core.get(key)

        def insert(self, key: bytes, chunk: Any, req_context: Any) -> None:
            """Add a newly allocated chunk."""
            self._core.insert(key, chunk, req_context)

        def remove(self, key: bytes) -> None:
            """Forget a pending chunk whose store failed."""
            self._core.remove(key)

        def touch(self, keys: Any, req_context: Any) -> None:
            """Mark chunks as recently used."""
            self._core.touch(keys, req_context)

        def on_store_miss(self, keys: Any, req_context: Any) -> None:
            """Observe keys about to be stored."""
            self._core.on_store_miss(keys, req_context)

        def on_request_access(self, keys: Any, req_context: Any) -> None:
            """Observe keys a request sees for the first time."""
            self._core.on_request_access(keys, req_context)

        def on_request_finished(
            self, key_groups: Any, insertion_only_keys: Any, reused_keys: Any, req_context: Any
        ) -> None:
            """Apply one finished request's accesses, head to tail."""
            self._core.on_request_finished(
                key_groups, insertion_only_keys, reused_keys, req_context
            )

        def evict(self, n: int, protected: Any) -> list[tuple[bytes, Any]] | None:
            """Evict exactly ``n`` unprotected evictable chunks, or nothing (None)."""
            return self._core.evict(n, protected)

        def clear(self) -> None:
            """Forget every chunk and all adaptive state."""
            self._core.clear()

        def mark_evictable(self, key: bytes) -> None:
            """The chunk's ref count became 0."""
            self._core.mark_evictable(key)

        def mark_non_evictable(self, key: bytes) -> None:
            """The chunk's ref count left 0."""
            self._core.mark_non_evictable(key)

        def check_invariants(self) -> None:
            """Raise :class:`kvoffload.InvariantViolation` if the Rust structures disagree."""
            self._core.check_invariants()

        def __len__(self) -> int:
            return len(self._core)

    RustPolicy.__name__ = RustPolicy.__qualname__ = name
    RustPolicy.__module__ = __name__
    RustPolicy.__doc__ = (
        f"vLLM ``CachePolicy`` backed by kvoffload-core's {kind!r} policy (in vLLM's manager, the "
        "same results as kvoffload's manager with that policy; for lru and arc, as vLLM's own)."
    )
    return RustPolicy


#: The ``CachePolicy`` classes for vLLM's manager, by class name: kvoffload-core's policies.
RUST_POLICIES: dict[str, str] = {
    "RustLRU": "lru",
    "RustARC": "arc",
    "RustFIFO": "fifo",
    "RustSIEVE": "sieve",
    "RustS3FIFO": "s3fifo",
    "Rust2Q": "2q",
    "RustSLRU": "slru",
    "RustLFU": "lfu",
    "RustARCPaper": "arc-paper",
}

_BUILDERS: dict[str, Callable[[], type]] = {
    "KVOffloadCPUOffloadingManager": _build_manager,
    "KVOffloadCPUOffloadingSpec": _build_spec,
    "KVOffloadCPUPrimaryTier": _build_primary_tier,
    "KVOffloadTieringOffloadingSpec": _build_tiering_spec,
    "KVOffloadHostPoolWorker": _build_worker,
    **{name: functools.partial(_build_policy, kind, name) for name, kind in RUST_POLICIES.items()},
}


def _check_version() -> None:
    # Only the version of a vLLM already imported (vLLM's own process); importing it here would
    # be slow, and the test oracle's stand-in package has no version.
    version = getattr(sys.modules.get("vllm"), "__version__", None)
    if isinstance(version, str) and version != VLLM_VERSION:
        warnings.warn(
            f"kvoffload.integrations.vllm is written and tested against vLLM {VLLM_VERSION}; "
            f"this is vLLM {version}",
            RuntimeWarning,
            stacklevel=3,
        )


def _lookup(name: str) -> Any:
    if name not in _built:
        _check_version()
        try:
            _built[name] = _BUILDERS[name]()
        except ImportError as e:
            raise ImportError(
                f"kvoffload.integrations.vllm.{name} needs vLLM {VLLM_VERSION} ({e})"
            ) from e
    return _built[name]


def __getattr__(name: str) -> Any:
    if name in _BUILDERS:
        return _lookup(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
