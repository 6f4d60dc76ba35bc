"""The server's own progress, read from its log: incrementally, bounded, through rotation."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mlx_watchdog.judge.verdict import judge
from mlx_watchdog.sense import progress as progress_module
from mlx_watchdog.sense.findings import Prefill, ProbeSnapshot, ProcessSample
from mlx_watchdog.sense.observation import Observation
from mlx_watchdog.sense.progress import LogProgress
from tests.builders import QUICK

T0 = time.mktime(time.strptime("2026-12-03 19:34:40", "%Y-%m-%d %H:%M:%S"))


def line(at: float, done: int, total: int) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
    return (
        f"{stamp},{int(at * 1000) % 1000:03d} - INFO - Prompt processing progress: {done}/{total}\n"
    )


def reader_of(log: Path, text: str, wall: float = T0) -> LogProgress:
    """A reader that looked first (nothing in a log before the watchdog's start is current),
    then `text` written to the log."""
    log.touch()
    reader = LogProgress(log, wall=lambda: wall)
    assert reader.read() is None
    with log.open("a") as fh:
        fh.write(text)
    return reader


def test_a_prefill_is_read_as_it_is_written_with_its_rate(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("2026-12-03 19:34:39,000 - INFO - Starting httpd at 127.0.0.1 on port 8080\n")
    reader = LogProgress(log, wall=lambda: T0 + 10.0)
    assert reader.read() is None and reader.problem is None
    with log.open("a") as fh:
        fh.write(line(T0, 2048, 12036) + line(T0 + 4.0, 4096, 12036))
        fh.write(line(T0 + 8.0, 6144, 12036)[:30])  # a line still being written
    said = reader.read()
    assert said == Prefill(done=4096, total=12036, rate_tps=512.0, age_s=6.0, step_s=4.0)
    with log.open("a") as fh:
        fh.write(line(T0 + 8.0, 6144, 12036)[30:])
    said = reader.read()
    assert said is not None and (said.done, said.rate_tps, said.age_s) == (6144, 512.0, 2.0)
    assert said.describe() == (
        "prefilling 6,144/12,036 prompt tokens at 512 tok/s, about 12 s left "
        "(its last step 2 s ago)"
    )


def test_another_request_starts_a_new_prefill_and_a_finished_one_says_so(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    reader = reader_of(log, line(T0, 2048, 4096) + line(T0 + 1, 4096, 4096), T0 + 2)
    said = reader.read()
    assert said is not None and said.finished and said.left_s == 0.0
    with log.open("a") as fh:
        fh.write(line(T0 + 2, 2048, 40000))
    said = reader.read()
    assert said is not None and (said.done, said.total, said.rate_tps) == (2048, 40000, None)
    assert said.left_s is None and "about" not in said.describe()


def test_interleaved_requests_are_followed_each_and_the_latest_long_one_told(
    tmp_path: Path,
) -> None:
    """A batched server logs its requests' steps in turn; the probe's own short prompt
    (0/30, 30/30) between them does not hide the long prefill nor reset its rate."""
    log = tmp_path / "server.log"
    reader = reader_of(
        log,
        line(T0, 0, 19000)
        + line(T0 + 1, 2048, 19000)
        + line(T0 + 1.5, 0, 30)
        + line(T0 + 2, 4096, 19000)
        + line(T0 + 2.2, 30, 30),
        T0 + 3,
    )
    said = reader.read()
    assert said is not None and (said.done, said.total) == (4096, 19000)
    assert (said.rate_tps, said.step_s, said.age_s) == (2048.0, 1.0, 1.0)
    with log.open("a") as fh:  # the same prompt sent again: a new request, from its start
        fh.write(line(T0 + 3, 0, 19000) + line(T0 + 4, 2048, 19000))
    said = reader.read()
    assert said is not None and (said.done, said.rate_tps) == (2048, 2048.0)
    # Only short prompts: the latest one is told.
    short = reader_of(tmp_path / "short.log", line(T0, 0, 30) + line(T0 + 1, 30, 30), T0 + 3)
    said = short.read()
    assert said is not None and said.finished and said.total == 30


def test_a_prefill_no_request_on_the_servers_sockets_can_be_is_passed_over(
    tmp_path: Path,
) -> None:
    """Issue 54: a malformed body logged raw writes lines of a 400,000-token prompt between a
    real prefill's steps. The largest request the kernel counted on the server's sockets is
    80 kB: no prompt of it is longer than 80,000 tokens (a byte a token at the least) plus a
    template's, so the real prefill is told; unread sizes pass every line over to nobody."""
    log = tmp_path / "server.log"
    text = line(T0, 2048, 19000) + line(T0 + 1, 4096, 19000) + line(T0 + 1.5, 2048, 400000)
    reader = reader_of(log, text + line(T0 + 2, 4096, 400000), T0 + 3)
    said = reader.read(80_000)
    assert said is not None and (said.done, said.total) == (4096, 19000)
    only = reader_of(tmp_path / "forged.log", line(T0, 2048, 400000), T0 + 1)
    assert only.read(80_000) is None
    forged = reader_of(tmp_path / "unread.log", line(T0, 2048, 400000), T0 + 1)
    said = forged.read(None)
    assert said is not None and said.total == 400000


def test_a_rotated_or_truncated_log_is_read_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    reader = reader_of(log, line(T0, 2048, 9000) * 50)
    assert reader.read() is not None
    log.rename(tmp_path / "server.log.1")
    log.write_text(line(T0 + 5, 1024, 3000))
    said = reader.read()
    assert said is not None and (said.done, said.total) == (1024, 3000)
    log.write_text(line(T0 + 6, 512, 700))  # truncated in place, shorter than before
    said = reader.read()
    assert said is not None and (said.done, said.total) == (512, 700)


def test_a_log_that_grew_a_lot_is_read_from_its_last_bytes_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_module, "READ_MAX", 4096)
    log = tmp_path / "server.log"
    log.write_text("")
    reader = LogProgress(log, wall=lambda: T0)
    reader.read()
    with log.open("a") as fh:
        fh.write("x" * 100_000 + "\n")  # one huge line the reader never holds whole
        fh.write(line(T0, 100, 200))
    said = reader.read()
    assert said is not None and (said.done, said.total) == (100, 200)


@pytest.mark.parametrize(
    "text",
    [
        "2026-12-03 19:34:43,194 - INFO - Prompt processing progress: 9/3\n",  # done > total
        "2026-12-03 19:34:43,194 - INFO - Prompt processing progress: 1/0\n",
        "2026-13-45 19:34:43,194 - INFO - Prompt processing progress: 1/2\n",  # no such date
        "2026-12-03 19:34:43,194 - INFO - Prompt processing progress: 1/99999999999\n",
        "\x00\xff garbage - INFO - Prompt processing progress: 1/2\n",
        "2026-12-03 19:34:43,194 - INFO - Prompt processing progress: -1/2\n",
    ],
)
def test_lines_that_are_not_a_progress_step_are_not_believed(tmp_path: Path, text: str) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(text.encode("latin-1"))
    assert LogProgress(log).read() is None


def test_what_the_log_held_before_the_first_look_or_a_restart_is_not_current(
    tmp_path: Path,
) -> None:
    """A prefill logged days before the watchdog started, or by the server before its restart,
    is not shown as going now, and a failure line from then is not kept."""
    log = tmp_path / "server.log"
    old = (
        line(T0 - 400_000, 2048, 31_744)
        + "RuntimeError: [metal::malloc] Resource limit (1) exceeded\n"
    )
    log.write_text(old)
    reader = LogProgress(log, wall=lambda: T0)
    assert reader.read() is None and reader.errors == []
    with log.open("a") as fh:
        fh.write(line(T0, 2048, 9000) + "[METAL] Command buffer execution failed\n")
    said = reader.read()
    assert said is not None and said.total == 9000 and len(reader.errors) == 1
    reader.restarted()  # the server (re)started: its log so far is the old process's
    with log.open("a") as fh:
        fh.write(line(T0 + 1, 4096, 9000))
    assert reader.read() is None and reader.errors == []
    with log.open("a") as fh:
        fh.write(line(T0 + 2, 1024, 5000))
    said = reader.read()
    assert said is not None and said.total == 5000


@pytest.mark.parametrize("hours", [-8.0, 5.5, 9.0])
def test_a_server_stamping_another_zone_is_read_as_it_runs(tmp_path: Path, hours: float) -> None:
    """A server whose zone is not the watchdog's (a job's bare environment, a unit's TZ): its
    prefill is neither hours stalled nor hours in the future; the zone is learned from lines
    read as they are written."""
    shift = hours * 3600
    log = tmp_path / "server.log"
    reader = reader_of(
        log, line(T0 + shift, 2048, 12036) + line(T0 + 4 + shift, 4096, 12036), T0 + 5
    )
    said = reader.read()
    assert said is not None and (said.done, said.rate_tps, said.age_s) == (4096, 512.0, 1.0)
    with log.open("a") as fh:
        fh.write(line(T0 + 8 + shift, 6144, 12036))
    said = reader.read()
    assert said is not None and said.done == 6144 and said.age_s <= 1.0


def test_a_missing_or_unreadable_log_is_a_finding(tmp_path: Path) -> None:
    reader = LogProgress(tmp_path / "none.log")
    assert reader.read() is None and reader.problem is not None
    assert "cannot read the server's log" in reader.problem and "none.log" in reader.problem
    (tmp_path / "dir.log").mkdir()
    reader = LogProgress(tmp_path / "dir.log")
    assert reader.read() is None and reader.problem is not None
    os.mkfifo(tmp_path / "fifo.log")  # a reader that opened it blocking would wait forever
    reader = LogProgress(tmp_path / "fifo.log")
    assert reader.read() is None and "not a regular file" in (reader.problem or "")
    (tmp_path / "real.log").write_text("")
    (tmp_path / "link.log").symlink_to(tmp_path / "real.log")  # a link to a log is read
    said = reader_of(tmp_path / "link.log", line(T0, 1, 2)).read()
    assert said is not None and said.total == 2
    assert LogProgress(None).read() is None


def test_the_verdict_tells_the_prefill_the_server_logs() -> None:
    probe = ProbeSnapshot(started_at=0.0)
    busy = ProcessSample(pid=os.getpid(), create_time=-100.0, abandoned=0, live=1)
    said = Prefill(done=23040, total=43118, rate_tps=312.0, age_s=1.0)
    v = judge(Observation(probe, busy, prefill=said), QUICK, 1.2)
    assert v is not None and v.state == "busy"
    assert v.reason.endswith(
        "the server's log: prefilling 23,040/43,118 prompt tokens at 312 tok/s, "
        "about 64 s left (its last step 1 s ago)"
    )
    assert (v.evidence.prefill_done, v.evidence.prefill_total) == (23040, 43118)
    assert v.evidence.prefill_left_s == pytest.approx(64.4, abs=0.1)
    missing = judge(Observation(probe, busy, progress_problem="no log"), QUICK, 1.2)
    assert missing is not None and missing.evidence.progress_problem == "no log"
    assert "the server's log" not in missing.reason


def test_a_launchd_jobs_log_is_the_one_its_plist_names(tmp_path: Path) -> None:
    import plistlib

    from mlx_watchdog.config import parse_config
    from mlx_watchdog.sense.progress import server_log

    def server(plist: Path, **extra: object) -> object:
        entry = {"url": "http://127.0.0.1:8080", "manager": "launchd", "label": "l", **extra}
        return parse_config({"server": [{**entry, "plist": str(plist)}]}).servers[0]

    plist = tmp_path / "job.plist"
    plist.write_bytes(plistlib.dumps({"Label": "l", "StandardErrorPath": "/var/log/mlx.err"}))
    assert server_log(server(plist)) == Path("/var/log/mlx.err")  # type: ignore[arg-type]
    plist.write_bytes(plistlib.dumps({"Label": "l", "StandardOutPath": "~/mlx.out"}))
    assert server_log(server(plist)) == Path("~/mlx.out").expanduser()  # type: ignore[arg-type]
    # log_file wins; a plist that names none, is garbage, too large or a FIFO names none.
    own = server(plist, log_file=str(tmp_path / "own.log"))
    assert server_log(own) == tmp_path / "own.log"  # type: ignore[arg-type]
    for body in (plistlib.dumps({"Label": "l"}), b"<<not a plist>>", b"x" * (2 << 20)):
        plist.write_bytes(body)
        assert server_log(server(plist)) is None  # type: ignore[arg-type]
    fifo = tmp_path / "fifo.plist"
    os.mkfifo(fifo)
    assert server_log(server(fifo)) is None  # type: ignore[arg-type]


def test_a_long_prefill_that_stopped_while_the_log_went_on_is_not_told_as_going(
    tmp_path: Path,
) -> None:
    """A request cancelled mid-prefill never logs its end; later lines tell the present."""
    log = tmp_path / "server.log"
    text = (
        line(T0, 0, 19000)
        + line(T0 + 1, 2048, 19000)  # then nothing more of it: cancelled
        + line(T0 + 100, 0, 30)
        + line(T0 + 100.1, 30, 30)
    )
    said = reader_of(log, text, T0 + 101).read()
    assert said is not None and (said.done, said.total) == (30, 30)
    # An old finished long prompt does not hide a newer short one either.
    text = line(T0, 0, 19000) + line(T0 + 9, 19000, 19000) + line(T0 + 50, 0, 30)
    said = reader_of(tmp_path / "other.log", text, T0 + 51).read()
    assert said is not None and (said.done, said.total) == (0, 30)


LLAMA_LINES = (  # llama-server b11434, a 1500-word prompt on the tests' tiny GGUF
    "0.10.118.413 I slot print_timing: id  0 | task 0 | prompt processing, n_tokens =   4096, "
    "progress = 0.35, t =   5.25 s / 780.08 tokens per second\n",
    "0.15.069.297 I slot print_timing: id  0 | task 0 | prompt processing, n_tokens =   6144, "
    "progress = 0.53, t =  10.20 s / 602.26 tokens per second\n",
    "0.22.781.116 I slot print_timing: id  0 | task 0 | prompt processing, n_tokens =   8192, "
    "progress = 0.70, t =  17.91 s / 457.31 tokens per second\n",
)


def test_llama_servers_per_slot_progress_is_read_too(tmp_path: Path) -> None:
    log = tmp_path / "llama.log"
    text = "main: server is listening on http://127.0.0.1:8081\n" + "".join(LLAMA_LINES)
    reader = reader_of(log, text)
    said = reader.read()
    assert said is not None and said.done == 8192 and said.total == round(8192 / 0.70)
    # Its times count from the server's start: the newest line is taken as just written.
    assert said.age_s == 0.0 and said.step_s == pytest.approx(6.33, abs=0.01)
    assert said.rate_tps == pytest.approx(4096 / 12.663, abs=0.5)
    # Another task on the same slot is another request; a malformed line is not believed.
    with log.open("a") as fh:
        fh.write(LLAMA_LINES[0].replace("task 0", "task 7").replace("0.10.118", "0.59.000"))
        fh.write(LLAMA_LINES[1].replace("progress = 0.53", "progress = 7.00"))
        fh.write(LLAMA_LINES[1].replace("0.15.069", "0.75.069"))
    said = reader.read()
    assert said is not None and (said.done, said.rate_tps) == (4096, None)


def test_the_rate_is_the_last_steps_one_as_a_long_prefill_slows(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    # 2048 tokens a second for four steps, then a step every 2 s: the context grew.
    times = [0, 1, 2, 3, 5, 7, 9]
    text = "".join(line(T0 + t, 2048 * (i + 1), 30_000) for i, t in enumerate(times))
    said = reader_of(log, text, T0 + 9).read()
    assert said is not None and said.rate_tps == 1024.0  # not 1,593: the whole span's


def test_a_prefill_that_slows_with_its_context_is_told_its_longer_end(tmp_path: Path) -> None:
    """Each token's time grows with its position (attention): a constant rate would say the
    rest takes (30,000 - 10,240) / rate; the steps' slowing makes it longer, as measured."""
    log = tmp_path / "server.log"
    per_token = [2e-4 + 3e-8 * p for p in range(0, 10_240, 2048)]  # s/token at each step
    at, lines = 0.0, []
    for i, tau in enumerate(per_token):
        at += tau * 2048
        lines.append(line(T0 + at, 2048 * (i + 1), 30_000))
    said = reader_of(log, "".join(lines), T0 + at).read()
    assert said is not None and said.slowing is not None
    assert said.slowing == pytest.approx(3e-8, rel=0.1)
    constant = (30_000 - said.done) / (said.rate_tps or 1)
    assert said.left_s is not None and said.left_s > constant * 1.5
