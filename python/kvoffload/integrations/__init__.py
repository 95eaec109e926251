"""Adapters that plug kvoffload into inference engines by configuration.

- :mod:`kvoffload.integrations.vllm`: an offloading spec for vLLM 0.33.0 whose scheduler-side
  manager is kvoffload's Rust manager, and Rust cache policies for vLLM's own manager.
- :mod:`kvoffload.integrations.vllm_worker`: ``HostPoolWorker``, vLLM's worker interface over a
  :class:`kvoffload.HostPool` (host-memory KV caches; the vLLM spec builds it on request).

Each adapter imports its engine only when one of its engine-facing classes is first used, so this
package imports without any engine installed.
"""
