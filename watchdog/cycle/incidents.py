"""An incident's life in one cycle: opened on a bad verdict (with its advice and who restarts
the server), advised as more clients give up, named for its cause when abandoned work comes
back after cures, and closed when the server serves (by itself, by a cure, by a restart).
The cycle's job calls these; each change goes to the cycle's ledger as a fact.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from mlx_watchdog.act.managers import NoManager
from mlx_watchdog.cycle.ledger import Advised, Opened, Released, Served
from mlx_watchdog.cycle.phases import OpenIncident, Phase
from mlx_watchdog.judge.advice import Abandoned, nobody_restarts, retry_loop
from mlx_watchdog.judge.cause import Cause, Diagnosis, recurring
from mlx_watchdog.judge.states import BAD_STATES, EventKind
from mlx_watchdog.judge.triggers import Streak
from mlx_watchdog.judge.verdict import Verdict, renamed
from mlx_watchdog.record.tally import abandoned_lately

if TYPE_CHECKING:
    from mlx_watchdog.cycle.cycle import Cycle


def opened(c: Cycle, v: Verdict, began: float) -> None:
    """Open the incident: in memory always, in the history when it can be written."""
    now = c.wall()
    seen = [
        *abandoned_lately(c.store, c.server.name, now),
        Abandoned.of(v.evidence.to_json()),
    ]
    c.incident = OpenIncident(
        began,
        v.state,
        loop=retry_loop([a for a in seen if a]),
        earlier=cured_lately(c),
        cause=v.evidence.cause or "unknown",
        began_mono=c.mono() - (now - began),
    )
    c.incident.id = c.ledger.record(Opened(now, began, v.state, v.reason, v.evidence.to_json()))
    advice = advise(c, v)
    message = f"{v.reason}. {advice}" if advice else v.reason
    if isinstance(c.manager, NoManager):
        message = f"{message}. {nobody_restarts(c.server.name)}"
    held = c.phase is Phase.HELD  # held before this incident: it stays held
    to = Phase.HELD if held else Phase.FAILING
    c.transition(to, EventKind.DETECTED, message, advice=advice, **v.evidence.brief())


def advise(c: Cycle, v: Verdict) -> str | None:
    if c.incident is None:
        return None
    calibration = functools.partial(c.store.last_calibration, c.server.name)
    gone = v.evidence.abandoned_connections or 0
    advice = c.incident.advice(v.evidence.gave_up_after_s, calibration, gone)
    if advice:
        c.ledger.record(Advised(c.incident.id, advice))
    return advice


def recurring_named(c: Cycle, v: Verdict) -> Verdict:
    """An abandoned prefill back again after cures: named for its cause, the clients'
    timeouts. Counted once per incident, from the history of the budget's window."""
    if v.state not in BAD_STATES or v.evidence.cause != Cause.ABANDONED_PREFILL:
        return v
    earlier = cured_lately(c) if c.incident is None else c.incident.earlier
    cause = recurring(Cause.ABANDONED_PREFILL, earlier)
    if cause is Cause.ABANDONED_PREFILL:
        return v
    because = (
        f"{earlier} earlier wedge{'s' if earlier != 1 else ''} from abandoned requests in "
        f"the last {c.server.restart.window:g} s, each cured; a restart treats the "
        "symptom: the clients' timeouts must outlast their prefill"
    )
    return renamed(v, Diagnosis(cause, because))


def cured_lately(c: Cycle) -> int:
    """Incidents from abandoned requests in the budget's window that ended served."""
    since = c.wall() - c.server.restart.window
    held = (Cause.ABANDONED_PREFILL, Cause.CLIENT_TIMEOUTS)
    return sum(1 for at, cause in c.tally.cured if at >= since and cause in held)


def recovered(c: Cycle, at: float, *, recover_s: float | None, how: str) -> None:
    advice = None
    if (cleared := c.least.served(c.mono())) is not None:
        how, ended, advice = cleared
        c.record_cure(*ended)
    c.streak = Streak()
    c.refused_said = False
    if c.needs_person is not None:
        c.ledger.record(Released())
        c.needs_person = None
    incident, c.incident = c.incident, None
    if incident is None:
        c.ledger.record(Served(at))
        if c.phase is not Phase.NORMAL:
            c.transition(Phase.NORMAL, None, "")
        return
    outage = at - incident.began_at
    if incident.began_mono is not None:
        outage = c.mono() - (c.wall() - at) - incident.began_mono
    outage = round(max(0.0, outage), 3)
    if incident.id is not None and advice:
        c.ledger.record(Advised(incident.id, advice))
    c.ledger.record(Served(at, incident.id, how, recover_s, incident.cause, outage))
    timing = f"outage {outage:.1f} s" + (
        f", time to recover {recover_s:.1f} s" if recover_s is not None else ""
    )
    c.transition(
        Phase.NORMAL,
        EventKind.RECOVERED,
        f"serving again ({how}); {timing}" + (f". {advice}" if advice else ""),
        outage_s=outage,
        recover_s=None if recover_s is None else round(recover_s, 3),
        **({"resent": advice} if advice else {}),  # the deadline a resent prompt needs
    )
