"""What a person should read beside a server's state: one list of notes, in words, shown by
`status` in the terminal and by the page in HTML (each renders, neither writes its own)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlx_watchdog.judge.advice import nobody_restarts
from mlx_watchdog.judge.cause import NEXT_STEP, WORDS, Cause
from mlx_watchdog.judge.commands import suggest
from mlx_watchdog.judge.states import BAD_STATES
from mlx_watchdog.record.document import ServerStatus, Waiting
from mlx_watchdog.sense.findings import EMPTY_MODELS_FIX

ALERT, NOTE, ASIDE = "alert", "note", "aside"  # act on it; context; by the way


@dataclass(frozen=True)
class Note:
    """One thing to read about a server: how loud, what about, what, and what to do next."""

    level: str  # ALERT, NOTE or ASIDE
    label: str
    text: str
    next: str = ""


def notes(s: ServerStatus, *, live: bool = True, config: str | None = None) -> list[Note]:
    """The notes of one server, the loudest first. `live`: the daemon runs (what only it
    knows, a restart's measured cost, is said then). Each command suggested runs as typed:
    for `config` (a path other than the default), this server and its incident."""
    incident = s.incident.id if s.incident is not None else None

    def typed(text: str) -> str:
        return suggest(text, config, server=s.name, incident=incident)

    return [replace(n, text=typed(n.text), next=typed(n.next)) for n in _notes(s, live=live)]


def _notes(s: ServerStatus, *, live: bool) -> list[Note]:
    found: list[Note] = []
    if s.needs_person:
        found.append(Note(ALERT, "A person is needed", s.needs_person, after_hold(s.name)))
    if s.manager == "none" and s.state in BAD_STATES:
        found.append(Note(ALERT, "Nobody restarts it", nobody_restarts(s.name)))
    if s.cannot_run and s.manager != "none":
        found.append(
            Note(
                ALERT,
                "Cannot be restarted",
                f"{s.cannot_run}: no restart can bring it back",
                "fix it, then `mlx-watchdog config check` and reload the watchdog (SIGHUP)",
            )
        )
    elif s.restart_backoff_s is not None and s.state in BAD_STATES and not s.needs_person:
        said = f"the next restart in {s.restart_backoff_s:.0f} s at the earliest"
        found.append(Note(NOTE, "Backing off", f"{said} (the budget's pause between restarts)"))
    if s.restarting:
        found.append(Note(ALERT, "Restarting now", "/healthz answers 503 until it serves again"))
    if s.draining:
        said = "load balancers are told to send it nothing (/healthz answers 503)"
        found.append(Note(ALERT, "Drained", said))
    cause = _cause(s.cause)
    if cause is not None and cause is not Cause.UNKNOWN:
        why = f" ({s.cause_because})" if s.cause_because else ""
        found.append(Note(ALERT, "Cause", f"{WORDS[cause]}{why}", NEXT_STEP.get(cause, "")))
    if s.clearing is not None:
        found.append(Note(ALERT, "Waiting", _waiting(s.clearing)))
    if s.models_finding == "empty_body":
        found.append(
            Note(NOTE, "/v1/models", f"answers 200 with an empty body: {EMPTY_MODELS_FIX}")
        )
    if s.progress_problem:
        found.append(Note(NOTE, "Prefill progress", s.progress_problem))
    elif s.server_prefill:
        found.append(Note(NOTE, "Its log", s.server_prefill))
    if live and s.restart_cost_s is not None:
        measured = s.restart_cost_measured
        how = (
            f"the median of {measured} measured here"
            if measured
            else "assumed: none measured here yet"
        )
        found.append(
            Note(ASIDE, "A restart", f"about {s.restart_cost_s:.0f} s to its first token ({how})")
        )
    return found


def after_hold(name: str) -> str:
    return (
        "once the cause is dealt with, a healthy probe ends the hold by itself; to restart it "
        f"now: `mlx-watchdog restart {name}` (the history: `mlx-watchdog history --show`)"
    )


def _waiting(w: Waiting) -> str:
    what = (
        "after cancelling the abandoned requests"
        if w.cure == "cancel"
        else "for an abandoned prefill to finish"
        if w.prefill_total
        else "for abandoned work whose end cannot be read"
    )
    return (
        f"{w.waited_s:.0f} s {what} instead of restarting; "
        f"restart in {w.restart_in_s:.0f} s if it has not served"
    )


def _cause(value: str | None) -> Cause | None:
    try:
        return Cause(value) if value else None
    except ValueError:  # a document from another version
        return None
