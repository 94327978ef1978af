from flare.instrumentation.flight_recorder import entry_bytes, op_name
from flare.instrumentation.python_calls import parse_entry
from flare.wire.bandwidth import bus_factor, busbw_gbps


def test_bus_factors_follow_the_nccl_tests_convention():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather_into_tensor", 8) == 7
    assert bus_factor("reduce_scatter_tensor", 4) == 3
    assert bus_factor("broadcast", 8) == 1
    assert busbw_gbps("all_reduce", 1_000_000_000, 2, 1_000_000_000) == 1.0
    assert busbw_gbps("all_reduce", 10, 2, 0) is None


def test_flight_recorder_entries_map_to_torch_names_and_sizes():
    assert op_name("gloo:all_reduce") == "all_reduce"
    assert op_name("nccl:_allgather_base") == "all_gather_into_tensor"
    assert op_name("nccl:allreduce") == "all_reduce"
    entry = {"input_sizes": [[4, 8], [2]], "input_dtypes": ["Float", "BFloat16"]}
    assert entry_bytes(entry) == 4 * 8 * 4 + 2 * 2


def test_traced_function_entries_are_parsed_strictly():
    assert parse_entry("pkg.mod:Class.method") == ("pkg.mod", "Class.method")
    assert parse_entry(" json : dumps ") == ("json", "dumps")
    for bad in ("nocolon", ":f", "m:", "m:a-b", "m:a..b"):
        assert parse_entry(bad) is None


def test_a_full_ring_newer_than_the_step_start_means_entries_were_overwritten(monkeypatch):
    from flare.instrumentation.flight_recorder import FlightRecorder
    from flare.wire import semconv

    monkeypatch.setenv(semconv.ENV_FR_BUFFER_SIZE, "3")
    ring = [{"time_created_ns": t} for t in (100, 110, 120)]
    assert FlightRecorder.overwrote(ring, since_ns=90)  # full, and the step began earlier
    assert not FlightRecorder.overwrote(ring, since_ns=100)  # the step's first one is kept
    assert not FlightRecorder.overwrote(ring[:2], since_ns=90)  # not full: nothing lost
    assert not FlightRecorder.overwrote([], since_ns=90)
    monkeypatch.setenv(semconv.ENV_FR_BUFFER_SIZE, "many")
    assert not FlightRecorder.overwrote(ring, since_ns=90)
