"""Seeded workload generators for the simulator: chat, RAG, agentic loops and Zipf prefixes.

Each generator returns requests sorted by arrival; the same arguments always give the same
requests. Block hashes are prefix-chain hashes (`chain_hash`), so two requests share a key exactly
when they share the whole prefix up to that block, as in vLLM's prefix caching.

- ``chat``: multi-turn conversations over shared system prompts; the requests of
  `kvoffload.workload.generate` (the ``kvoffload bench`` workload) with arrival times added: new
  conversations arrive as a Poisson process, a follow-up turn a think time after the previous one.
- ``rag``: a shared system prompt, then ``docs_per_request`` documents drawn Zipf-popular from a
  pool (in retrieval order), then a short question.
- ``agent``: tool loops: each step's prompt is the whole session so far (system prompt, task,
  earlier actions and tool results); steps follow each other after a tool latency.
- ``zipf``: one of ``prefixes`` long prefixes drawn by a Zipf law, then a unique suffix.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload.errors import InvalidArgumentError
from kvoffload.sim.model import DEFAULT_BLOCK_TOKENS, SimRequest, chain_hash
from kvoffload.workload import WorkloadConfig, generate

__all__ = ["GENERATORS", "GeneratorConfig", "generate_workload"]


@dataclass(frozen=True)
class GeneratorConfig:
    """Knobs shared by every generator; the rest are fixed per generator (see the module doc)."""

    requests: int = 2000
    seed: int = 0
    kv_groups: int = 1
    #: Mean arrival rate of requests, per s: chat, rag and zipf draw each request's arrival from a
    #: Poisson process of this rate (a chat follow-up comes no sooner than 5-60 s after the turn
    #: before it); agent sessions start at ``rate / 8`` and make about 8 requests each.
    rate: float = 4.0
    #: Zipf exponent of popularity, >= 0 (rag's documents, agent's tool prompts, zipf's
    #: prefixes, zipf-objects' objects); chat keeps the ``kvoffload bench`` workload's exponent 1.
    alpha: float = 1.0


#: Draws of a document already chosen after which rag takes the most popular ones left. Each
#: draw repeats one of at most 3 documents: with the default exponent of 1 the odds of 1,000
#: repeats for one request are below 10**-540, with an exponent of 3 below 10**-5.
_MAX_REPEATS = 1000


def _zipf_weights(n: int, alpha: float) -> list[float]:
    return [_zipf_weight(rank, alpha) for rank in range(1, n + 1)]


def _zipf_weight(rank: int, alpha: float) -> float:
    try:
        weight: float = 1.0 / (rank**alpha)
    except OverflowError:  # rank**alpha is beyond a float: the weight is 0 at float precision
        weight = 0.0
    return weight


def _extend(hashes: list[bytes], tag: bytes, n: int) -> None:
    """Append ``n`` blocks whose contents are ``tag`` and their index (chained on ``hashes``)."""
    parent = hashes[-1] if hashes else None
    for i in range(n):
        parent = chain_hash(parent, b"%s:%d" % (tag, i))
        hashes.append(parent)


def _request(
    req_id: str,
    arrival: float,
    prompt: list[bytes],
    output: list[bytes],
    groups: int,
) -> SimRequest:
    # Every KV group holds the same blocks (as in vLLM's full-attention groups).
    return SimRequest(
        req_id=req_id,
        arrival=arrival,
        block_hashes=tuple(tuple(prompt) for _ in range(groups)),
        output_tokens=len(output) * DEFAULT_BLOCK_TOKENS,
        output_hashes=tuple(tuple(output) for _ in range(groups)),
    )


def chat(cfg: GeneratorConfig) -> list[SimRequest]:
    """Multi-turn chat with shared system prompts (the ``kvoffload bench`` workload)."""
    rng = random.Random(cfg.seed ^ 0x5EED)
    wl = generate(WorkloadConfig(requests=cfg.requests, seed=cfg.seed, kv_groups=1))
    arrivals: list[float] = []
    clock = 0.0
    out: list[SimRequest] = []
    for spec in wl.requests:
        clock += rng.expovariate(cfg.rate)
        arrival = clock
        if spec.after is not None:
            arrival = max(arrival, arrivals[spec.after] + rng.uniform(5.0, 60.0))
        arrivals.append(arrival)
        hashes = [key[:-4] for key in spec.keys]
        out.append(
            _request(
                spec.req_id,
                arrival,
                hashes[: spec.prompt_blocks],
                hashes[spec.prompt_blocks :],
                cfg.kv_groups,
            )
        )
    out.sort(key=lambda r: r.arrival)
    return out


def rag(cfg: GeneratorConfig) -> list[SimRequest]:
    """RAG over a shared document pool (see the module docstring)."""
    rng = random.Random(cfg.seed)
    pool = 400
    weights = _zipf_weights(pool, cfg.alpha)
    doc_blocks = [rng.randint(8, 48) for _ in range(pool)]
    system: list[bytes] = []
    _extend(system, b"rag-system", 24)
    clock = 0.0
    out: list[SimRequest] = []
    for idx in range(cfg.requests):
        clock += rng.expovariate(cfg.rate)
        docs: list[int] = []
        repeats = 0
        while len(docs) < 4:
            (doc,) = rng.choices(range(pool), weights=weights)
            if doc not in docs:
                docs.append(doc)
            elif (repeats := repeats + 1) == _MAX_REPEATS:
                # A steep exponent: the documents left weigh next to nothing (the draws could go
                # on for ages); take the most popular of them.
                docs += [d for d in range(pool) if d not in docs][: 4 - len(docs)]
        prompt = list(system)
        for doc in docs:
            _extend(prompt, b"doc%d" % doc, doc_blocks[doc])
        _extend(prompt, b"question%d" % idx, rng.randint(1, 4))
        output: list[bytes] = []
        _extend(output, b"answer%d" % idx, rng.randint(1, 16))
        out.append(_request(f"rag-{idx}", clock, prompt, output, cfg.kv_groups))
    return out


def agent(cfg: GeneratorConfig) -> list[SimRequest]:
    """Agentic tool loops (see the module docstring)."""
    rng = random.Random(cfg.seed)
    tools: list[list[bytes]] = [[] for _ in range(6)]
    for i, prompt in enumerate(tools):
        _extend(prompt, b"tools%d" % i, rng.randint(32, 128))
    weights = _zipf_weights(len(tools), cfg.alpha)
    out: list[SimRequest] = []
    clock = 0.0
    session = 0
    while len(out) < cfg.requests:
        clock += rng.expovariate(cfg.rate / 8)  # a session makes about 8 requests
        context = list(rng.choices(tools, weights=weights)[0])
        _extend(context, b"task%d" % session, rng.randint(2, 12))
        when = clock
        for step in range(rng.randint(3, 14)):
            if len(out) == cfg.requests:
                break
            chained = [context[-1]]  # the action continues the context
            _extend(chained, b"s%d-action%d" % (session, step), rng.randint(1, 4))
            action = chained[1:]
            req_id = f"agent-{session}-{step}"
            out.append(_request(req_id, when, context, action, cfg.kv_groups))
            context += action
            _extend(context, b"s%d-tool%d" % (session, step), rng.randint(1, 24))
            when += rng.uniform(0.5, 4.0)
        session += 1
    out.sort(key=lambda r: r.arrival)
    return out


def zipf(cfg: GeneratorConfig) -> list[SimRequest]:
    """Zipf-popular shared prefixes with unique suffixes (see the module docstring)."""
    rng = random.Random(cfg.seed)
    prefixes: list[list[bytes]] = []
    for i in range(200):
        prefix: list[bytes] = []
        _extend(prefix, b"prefix%d" % i, rng.randint(16, 96))
        prefixes.append(prefix)
    weights = _zipf_weights(len(prefixes), cfg.alpha)
    clock = 0.0
    out: list[SimRequest] = []
    for idx in range(cfg.requests):
        clock += rng.expovariate(cfg.rate)
        prompt = list(rng.choices(prefixes, weights=weights)[0])
        _extend(prompt, b"suffix%d" % idx, rng.randint(1, 16))
        output: list[bytes] = []
        _extend(output, b"zout%d" % idx, rng.randint(0, 8))
        out.append(_request(f"zipf-{idx}", clock, prompt, output, cfg.kv_groups))
    return out


def check_alpha(alpha: float) -> None:
    """Refuse a Zipf exponent that is negative or not finite."""
    if not (math.isfinite(alpha) and alpha >= 0):
        raise InvalidArgumentError(f"alpha, the Zipf exponent, must be a number >= 0, got {alpha}")


#: Generators by name.
GENERATORS: dict[str, Callable[[GeneratorConfig], list[SimRequest]]] = {
    "chat": chat,
    "rag": rag,
    "agent": agent,
    "zipf": zipf,
}


def generate_workload(name: str, cfg: GeneratorConfig | None = None) -> list[SimRequest]:
    """Run the generator ``name`` (a key of `GENERATORS`) with ``cfg`` (defaults if None)."""
    cfg = cfg or GeneratorConfig()
    if name not in GENERATORS:
        raise InvalidArgumentError(f"unknown workload {name!r}: use one of {sorted(GENERATORS)}")
    if cfg.requests < 0 or cfg.kv_groups < 1 or not cfg.rate > 0:
        raise InvalidArgumentError("requests must be >= 0, kv_groups >= 1 and rate > 0")
    check_alpha(cfg.alpha)
    return GENERATORS[name](cfg)
