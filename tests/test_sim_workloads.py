"""kvoffload.sim workloads: seeded generators, the request model, and every trace format."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from kvoffload import InvalidArgumentError, TraceFormatError
from kvoffload.sim import (
    GENERATORS,
    GeneratorConfig,
    ObjectTrace,
    SimRequest,
    generate_workload,
    load_workload,
    read_jsonl,
    read_object_trace,
    write_jsonl,
    write_object_trace,
    zipf_object_trace,
)
from kvoffload.sim.traces import MAX_OUTPUT_TOKENS, CsvColumns, detect_format
from kvoffload.types import get_offload_group_idx


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_seeded(name: str) -> None:
    cfg = GeneratorConfig(requests=60, seed=3)
    a, b = generate_workload(name, cfg), generate_workload(name, cfg)
    assert a == b
    assert len(a) == 60
    assert generate_workload(name, GeneratorConfig(requests=60, seed=4)) != a
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals)
    assert len({r.req_id for r in a}) == 60


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_share_prefixes(name: str) -> None:
    reqs = generate_workload(name, GeneratorConfig(requests=80, seed=1))
    keys = [k for r in reqs for k in r.keys().prompt]
    assert len(set(keys)) < len(keys), "requests of every generator share some blocks"


def test_kv_groups_order_keys_by_position_then_group() -> None:
    (req,) = generate_workload("zipf", GeneratorConfig(requests=1, kv_groups=2))
    keys = req.keys()
    assert len(keys.prompt) == 2 * req.prompt_blocks()
    assert [get_offload_group_idx(k) for k in keys.prompt[:4]] == [0, 1, 0, 1]
    assert keys.prompt_positions[:4] == (16, 16, 32, 32)
    assert keys.prompt_tokens == 16 * req.prompt_blocks()


def test_chat_follow_up_repeats_the_previous_turn() -> None:
    reqs = generate_workload("chat", GeneratorConfig(requests=200, seed=0))
    follow_ups = 0
    for r in reqs:
        whole = r.block_hashes[0] + (r.output_hashes or ((),))[0]
        for other in reqs:
            prompt = other.block_hashes[0]
            if len(prompt) > len(whole) and prompt[: len(whole)] == whole:
                assert other.arrival > r.arrival
                follow_ups += 1
                break
    assert follow_ups > 10


def test_derived_output_hashes_are_stable() -> None:
    req = SimRequest("r", 0.0, ((b"a" * 32, b"b" * 32),), output_tokens=40)
    keys = req.keys()
    assert len(keys.output) == 2  # whole blocks only
    assert keys.output_positions == (48, 64)
    assert req.keys() == keys


def test_unknown_generator_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        generate_workload("nope")


@pytest.mark.parametrize("alpha", [-1.0, -0.01, float("nan"), float("inf")])
def test_zipf_exponent_must_be_a_number_at_least_zero(alpha: float) -> None:
    for name in GENERATORS:
        with pytest.raises(InvalidArgumentError, match="Zipf exponent"):
            generate_workload(name, GeneratorConfig(requests=5, alpha=alpha))
    with pytest.raises(InvalidArgumentError, match="Zipf exponent"):
        zipf_object_trace(5, 5, alpha)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_a_huge_zipf_exponent_puts_everything_on_rank_one(name: str) -> None:
    # rank**alpha beyond a float is a weight of 0, not an OverflowError.
    assert len(generate_workload(name, GeneratorConfig(requests=20, alpha=500.0))) == 20
    assert set(zipf_object_trace(50, 10, 500.0).obj_ids.tolist()) == {1}


# -- JSONL -------------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path: Path) -> None:
    reqs = generate_workload("agent", GeneratorConfig(requests=30, kv_groups=2))
    path = tmp_path / "t.jsonl"
    write_jsonl(reqs, path)
    assert read_jsonl(path) == reqs
    assert load_workload(path) == reqs


def test_jsonl_minimal_record(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"req_id": "b", "arrival": 2, "block_hashes": [["00ff"]]}\n\n'
        '{"req_id": "a", "arrival": 1.5, "block_hashes": [["01", "02"]], "output_tokens": 32}\n'
    )
    a, b = read_jsonl(path)
    assert (a.req_id, b.req_id) == ("a", "b")  # sorted by arrival
    assert a.block_hashes == ((b"\x01", b"\x02"),)
    assert a.output_hashes is None
    assert len(a.keys().output) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"arrival": 0, "block_hashes": [["00"]]}', "missing field 'req_id'"),
        ('{"req_id": 1, "arrival": 0, "block_hashes": [["00"]]}', "req_id must be a string"),
        ('{"req_id": "r", "arrival": -1, "block_hashes": [["00"]]}', "arrival must be"),
        ('{"req_id": "r", "arrival": 0, "block_hashes": ["00"]}', "list of lists"),
        ('{"req_id": "r", "arrival": 0, "block_hashes": [["zz"]]}', "hex strings"),
        ('{"req_id": "r", "arrival": 0, "block_hashes": []}', "at least one KV group"),
        ('{"req_id": "r", "arrival": 0, "block_hashes": [["00"]], "x": 1}', "unknown field"),
        (
            '{"req_id": "r", "arrival": 0, "block_hashes": [["00"]], "output_tokens": 1.5}',
            "output_tokens must be",
        ),
        (
            '{"req_id": "r", "arrival": 0, "block_hashes": [["00"]], "output_tokens": 1000000000}',
            "output_tokens must be an int from 0 to 16,777,216",
        ),
    ],
)
def test_jsonl_malformed(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"req_id": "ok", "arrival": 0, "block_hashes": [["00"]]}\n' + line + "\n")
    with pytest.raises(TraceFormatError, match=message) as info:
        read_jsonl(path)
    assert f"{path}:2" in str(info.value)


def test_jsonl_output_tokens_bound(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    line = '{"req_id": "%s", "arrival": 0, "block_hashes": [["00"]], "output_tokens": %d}\n'
    path.write_text(line % ("a", MAX_OUTPUT_TOKENS))
    assert read_jsonl(path)[0].output_tokens == 2**24
    path.write_text(line % ("a", 0) + line % ("b", MAX_OUTPUT_TOKENS + 1))
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2: output_tokens"):
        read_jsonl(path)


@pytest.mark.parametrize(
    ("name", "content", "where"),
    [
        ("t.jsonl", b'{"req_id": "ok", "arrival": 0, "block_hashes": [["00"]]}\n\xff\n', ":2:"),
        ("t.jsonl", b'{"req_id": "caf\xc3", "arrival": 0, "block_hashes": [["00"]]}\n', ":1:"),
        ("t.txt", b"1\n2\n3\xe9\n", ":3:"),
        ("t.csv", b"1,2,3\r\n1,\x80,3\r\n", ":2:"),
    ],
)
def test_text_trace_that_is_not_utf8(tmp_path: Path, name: str, content: bytes, where: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match="not UTF-8") as info:
        load_workload(path)
    assert str(info.value).startswith(f"{path}{where} not UTF-8 text (byte 0x")


def test_jsonl_duplicate_ids(tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    path.write_text('{"req_id": "r", "arrival": 0, "block_hashes": [["00"]]}\n' * 2)
    with pytest.raises(TraceFormatError, match="duplicate req_id"):
        read_jsonl(path)


# -- object traces ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "name"), [("txt", "t.txt"), ("csv", "t.csv"), ("oracleGeneral", "t.oracleGeneral")]
)
def test_object_trace_round_trip(tmp_path: Path, fmt: str, name: str) -> None:
    trace = ObjectTrace.from_ids([5, 1, 5, 2**64 - 1, 7])
    path = tmp_path / name
    write_object_trace(trace, path, fmt)
    assert detect_format(path) == fmt
    back = read_object_trace(path)
    assert back.obj_ids.tolist() == trace.obj_ids.tolist()
    assert back.sizes.tolist() == [1] * 5
    assert back.num_objects == 4


def test_oracle_general_layout(tmp_path: Path) -> None:
    # uint32 time, uint64 obj_id, uint32 size, int64 next_access_vtime; little-endian, packed.
    path = tmp_path / "x.oracleGeneral"
    path.write_bytes(struct.pack("<IQIq", 7, 42, 4096, -1) + struct.pack("<IQIq", 8, 43, 1, 9))
    trace = read_object_trace(path)
    assert trace.times.tolist() == [7, 8]
    assert trace.obj_ids.tolist() == [42, 43]
    assert trace.sizes.tolist() == [4096, 1]


def test_oracle_general_skips_zero_size_records(tmp_path: Path) -> None:
    # As libCacheSim's reader does (ignore_size_zero_req): a size-0 record is not a request.
    path = tmp_path / "x.oracleGeneral"
    path.write_bytes(struct.pack("<IQIq", 1, 5, 0, -1) + struct.pack("<IQIq", 2, 6, 1, -1))
    assert read_object_trace(path).obj_ids.tolist() == [6]


def test_csv_columns_and_header(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("id;ts\n10;1\n11;2\n10;3\n")
    cols = CsvColumns(obj_id=1, time=2, size=None, delimiter=";", has_header=True)
    trace = read_object_trace(path, csv_columns=cols)
    assert trace.obj_ids.tolist() == [10, 11, 10]
    assert trace.times.tolist() == [1, 2, 3]
    assert trace.sizes.tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("t.txt", b"1\n2\nabc\n", "t.txt:3: object id must be an integer"),
        ("t.txt", b"1\n-4\n", "outside"),
        ("t.csv", b"1,2,3\n1,2\n", "t.csv:2: 2 column"),
        ("t.csv", b"1,x,3\n", "object id must be an integer"),
        ("t.oracleGeneral", b"\0" * 30, "not a whole number of 24-byte"),
        ("t.oracleGeneral", b"\x28\xb5\x2f\xfd" + b"\0" * 20, "zstd"),
        ("t.unknown", b"", "cannot tell the trace format"),
        ("t.oracleGeneral.zst", b"", "zstd"),
    ],
)
def test_object_trace_malformed(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message):
        read_object_trace(path)


def test_trace_error_is_a_value_error() -> None:
    assert issubclass(TraceFormatError, ValueError)


def test_object_trace_from_numpy() -> None:
    trace = ObjectTrace.from_ids(np.arange(4))
    assert len(trace) == 4
    assert json.dumps(trace.obj_ids.tolist()) == "[0, 1, 2, 3]"


def test_groups_of_unequal_length_take_the_longest_prompt() -> None:
    from kvoffload.sim.model import output_block_hash
    from kvoffload.types import make_offload_key

    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    req = SimRequest("r", 0.0, ((a, b, c), (d,)), output_tokens=16)
    assert req.prompt_blocks() == 3
    keys = req.keys()
    assert keys.prompt_tokens == 48
    assert keys.prompt_positions == (16, 16, 32, 48)
    # Output block i of a group follows that group's own prompt, chained on its last hash.
    assert keys.output == (
        make_offload_key(output_block_hash("r", d, 0), 1),
        make_offload_key(output_block_hash("r", c, 0), 0),
    )
    assert keys.output_positions == (32, 64)


def test_csv_without_a_time_column_numbers_the_requests(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("7,100\n8,200\n7,300\n")
    trace = read_object_trace(path, csv_columns=CsvColumns(obj_id=1, time=None, size=2))
    assert trace.times.tolist() == [0, 1, 2]
    assert trace.obj_ids.tolist() == [7, 8, 7]
    assert trace.sizes.tolist() == [100, 200, 300]


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("cluster52.bin", "oracleGeneral"),
        ("W.oracleGeneral.bin", "oracleGeneral"),
        ("a.JSON", "jsonl"),
    ],
)
def test_trace_formats_told_by_name(name: str, fmt: str) -> None:
    assert detect_format(name) == fmt


def test_an_object_id_of_two_to_the_64_is_out_of_range(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text(f"{2**64 - 1}\n{2**64}\n")
    with pytest.raises(TraceFormatError, match=r"t\.txt:2: object id 18446744073709551616 is out"):
        read_object_trace(path)


def test_output_hashes_need_one_list_per_kv_group(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    record = {"req_id": "r", "arrival": 0, "block_hashes": [["00"]], "output_hashes": [[], []]}
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: output_hashes must have one list per"):
        read_jsonl(path)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_output_tokens_are_the_output_blocks_tokens(name: str) -> None:
    reqs = generate_workload(name, GeneratorConfig(requests=80, seed=1, kv_groups=2))
    for r in reqs:
        assert r.output_hashes is not None
        assert r.output_tokens == 16 * len(r.output_hashes[0])
        assert r.output_hashes[0] == r.output_hashes[1]
    if name == "zipf":  # 0 to 8 output blocks: some requests store none
        assert any(not r.output_hashes[0] for r in reqs)  # type: ignore[index]


@pytest.mark.parametrize("name", ["rag", "agent", "zipf"])
def test_requests_arrive_at_about_the_rate(name: str) -> None:
    # About `rate` requests per second (agent: sessions of about 8 requests arrive at rate / 8);
    # seeded, so the figure is the same run to run.
    reqs = generate_workload(name, GeneratorConfig(requests=1500, seed=4, rate=10.0))
    per_s = len(reqs) / reqs[-1].arrival
    assert 6.0 < per_s < 15.0, per_s


def test_generators_refuse_no_kv_group() -> None:
    with pytest.raises(InvalidArgumentError, match="kv_groups >= 1"):
        generate_workload("zipf", GeneratorConfig(requests=5, kv_groups=0))


def test_rag_prompts_hold_four_distinct_documents() -> None:
    from kvoffload.sim.model import chain_hash

    for r in generate_workload("rag", GeneratorConfig(requests=5, seed=2)):
        prompt = r.block_hashes[0]
        docs: list[int] = []
        p = 24  # after the system prompt: documents, block by block, then the question
        while True:
            parent = prompt[p - 1]
            doc = next(
                (d for d in range(400) if chain_hash(parent, b"doc%d:0" % d) == prompt[p]), None
            )
            if doc is None:
                break
            docs.append(doc)
            i, p = 1, p + 1
            while chain_hash(prompt[p - 1], b"doc%d:%d" % (doc, i)) == prompt[p]:
                i, p = i + 1, p + 1
        idx = int(r.req_id.removeprefix("rag-"))
        assert chain_hash(prompt[p - 1], b"question%d:0" % idx) == prompt[p]
        assert len(docs) == len(set(docs)) == 4


def test_a_chat_follow_up_arrives_after_the_conversations_started_before_it() -> None:
    # A follow-up turn is drawn from the conversations live when it is generated: it arrives
    # no earlier than the Poisson arrival of any conversation started before it.
    from kvoffload.workload import WorkloadConfig, generate

    cfg = GeneratorConfig(requests=300, seed=6, rate=0.2)
    arrival = {r.req_id: r.arrival for r in generate_workload("chat", cfg)}
    specs = generate(WorkloadConfig(requests=300, seed=6)).requests
    latest_new = 0.0
    for spec in specs:
        assert arrival[spec.req_id] >= latest_new
        if spec.after is None:
            latest_new = arrival[spec.req_id]
        else:
            assert arrival[spec.req_id] >= arrival[specs[spec.after].req_id] + 5.0


def test_zipf_objects_draws_from_a_tenth_as_many_objects() -> None:
    trace = load_workload("zipf-objects", generator=GeneratorConfig(requests=1000, alpha=0.0))
    assert isinstance(trace, ObjectTrace)
    assert len(trace) == 1000
    ids = trace.obj_ids.tolist()
    assert min(ids) >= 1
    assert max(ids) <= 100
    assert trace.num_objects > 90
