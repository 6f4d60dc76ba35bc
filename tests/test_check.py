"""One check round's cost while the server serves: the rest of a look at most every few
seconds, the probe on record only once it waits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from mlx_watchdog.act.check import judged
from mlx_watchdog.record.left_probes import LeftProbes
from mlx_watchdog.sense.findings import ProcessSample
from mlx_watchdog.sense.process import Inspector
from mlx_watchdog.sense.round import FULL_LOOK_EVERY, Checker
from tests.builders import watched
from tests.conftest import Running


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Counting(Inspector):
    looks = 0

    def sample(self, pid: int | None = None, exclude: object = ()) -> ProcessSample:
        self.looks += 1
        return super().sample(pid, exclude)  # type: ignore[arg-type]


def checker_on(srv: Running, tmp_path: Path, clock: Clock) -> tuple[Checker, Counting, Path]:
    server = watched(srv.url, hard_timeout=60.0)
    inspector = Counting(server, mono=clock)
    record = tmp_path / "left-probes.json"
    checker = Checker(
        server, inspector=inspector, mono=clock, left=LeftProbes(record), announce_probe=True
    )
    return checker, inspector, record


def rounds(checker: Checker, clock: Clock, n: int, step: float) -> None:
    for _ in range(n):
        checker.start().wait(10)
        v = judged(checker, None)
        assert v is not None and v.state == "healthy", v
        clock.now += step


def test_while_the_probe_is_answered_the_rest_of_a_look_comes_every_few_seconds(
    bad_server: Callable[..., Running], tmp_path: Path
) -> None:
    srv = bad_server("ok")
    clock = Clock()
    checker, inspector, record = checker_on(srv, tmp_path, clock)
    rounds(checker, clock, 150, 0.1)  # fifteen seconds of probes every 100 ms
    assert 15 / FULL_LOOK_EVERY <= inspector.looks <= 15 / FULL_LOOK_EVERY + 2, inspector.looks
    # Once one was answered at once, none went on the record a killed daemon's successor
    # reads: only the first, sent before any answer was seen.
    assert len(json.loads(record.read_text())) == 1


def test_a_probe_that_waits_is_on_record_and_every_look_is_full(
    bad_server: Callable[..., Running], tmp_path: Path
) -> None:
    srv = bad_server("hang")
    clock = Clock()
    checker, inspector, record = checker_on(srv, tmp_path, clock)
    for _ in range(5):
        judged(checker, None)
        clock.now += 0.1
    assert inspector.looks == 5
    (entry,) = json.loads(record.read_text())
    assert entry[:2] == list(checker.probe.local_address or ()), entry  # type: ignore[union-attr]
    checker.abort()
