"""What a cycle does to spend the least: the probes real traffic makes needless, and the
cheaper cures it tries before a restart (cancel the abandoned requests, or wait out their
prefill). The choices are the judge's (judge/traffic.py, judge/clearing.py); this keeps what
one cycle has under way and returns each step as a `Plan` the cycle carries out and records.
It holds no reference to the cycle: what it needs is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_watchdog.judge import clearing, traffic
from mlx_watchdog.judge.advice import resend_advice
from mlx_watchdog.judge.clearing import Clearing, RestartCost
from mlx_watchdog.judge.estimate import Curve
from mlx_watchdog.judge.evidence import Evidence
from mlx_watchdog.judge.retry import size_label
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.sense.findings import LoadReport

Ended = tuple[Clearing, str, str]  # a cure that ended: the wait, its outcome, the detail


@dataclass(frozen=True)
class Plan:
    """A least-cost step for the cycle to carry out: the cures that ended (each an incident
    action), then either a restart (`restart_why`, "" when none was weighed), a new cure to
    begin (`begins`, a cancel to send first when `begins.cancel`), or neither: the cure goes on
    (`goes_on`: why, when a client resending the abandoned prompt was first seen meanwhile)."""

    ended: tuple[Ended, ...] = ()
    restart_why: str | None = None
    begins: Clearing | None = None
    why: str = ""
    goes_on: str = ""


class LeastCost:
    """What one cycle has under way among the cheaper cures: probes skipped on real
    traffic, a cancel or a wait, and the first token seen while an abandoned prompt steps."""

    def __init__(self) -> None:
        self.clearing: Clearing | None = None  # a cancel or a wait under way
        self.skipped = 0  # probes skipped in a row: real traffic proved the server
        self.first_served: float | None = None  # a token between an abandoned prompt's steps
        # A resent prompt seen during the wait: when it was first sent (span clock), its size,
        # and how long its client had waited when it gave up.
        self.resent: tuple[float, int, float | None] | None = None

    def traffic(self, verdict: Verdict | None, report: LoadReport | None) -> Verdict | None:
        """A verdict without a probe, when the server's own counter shows live clients
        served (a few ticks in a row at most); else None: probe."""
        why = traffic.proves(verdict, report, self.skipped)
        if why is None or report is None or verdict is None:
            self.skipped = 0
            return None
        self.skipped += 1
        return traffic.skipped_verdict(verdict, report, why)

    def plan(
        self,
        evidence: Evidence,
        restart_cost: RestartCost,
        now: float,
        *,
        waited_before: bool,
        cancel: str | None,
        cap: float | None = None,
        calibrated: Curve | None = None,
    ) -> Plan:
        """The next step for a wedge that triggers: go on, begin a cancel or a wait, or
        restart. `waited_before`: this incident already gave one cheaper cure its chance
        (after that, restarts only)."""
        if self.clearing is None and waited_before:
            return Plan(restart_why="")
        e = evidence
        first_seen = False
        if e.retry_held_s is not None and e.retry_bytes is not None:
            first_seen = self.resent is None
            sent = now - e.retry_held_s
            first = sent if self.resent is None else min(self.resent[0], sent)
            gave_up = max(e.gave_up_after_s) if e.gave_up_after_s else None
            self.resent = (first, e.retry_bytes, gave_up)
        cure = clearing.choose(
            evidence,
            restart_cost,
            self.clearing,
            now,
            cancel=cancel,
            cap=cap,
            calibrated=calibrated,
        )
        began, self.clearing = self.clearing, cure.wait
        ended: tuple[Ended, ...] = () if began is None else ((began, "gave up", cure.why),)
        if cure.wait is None:
            return Plan(ended=ended, restart_why=cure.why)
        if began is not None and began.cancel == cure.wait.cancel:
            return Plan(goes_on=cure.why if first_seen else "")  # the cure goes on
        return Plan(ended=ended, begins=cure.wait, why=cure.why)

    def cancel_failed(self) -> None:
        """The cancel a plan began could not be sent: nothing is under way."""
        self.clearing = None

    def held_down(self, v: Verdict, at: float, mono: float) -> bool:
        """A token during a wait whose prompt still steps: the incident stays open (the
        outage ends at this first token `at`, recorded when the prompt is done). `mono`:
        now on the span clock the wait is timed on."""
        if not clearing.holds(v.evidence, self.clearing, mono):
            return False
        self.first_served = at if self.first_served is None else self.first_served
        return True

    def served(self, now: float) -> tuple[str, Ended, str | None] | None:
        """The server serves again: how, the cure that ended, if a cancel or a wait brought it
        back, and the deadline a resent prompt needs, where one was seen."""
        self.first_served = None
        wait, self.clearing = self.clearing, None
        resent, self.resent = self.resent, None
        if wait is None:
            return None
        how = "served again" if wait.cancel else "cleared without a restart:"
        how = f"{how} {wait.waited(now)}"
        advice = None
        if resent is not None and not wait.cancel:
            sent, size, gave_up = resent
            advice = resend_advice(size_label(size), now - sent, gave_up)
        return how, (wait, "cleared", f"{how}; {wait.cost.describe()}"), advice

    def restarting(self, now: float) -> Ended | None:
        """A restart begins (a person's, during a wait): the wait ends with it."""
        wait, self.clearing, self.resent = self.clearing, None, None
        return None if wait is None else (wait, "ended by a restart", wait.waited(now))
