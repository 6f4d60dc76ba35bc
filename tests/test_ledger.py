"""The ledger (cycle/ledger.py): the one writer of what a cycle learns. Each fact lands in the
history, the tally, the sinks and the alerts as the cycle once wrote it by hand, in order."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog.act.ladder import Ladder
from mlx_watchdog.cycle.crew import Crew, NoSink
from mlx_watchdog.cycle.ledger import (
    Acted,
    Advised,
    FirstToken,
    GaveUp,
    Held,
    Ledger,
    Opened,
    Probed,
    Released,
    RestartBegun,
    RestartEnded,
    Said,
    Served,
)
from mlx_watchdog.judge.evidence import Evidence
from mlx_watchdog.judge.states import EventKind, State
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.alerts import Alerter, Event
from mlx_watchdog.record.store import Store
from tests.builders import watched

NOW = 1_800_000_000.0


class Told(NoSink):
    """A sink that keeps what it was told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, Any]] = []

    def observe(self, server: str, verdict: Verdict) -> None:
        self.told.append(("observe", verdict.state))

    def event(self, server: str, kind: str, data: dict[str, Any]) -> None:
        self.told.append(("event", kind))

    def gave_up(self, server: str, n: int) -> None:
        self.told.append(("gave_up", n))


class Alerts(Alerter):
    """An alerter that keeps what it was asked to send."""

    def __init__(self) -> None:
        super().__init__([])
        self.sent: list[Event] = []

    def send(self, event: Event) -> None:
        self.sent.append(event)


def a_ledger() -> tuple[Ledger, Store, Told, Alerts]:
    store, sink, alerts = Store(None), Told(), Alerts()
    crew = Crew(store, alerts, Ladder(), sink, wall=lambda: NOW)
    return Ledger("s", crew), store, sink, alerts


def test_an_incident_from_its_opening_to_its_cure() -> None:
    ledger, store, sink, alerts = a_ledger()
    wedged = Verdict(State.WEDGED, "wedged: no token", Evidence(waited_s=5.0))
    ledger.record(Probed(NOW, wedged, 1.0))
    ref = ledger.record(Opened(NOW, NOW - 5, "wedged", "wedged: no token", {"cause": "deadlock"}))
    assert (ref is not None and ledger.tally.opened == [NOW]) or list(ledger.tally.opened) == [NOW]
    ledger.record(Said(NOW, EventKind.DETECTED, "wedged: no token", "wedged", {"cause": "x"}))
    ledger.record(GaveUp(NOW + 1, 2))
    ledger.record(Advised(ref, "raise the clients' timeouts above 30 s"))
    ledger.record(Acted(ref, {"at": NOW + 2, "action": "wait", "outcome": "cleared"}))
    ledger.record(Served(NOW + 3, ref, "cleared without a restart", None, "abandoned_prefill"))
    store.flush(5.0)
    (incident,) = store.incidents(0.0)
    assert incident.closed_at == NOW + 3 and incident.outcome == "cleared without a restart"
    assert incident.advice == "raise the clients' timeouts above 30 s"
    assert [a["action"] for a in incident.actions] == ["wait"]
    assert [e.kind for e in store.events("s")] == ["detected", "gave_up"]
    assert ledger.tally.last_token_at == NOW + 3
    assert list(ledger.tally.cured) == [(NOW + 3, "abandoned_prefill")]
    assert list(ledger.tally.gave_up) == [(NOW + 1, 2)]
    assert sink.told == [("observe", "wedged"), ("event", "detected"), ("gave_up", 2)]
    assert [(e.kind, e.state) for e in alerts.sent] == [("detected", "wedged")]


def test_a_restart_counted_as_it_begins_and_its_cost_as_it_ends() -> None:
    ledger, store, _, _ = a_ledger()
    row = ledger.record(RestartBegun(NOW, 50.0, "wedged"))
    assert list(ledger.tally.restarts_here) == [50.0]
    assert ledger.tally.last_restart is not None and ledger.tally.last_restart.outcome is None
    ledger.record(RestartEnded(row, NOW, "wedged", NOW + 4, "recovered", 4.0))
    last = ledger.tally.last_restart
    assert last is not None and (last.outcome, last.finished_at) == ("recovered", NOW + 4)
    assert list(ledger.tally.served_s) == [4.0] and list(ledger.tally.restarts_served) == [NOW]
    ledger.record(FirstToken(9.0))  # a restart was measured: the start's token adds nothing
    assert list(ledger.tally.served_s) == [4.0]
    store.flush(5.0)
    (restart,) = store.restarts("s", 0.0)
    assert (restart.outcome, restart.finished_at) == ("recovered", NOW + 4)
    assert store.restart_costs("s", 10) == [4.0]
    assert not ledger.tally.restarts_asked  # the watchdog's own
    ledger.record(RestartBegun(NOW + 60, 110.0, "manual"))  # a person's: named as such
    assert list(ledger.tally.restarts_asked) == [NOW + 60]
    store.flush(5.0)
    from mlx_watchdog.record.tally import Tally

    loaded = Tally.load(store, watched("http://127.0.0.1:1", name="s"), NOW + 120)
    assert list(loaded.restarts_asked) == [NOW + 60]


def test_a_hold_and_its_release() -> None:
    ledger, store, _, _ = a_ledger()
    ledger.record(Held(NOW, "3 restarts did not help"))
    assert store.hold_reason("s") == "3 restarts did not help"
    ledger.record(Released())
    ledger.record(Served(NOW + 1))  # no incident open: only the last token
    assert store.hold_reason("s") is None and ledger.tally.last_token_at == NOW + 1
    assert list(ledger.tally.cured) == []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 7200), st.floats(0, 120, allow_nan=False)), min_size=0, max_size=60
    ),
    st.floats(0, 9000),
)
def test_the_kept_percentiles_are_those_of_the_window(
    probes: list[tuple[float, float]], now: float
) -> None:
    """The tally keeps its TTFTs in order beside their times (two lookups per status, not a
    sort): what it shows is what sorting the last hour's would give."""
    import math
    import statistics

    from mlx_watchdog.record.tally import TTFT_WINDOW, Tally

    tally = Tally()
    for at, seconds in sorted(probes):
        tally.add_ttft(at, seconds)
        tally.forget_old(at)
    f = tally.figures(watched("http://127.0.0.1:1"), now, now, incident=None, needs_person=None)
    latest = max([now, *(at for at, _ in probes)])  # what the last forgetting went by
    window = sorted(s for at, s in probes if at >= latest - TTFT_WINDOW)
    assert f.ttft_samples == len(window)
    if window:
        assert f.ttft_p50_s == statistics.median(window)
        assert f.ttft_p95_s == window[max(0, math.ceil(0.95 * len(window)) - 1)]
    else:
        assert f.ttft_p50_s is None and f.ttft_p95_s is None
