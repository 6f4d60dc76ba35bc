"""Hostile answers on every route each kind is read on (tests/hostile.py), against the
misbehaving server emulating that kind: a serving server is left alone, one that serves nobody
is found, and no answer crashes or blocks a check. `bench/hostile.py` runs the whole matrix."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlx_watchdog.config.profiles import Kind
from mlx_watchdog.record.left_probes import LeftProbes
from tests.conftest import Running
from tests.hostile import QUICK_KINDS, Outcome, cases, run_case


def test_no_hostile_answer_blinds_the_check(
    bad_server: Callable[..., Running], tmp_path: Path
) -> None:
    # Each kind has a server (a port) of its own, so the kinds run side by side: a check
    # looks only at the connections on its server's port.
    def kind_matrix(kind: Kind) -> list[Outcome]:
        srv = bad_server("ok", kind=kind)
        left = LeftProbes(tmp_path / f"left-{kind}.json")
        tried = list(cases((kind,), quick=True))
        assert tried, kind
        return [run_case(c, srv.url, left) for c in tried]

    with ThreadPoolExecutor(len(QUICK_KINDS)) as pool:
        outcomes = [o for found in pool.map(kind_matrix, QUICK_KINDS) for o in found]
    assert {o.case.kind for o in outcomes} == set(QUICK_KINDS)
    wrong = [o for o in outcomes if not o.kept]
    assert not wrong, "\n".join(
        f"{o.case.label}: {o.error or o.state} ({o.reason[:160]})" for o in wrong
    )
