"""The request traces bench/replay.py plays: each format read, garbage refused by name, one Mac's
share made of whole conversations; and the GPU-style hang it injects holds one thread only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.hang import Hang, working_thread
from bench.replay import SHIPPED
from bench.trace import Request, TraceError, derived, one_mac, read, session, sliced, write_derived

SPLITWISE = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,1020,200\n0.1,300.0,7\n"
MOONCAKE = (
    '{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}\n'
    '{"timestamp": 1000, "input_length": 600, "output_length": 1, "hash_ids": [46, 48]}\n'
)


def _file(tmp_path: Path, text: str | bytes, name: str = "trace") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_each_format_is_read_in_arrival_order(tmp_path: Path) -> None:
    splitwise = read(_file(tmp_path, SPLITWISE, "s.csv"))
    assert splitwise == [Request(0.1, 300, 7), Request(0.5, 1020, 200)]
    mooncake = read(_file(tmp_path, MOONCAKE, "m.jsonl"))
    assert mooncake == [Request(1.0, 600, 1, (46, 48)), Request(27.482, 6955, 52, (46, 47))]
    assert not derived(tmp_path / "s.csv")


def test_the_shipped_file_reads_back_as_written(tmp_path: Path) -> None:
    shipped = read(SHIPPED)
    assert derived(SHIPPED) and len(shipped) >= 20
    assert all(r.blocks for r in shipped), "the shipped hour keeps Mooncake's prefix ids"
    copy = tmp_path / "copy.csv"
    write_derived(copy, shipped, ["a header line"])
    assert read(copy) == shipped and derived(copy)
    assert copy.read_text().startswith("# a header line\n")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "no requests"),
        ("# only a comment\n\n", "no requests"),
        (b"\xff\xfe\x00garbage", "not UTF-8"),
        ("[1, 2, 3]\n", "columns"),
        ('{"timestamp": 1}\n', "request 1 is not a Mooncake request"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1}\n[1]\n', "request 2"),
        ('{"timestamp": "soon", "input_length": 5, "output_length": 1}\n', "request 1"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": 7}\n', "request 1"),
        ("at_s,prompt,output\n-3,10,1\n", "request 1: arrival -3.0"),
        ("at_s,prompt,output\nnan,10,1\n", "arrival nan"),
        ("at_s,prompt,output\n1,0,1\n", "sizes 0, 1"),
        ("at_s,prompt,output\n1,10\n", "request 1"),
        ("at_s,prompt,output\n1,1e999,1\n", "request 1"),
        ("at_s,prompt,output,blocks\n1,10,1,a b\n", "request 1"),
        ("at_s,prompt,output\n1,10,1\x00\n", "request 1"),
        ("when,size\n1,2\n", "neither Splitwise's nor derived"),
    ],
)
def test_a_file_that_is_not_a_trace_is_refused_by_name(
    tmp_path: Path, text: str | bytes, says: str
) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(TraceError, match=says) as raised:
        read(path)
    assert str(path) in str(raised.value)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400) | st.text(max_size=400))
def test_any_bytes_are_a_trace_or_a_named_refusal(
    tmp_path_factory: pytest.TempPathFactory, data: str | bytes
) -> None:
    path = _file(tmp_path_factory.mktemp("t"), data)
    try:
        requests = read(path)
    except TraceError:
        return
    assert requests == sorted(requests, key=lambda r: r.at)
    assert all(r.at >= 0 and r.prompt >= 1 and r.output >= 0 for r in requests)


def test_a_slice_is_its_minutes_timed_from_its_start() -> None:
    requests = [Request(t, 10, 1) for t in (0.0, 59.9, 60.0, 150.0, 180.0)]
    assert sliced(requests, 1, 2) == [Request(0.0, 10, 1), Request(90.0, 10, 1)]
    assert sliced(requests, 1, 1.5) == [Request(0.0, 10, 1)]
    assert sliced(requests, 5, 1) == []


def test_one_mac_keeps_whole_conversations_and_the_same_seed_the_same_share() -> None:
    requests = [
        Request(float(i), 2000, 10, (1, 100 + i % 12, 1000 + i)) for i in range(120)
    ]  # 12 conversations of 10 turns, each turn extending its conversation's prefix
    kept, share = one_mac(requests, load=0.1, mac_rate=300.0, seed=3)
    assert 0 < share < 1 and kept
    conversations = {session(r) for r in kept}
    assert len(conversations) < 12
    assert all(session(r) not in conversations for r in requests if r not in kept)
    assert one_mac(requests, load=0.1, mac_rate=300.0, seed=3) == (kept, share)
    everything, whole = one_mac(requests, load=50.0, mac_rate=300.0, seed=3)
    assert everything == requests and whole == 1.0


CHILD = """
import ctypes, os, sys, threading
def spin():
    while True:
        sum(range(1000))
def block(fd):  # in C, without the GIL, as MLX's arithmetic thread runs
    ctypes.CDLL(None).read(fd, ctypes.create_string_buffer(1), 1)
threads = [threading.Thread(target=spin, daemon=True)]
threads.append(threading.Thread(target=block, args=(os.pipe()[0],), daemon=True))
for t in threads:
    t.start()
print(*(t.native_id for t in threads), flush=True)
for line in sys.stdin:
    print(line.strip(), flush=True)
"""


def test_the_working_thread_is_found_and_a_hang_holds_one_thread_only() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            _hold_one_of(proc)
        finally:
            proc.kill()


def _hold_one_of(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    spinner, blocked = map(int, proc.stdout.readline().split())
    assert working_thread(proc.pid, 30) == spinner
    hang = Hang(blocked)
    assert hang.start(), hang.error
    state = Path(f"/proc/{proc.pid}/task/{blocked}/stat").read_text()
    assert state.rsplit(")", 1)[1].split()[0] == "t", "not stopped by its tracer"
    for tid in (proc.pid, spinner):
        other = Path(f"/proc/{proc.pid}/task/{tid}/stat").read_text()
        assert other.rsplit(")", 1)[1].split()[0] in "RS", f"thread {tid} was stopped too"
    proc.stdin.write("still answers\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "still answers\n"
    proc.kill()
    proc.wait(10)
    assert hang.ended(10), "the hold outlived the process it held"
