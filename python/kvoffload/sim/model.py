"""The simulator's request model: what one serving request asks of the KV-offloading tier.

A request has an arrival time, the block hashes of its prompt (one list per KV group) and an output
length. Its keys are ``make_offload_key(block_hash, group)``; block ``i`` of a group ends at token
``(i + 1) * block_tokens``, and a request's keys are ordered by that end token, then group (the
order an engine walks them in). Output blocks are computed during decode; their hashes are given
(a multi-turn workload needs them, since the next turn's prompt repeats them) or derived from the
last prompt hash with `output_block_hash`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvoffload.types import make_offload_key

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "RequestKeys",
    "SimRequest",
    "chain_hash",
    "output_block_hash",
]

#: Tokens per KV block (vLLM's default block size); a chunk holds one block of one KV group.
DEFAULT_BLOCK_TOKENS = 16

_ROOT = bytes(32)


def chain_hash(parent: bytes | None, content: bytes) -> bytes:
    """A 32-byte prefix-chain block hash: blake2b over the parent hash and the block's content."""
    return hashlib.blake2b((parent or _ROOT) + content, digest_size=32).digest()


def output_block_hash(req_id: str, parent: bytes | None, index: int) -> bytes:
    """The hash of a request's ``index``-th output block when the workload does not give it."""
    return chain_hash(parent, b"out:%s:%d" % (req_id.encode(), index))


@dataclass(frozen=True)
class SimRequest:
    """One request of a workload (see the module docstring)."""

    req_id: str
    #: Seconds since the start of the workload.
    arrival: float
    #: Prompt block hashes, one tuple per KV group (group ``g`` is ``block_hashes[g]``).
    block_hashes: tuple[tuple[bytes, ...], ...]
    #: Tokens generated after the prompt: the decode time and, without ``output_hashes``, the
    #: number of full output blocks.
    output_tokens: int = 0
    #: Hashes of the full output blocks, per KV group (all stored, whatever ``output_tokens``
    #: says); None derives them (`output_block_hash`).
    output_hashes: tuple[tuple[bytes, ...], ...] | None = None

    @property
    def kv_groups(self) -> int:
        """Number of KV groups."""
        return len(self.block_hashes)

    def prompt_blocks(self) -> int:
        """Blocks of the longest group's prompt."""
        return max((len(g) for g in self.block_hashes), default=0)

    def keys(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> RequestKeys:
        """Build the request's keys, positions and output keys (see `RequestKeys`)."""
        return RequestKeys.of(self, block_tokens)


@dataclass(frozen=True)
class RequestKeys:
    """A request's keys in engine order, with each key's end-token position."""

    prompt: tuple[bytes, ...]
    prompt_positions: tuple[int, ...]
    #: Keys of the full output blocks, in the same order, and their positions.
    output: tuple[bytes, ...]
    output_positions: tuple[int, ...]
    prompt_tokens: int

    @classmethod
    def of(cls, request: SimRequest, block_tokens: int) -> RequestKeys:
        """Order the keys of ``request`` by end token, then KV group."""
        prompt = _ordered(request.block_hashes, block_tokens)
        prompt_tokens = request.prompt_blocks() * block_tokens
        n_out = request.output_tokens // block_tokens
        out_hashes = request.output_hashes
        if out_hashes is None:
            out_hashes = tuple(
                _derived_output(request.req_id, group, n_out) for group in request.block_hashes
            )
        start = [len(g) for g in request.block_hashes]
        output = _ordered(out_hashes, block_tokens, start)
        return cls(
            prompt=tuple(k for _, k in prompt),
            prompt_positions=tuple(p for p, _ in prompt),
            output=tuple(k for _, k in output),
            output_positions=tuple(p for p, _ in output),
            prompt_tokens=prompt_tokens,
        )


def _derived_output(req_id: str, group: tuple[bytes, ...], n: int) -> tuple[bytes, ...]:
    hashes: list[bytes] = []
    parent = group[-1] if group else None
    for i in range(n):
        parent = output_block_hash(req_id, parent, i)
        hashes.append(parent)
    return tuple(hashes)


def _ordered(
    groups: tuple[tuple[bytes, ...], ...],
    block_tokens: int,
    start: list[int] | None = None,
) -> list[tuple[int, bytes]]:
    """(end token, key) pairs of every block of every group, by end token then group."""
    pairs: list[tuple[int, int, bytes]] = []
    for g, hashes in enumerate(groups):
        first = start[g] if start is not None else 0
        for i, h in enumerate(hashes):
            pairs.append(((first + i + 1) * block_tokens, g, make_offload_key(h, g)))
    pairs.sort(key=lambda t: (t[0], t[1]))
    return [(p, k) for p, _, k in pairs]
