"""The write-ahead log on its own: order, commit, crash tails, budget."""

from __future__ import annotations

import os

import pytest

from flare.collector.wal import SIGNAL_METRICS, SIGNAL_TRACES, WalFull, WriteAheadLog


def _open(directory, committed=0, **kwargs):
    wal = WriteAheadLog(directory, **kwargs)
    wal.open(committed)
    return wal


def test_replay_after_reopen_returns_uncommitted_records_in_order(tmp_path):
    wal = _open(tmp_path, segment_bytes=100, max_bytes=10_000)
    lsns = [wal.append(SIGNAL_TRACES if i % 2 else SIGNAL_METRICS, f"payload-{i}".encode() * 5) for i in range(10)]
    assert lsns == list(range(1, 11))
    assert wal.segment_count > 1  # 100-byte segments rotate
    wal.close()  # as after a kill: nothing committed

    wal = _open(tmp_path, committed=4, segment_bytes=100, max_bytes=10_000)
    records = list(wal.replay(4))
    assert [r.lsn for r in records] == list(range(5, 11))
    assert records[0].payload == b"payload-4" * 5 and records[0].signal == SIGNAL_METRICS
    assert wal.append(SIGNAL_TRACES, b"next") == 11  # numbering continues


def test_commit_deletes_covered_segments_only(tmp_path):
    wal = _open(tmp_path, segment_bytes=64, max_bytes=10_000)
    for _ in range(6):
        wal.append(SIGNAL_TRACES, bytes(50))  # 67-byte records: one per segment
    assert wal.segment_count == 6
    wal.commit(3)
    assert wal.segment_count == 3 and len(list(tmp_path.glob("*.wal"))) == 3
    wal.commit(6)
    assert wal.segment_count == 0 and not list(tmp_path.glob("*.wal"))
    assert wal.append(SIGNAL_TRACES, b"x") == 7


def test_committed_position_survives_an_emptied_log(tmp_path):
    wal = _open(tmp_path)
    for _ in range(3):
        wal.append(SIGNAL_TRACES, b"abc")
    wal.commit(3)
    wal.close()
    wal = _open(tmp_path, committed=3)  # the store says 3 is committed
    assert list(wal.replay(3)) == []
    assert wal.append(SIGNAL_TRACES, b"d") == 4


def test_torn_tail_is_truncated_and_earlier_records_kept(tmp_path):
    wal = _open(tmp_path)
    for i in range(3):
        wal.append(SIGNAL_TRACES, f"r{i}".encode() * 10)
    wal.close()
    (segment,) = tmp_path.glob("*.wal")
    size = segment.stat().st_size
    with open(segment, "ab") as f:
        f.write(b"\x20\x00\x00\x00garbage")  # a header cut short by a crash
    wal = _open(tmp_path)
    assert [r.lsn for r in wal.replay(0)] == [1, 2, 3]
    assert segment.stat().st_size == size and wal.corrupt_records == 1


def test_a_flipped_byte_stops_replay_of_that_segment(tmp_path):
    wal = _open(tmp_path)
    for i in range(3):
        wal.append(SIGNAL_TRACES, f"r{i}".encode() * 10)
    wal.close()
    (segment,) = tmp_path.glob("*.wal")
    data = bytearray(segment.read_bytes())
    record = len(data) // 3
    data[record + 20] ^= 0xFF  # inside the second record's payload
    segment.write_bytes(bytes(data))
    wal = _open(tmp_path)
    assert [r.lsn for r in wal.replay(0)] == [1]
    assert wal.corrupt_records == 1


def test_budget_refuses_instead_of_growing(tmp_path):
    wal = _open(tmp_path, max_bytes=1000, segment_bytes=500)
    appended = 0
    with pytest.raises(WalFull):
        for _ in range(100):
            wal.append(SIGNAL_TRACES, bytes(100))
            appended += 1
    assert appended == 8 and wal.size_bytes <= 1000
    wal.commit(wal.last_lsn)
    wal.append(SIGNAL_TRACES, bytes(100))  # room again after the commit


def test_fsync_mode_writes_the_same_records(tmp_path):
    wal = _open(tmp_path, fsync=True)
    wal.append(SIGNAL_TRACES, b"durable")
    wal.close()
    assert [r.payload for r in _open(tmp_path).replay(0)] == [b"durable"]


def test_identity_is_stable_per_directory(tmp_path):
    first = WriteAheadLog(tmp_path / "a").load_identity()
    assert WriteAheadLog(tmp_path / "a").load_identity() == first
    assert WriteAheadLog(tmp_path / "b").load_identity() != first
    assert os.path.exists(tmp_path / "a" / "ID")


def test_one_collector_per_log(tmp_path):
    from flare.collector.errors import StartError

    first = _open(tmp_path)
    with pytest.raises(StartError, match="in use by another collector"):
        _open(tmp_path)
    first.close()
    _open(tmp_path).close()  # free again once the first one closed
