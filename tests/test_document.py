"""The status document, typed (record/document.py): the wire format it writes is the one
/status has served, and what it reads back from a daemon or a peer is checked field by field."""

from __future__ import annotations

import json
from dataclasses import fields, replace

from hypothesis import given
from hypothesis import strategies as st

from mlx_watchdog.judge.budget import LastRestart
from mlx_watchdog.judge.states import UNKNOWN, UNKNOWN_EXIT
from mlx_watchdog.record.document import (
    ServerStatus,
    ShownIncident,
    Status,
    Waiting,
    WatchdogLine,
)
from tests.pageday import NOW, changed, status_doc

# The keys /status served for each server before the document was typed, in their order.
WIRE_KEYS = [
    "name",
    "url",
    "manager",
    "state",
    "reason",
    "serving",
    "exit_code",
    "judged_at",
    "state_since",
    "draining",
    "restarting",
    "blind",
    "verdict_age_s",
    "needs_person",
    "last_token_at",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_samples",
    "restarts_24h",
    "incidents_24h",
    "gave_up_24h",
    "budget_left",
    "pid",
    "rss_bytes",
    "cpu_percent",
    "abandoned_connections",
    "live_connections",
    "kind",
    "models_finding",
    "cause",
    "cause_because",
    "server_report",
    "server_prefill",
    "progress_problem",
    "server_running",
    "server_waiting",
    "incident",
    "last_restart",
    "clearing",
    "restart_cost_s",
    "restart_cost_measured",
    "budget_refill_s",
    "restart_backoff_s",
    "cannot_run",
    "held_behind",
]


def a_full_status() -> Status:
    doc = status_doc(NOW, ("wedged",))
    return changed(
        doc,
        0,
        pid=4242,
        cause="deadlock",
        incident=ShownIncident(7, "wedged", NOW - 60),
        last_restart=LastRestart(NOW - 30, "wedged", "recovered", NOW - 20),
        clearing=Waiting(waited_s=2.0, restart_in_s=13.0, prefill_total=9000, cure="cancel"),
    )


def test_the_wire_format_is_the_one_status_served() -> None:
    doc = a_full_status().to_json()
    (s,) = doc["servers"]
    assert list(s) == WIRE_KEYS
    assert s["incident"] == {"id": 7, "state": "wedged", "began_at": NOW - 60}
    assert s["last_restart"] == {
        "at": NOW - 30,
        "trigger": "wedged",
        "outcome": "recovered",
        "finished_at": NOW - 20,
    }
    assert s["clearing"]["cure"] == "cancel" and s["clearing"]["prefill_total"] == 9000
    assert doc["watchdog"] == {
        "pid": 1,
        "version": "test",
        "started_at": None,
        "interval_s": 30.0,
        "running": True,
        "history_problem": None,
    }
    assert Status(WatchdogLine(why="no daemon.json")).to_json() == {
        "watchdog": {"running": False, "why": "no daemon.json"},
        "servers": [],
    }


def test_what_it_writes_it_reads_back_the_same() -> None:
    doc = a_full_status()
    assert Status.from_json(json.loads(json.dumps(doc.to_json()))) == doc


def test_a_field_of_another_type_reads_as_its_default_and_nothing_else_is_lost() -> None:
    wire = a_full_status().to_json()
    s = wire["servers"][0]
    s.update(
        pid="4242",  # text where a number was
        serving="yes",
        ttft_p50_s=float("inf"),
        restarts_24h=True,  # a bool is not a count
        incident={"id": 7, "state": "wedged"},  # began_at missing: no incident shown
        last_restart=[1, 2],
        clearing={"waited_s": 1.0, "restart_in_s": "soon"},
    )
    del s["reason"]
    read = Status.from_json(wire).servers[0]
    assert (read.pid, read.serving, read.ttft_p50_s, read.restarts_24h) == (None, False, None, 0)
    assert (read.incident, read.last_restart, read.clearing, read.reason) == (None, None, None, "")
    assert read.cause == "deadlock" and read.name == "srv-wedged"  # the rest as it was


def test_a_server_without_a_name_is_still_shown() -> None:
    read = Status.from_json({"watchdog": {"running": True}, "servers": [{}, 3, "x"]})
    assert [s.name for s in read.servers] == ["?"]
    assert read.servers[0].state == UNKNOWN and read.servers[0].exit_code == UNKNOWN_EXIT
    assert read.watchdog.running and Status.from_json({}).servers == ()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=20,
)
server_docs = st.fixed_dictionaries(
    {},
    optional={f.name: json_values for f in fields(ServerStatus)},
)


@given(servers=st.lists(server_docs | json_values, max_size=3), line=json_values)
def test_any_document_reads_without_an_exception(servers: list[object], line: object) -> None:
    read = Status.from_json({"watchdog": line, "servers": servers})
    for s in read.servers:
        assert isinstance(s.name, str) and isinstance(s.serving, bool)
        assert s.pid is None or (isinstance(s.pid, int) and not isinstance(s.pid, bool))
        assert s.clearing is None or isinstance(s.clearing.waited_s, float)
        replace(s)  # a well-formed dataclass: it copies


def test_a_status_finds_its_server_by_name() -> None:
    doc = status_doc(NOW, ("healthy", "wedged"))
    found = doc.server("srv-wedged")
    assert found is not None and found.state == "wedged" and doc.server("nope") is None


def test_the_terminal_and_the_page_say_the_same_notes() -> None:
    """One list of notes (serve/notes.py), rendered by `status` and by the page: each note's
    words are in both, the next step with them."""
    from rich.console import Console

    from mlx_watchdog.cli.ops import _status_view
    from mlx_watchdog.serve.notes import notes
    from mlx_watchdog.serve.page import render

    doc = changed(
        a_full_status(),
        0,
        needs_person="3 restarts in the last 3600 s did not help",
        restarting=True,
        draining=True,
        cause_because="its threads wait on each other",
        models_finding="empty_body",
        progress_problem="no log of this server is read",
        restart_cost_s=42.0,
    )
    said = notes(doc.servers[0])
    assert [n.label for n in said] == [
        "A person is needed",
        "Nobody restarts it",  # the document's manager is "none", its state wedged
        "Restarting now",
        "Drained",
        "Cause",
        "Waiting",
        "/v1/models",
        "Prefill progress",
        "A restart",
    ]
    console = Console(record=True, width=400)
    console.print(_status_view(doc))
    terminal = " ".join(console.export_text().split())
    html = " ".join(render(doc, {}, NOW, 10).replace("&quot;", '"').split())
    for n in said:
        for words in (n.label, n.text, n.next):
            assert " ".join(words.split()) in terminal, words
            assert " ".join(words.split()).replace("<", "&lt;") in html, words


def test_status_fits_80_columns_with_a_20_character_name() -> None:
    """Headers and values were cut at 80 columns ("traff...", "802 M..."): every cell whole,
    every line of the table within 80, live or from the history."""
    from rich.console import Console

    from mlx_watchdog.cli.ops import _status_view

    doc = status_doc(NOW, ("starting", "wedged"))
    doc = changed(
        doc, 0, name="a-twenty-char-server", pid=1234567, rss_bytes=123 << 30, ttft_p50_s=12.5
    )
    doc = changed(doc, 1, restarting=True, ttft_p95_s=123.4, restarts_24h=12, budget_left=10)
    for shown in (doc, replace(doc, watchdog=WatchdogLine(why="not running"))):
        console = Console(width=80, record=True)
        console.print(_status_view(shown))
        lines = console.export_text().splitlines()
        table = lines[1:4]
        assert all(len(line) <= 80 and "…" not in line for line in table), table
        assert "a-twenty-char-server" in table[1], table
        gone = not shown.watchdog.running  # from the history: the PID has exited since
        assert ("gone" if gone else "123.0G") in table[1], table
        assert "traffic" in table[0] and "RSS" in table[0]


def test_a_server_nothing_can_restart_and_one_backing_off_say_so() -> None:
    """A down `process` server whose program is on no PATH: the document names it and the
    notes say no restart helps; a failing server in the budget's pause says when the next
    restart may come."""
    from mlx_watchdog.config import ServerConfig
    from mlx_watchdog.record.tally import Figures
    from mlx_watchdog.serve.notes import notes
    from mlx_watchdog.serve.status import describe

    gone = ServerConfig("p", "http://127.0.0.1:1", manager="process", command=("no-such-prog",))
    doc = describe(
        gone, NOW, Figures(), state="down", reason="nothing listens", at=NOW, evidence=None
    )
    assert doc.cannot_run is not None and 'command[0] = "no-such-prog"' in doc.cannot_run
    said = {n.label: n for n in notes(doc)}
    assert "no restart can bring it back" in said["Cannot be restarted"].text
    serving = describe(gone, NOW, Figures(), state="healthy", reason="ok", at=NOW, evidence=None)
    assert serving.cannot_run is None  # looked for only while it fails

    watched = ServerConfig("w", "http://127.0.0.1:1", manager="process", command=("python3",))
    restarted = Figures(restarts=(NOW - 10,))  # the first pause after one: 30 s by default
    paused = describe(watched, NOW, restarted, state="wedged", reason="r", at=NOW, evidence=None)
    assert paused.restart_backoff_s is not None and 0 < paused.restart_backoff_s <= 30
    backing = {n.label: n for n in notes(paused)}["Backing off"]
    assert backing.text.startswith(f"the next restart in {paused.restart_backoff_s:.0f} s")
