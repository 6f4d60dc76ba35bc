"""The status page at `GET /`: one HTML document, drawn on the watchdog, nothing to fetch.

No script, no asset from anywhere (the charts are inline SVG, the style one inline block
allowed by its hash in the Content-Security-Policy), a refresh by `<meta http-equiv>`: it
reads the same with JavaScript off, and a page that can load nothing cannot leak anything.
Every text from outside (reasons, model answers, advice, names) is escaped.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Iterable
from dataclasses import replace
from html import escape

from mlx_watchdog.judge.commands import suggest
from mlx_watchdog.judge.states import SERVING_STATES, SHOWN_STATES, UNKNOWN, State
from mlx_watchdog.record.document import ServerStatus, Status, WatchdogLine
from mlx_watchdog.record.tally import DAY
from mlx_watchdog.serve.day import HOUR, STRIP, Day, lines_of
from mlx_watchdog.serve.notes import ALERT, notes

WIDTH = 720  # the charts' own units; CSS stretches them to the page
TEXT_SHOWN = 400  # characters of an incident's reason or advice
ACTIONS_SHOWN = 4  # of an incident's actions; the rest are counted

CSS = """
:root{color-scheme:light dark;--fg:#1b1f23;--bg:#fff;--muted:#5f6b76;--line:#d0d7de;--card:#f6f8fa}
@media (prefers-color-scheme:dark){:root{--fg:#e6edf3;--bg:#0d1117;--muted:#8b949e;--line:#30363d;--card:#161b22}}
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:64rem;padding:1rem;color:var(--fg);background:var(--bg)}
header p,.muted,figcaption,.note{color:var(--muted)}
h1{font-size:1.3rem;margin:.2rem 0}h2{font-size:1.15rem;margin:0 0 .3rem}h3{font-size:1rem;margin:1rem 0 .3rem}
section.server{border:1px solid var(--line);border-left-width:.5rem;border-radius:.4rem;padding:.8rem 1rem;margin:1rem 0;background:var(--card)}
.badge{display:inline-block;padding:0 .5rem;border-radius:1rem;color:#fff;font-weight:600;margin-right:.4rem}
.alert{border:1px solid #c62828;border-radius:.3rem;padding:.3rem .6rem;margin:.4rem 0}
dl.numbers{display:grid;grid-template-columns:repeat(auto-fill,minmax(8rem,1fr));gap:.3rem 1rem;margin:.6rem 0}
dl.numbers div{min-width:0}dt{color:var(--muted);font-size:.8rem}dd{margin:0;font-weight:600;overflow-wrap:anywhere}
dl.numbers div.addr{grid-column:1/-1}.addr dd{overflow-wrap:normal}.nb{white-space:nowrap}
figure{margin:.6rem 0}svg{display:block;width:100%;height:auto;overflow:visible}
svg text{fill:var(--muted);font-size:10px}svg line{stroke:var(--line)}
table{border-collapse:collapse;width:100%;font-size:.9rem}th,td{text-align:left;padding:.2rem .4rem;border-bottom:1px solid var(--line);vertical-align:top}
td.reason{overflow-wrap:anywhere;min-width:10rem}.wide{overflow-x:auto}
.legend span{margin-right:.8rem;white-space:nowrap}.legend i{display:inline-block;width:.7rem;height:.7rem;margin-right:.25rem;border-radius:.15rem}
polyline.ttft{fill:none;stroke:#1565c0;stroke-width:1.5}circle.ttft{fill:#1565c0}
rect.restarts{fill:#c62828}rect.gave-up{fill:#ef6c00}i.restarts{background:#c62828}i.gave-up{background:#ef6c00}
"""
# One colour per state, as the Grafana dashboard colours them (fleet/dashboard.json): a slow
# server is not a busy one, nor a dead one down; white text reads on each.
COLOURS: dict[str, str] = {
    State.HEALTHY: "#2e7d32",
    State.SLOW: "#a16207",
    State.BUSY: "#ea580c",
    State.STARTING: "#1565c0",
    State.WEDGED: "#c62828",
    State.DEAD: "#6a1b9a",
    State.DOWN: "#263238",
    UNKNOWN: "#8e8e8e",
}
CSS += "".join(
    f".s-{s}{{fill:{c}}}i.s-{s},.badge.s-{s}{{background:{c}}}section.s-{s}{{border-left-color:{c}}}"
    for s, c in COLOURS.items()
)
STYLE_HASH = base64.b64encode(hashlib.sha256(CSS.encode()).digest()).decode()
CSP = (
    f"default-src 'none'; style-src 'sha256-{STYLE_HASH}'; img-src data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def refresh_s(interval: float) -> int:
    """How often the page reloads: with the probing, between 5 s and a minute."""
    return int(min(60, max(5, round(interval))))


def render(
    doc: Status, days: dict[str, Day], now: float, reload_s: int, config: str | None = None
) -> str:
    """The page for a status document (as `/status` serves it) and each server's day."""
    servers = doc.servers
    down = [s for s in servers if not s.serving]
    title = f"{len(down)} of {len(servers)} unavailable" if down else "all serving"
    sections = "\n".join(
        _server(s, days.get(s.name) or Day(since=now - DAY, until=now), now, config)
        for s in servers
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="refresh" content="{reload_s}">
<link rel="icon" href="data:,">
<title>{escape(title)} · mlx-watchdog</title>
<style>{CSS}</style></head>
<body>
{_header(doc.watchdog, now, reload_s)}
<main>
{sections or '<p class="note">No servers are configured.</p>'}
</main>
</body></html>
"""


def _header(w: WatchdogLine, now: float, reload_s: int) -> str:
    problem = w.history_problem
    offset = time.strftime("%z", time.localtime(now))
    return (
        f"<header><h1>mlx-watchdog</h1><p>version {escape(str(w.version))}, "
        f"pid {escape(str(w.pid))}, probing every {_num(w.interval_s)} s. "
        f"As of {_clock(now)} (UTC{offset[:3]}:{offset[3:]}, the watchdog's time); this page "
        f"reloads every {reload_s} s. Read-only: actions need the API token.</p>"
        + (f'<p class="alert">History: {escape(str(problem))}</p>' if problem else "")
        + "</header>"
    )


def _server(s: ServerStatus, day: Day, now: float, config: str | None) -> str:
    fitted = _fit(day)
    state = s.state if s.state in SHOWN_STATES else UNKNOWN
    name = escape(s.name)
    return f"""<section class="server s-{state}" id="server-{name}" data-state="{state}">
<h2><span class="badge s-{state}">{state}</span>{name}</h2>
<p class="reason">{escape(s.reason)}</p>
{"".join(_notes(s, config))}
{_numbers(s, now, day)}
{_strip(day)}
{_timeline(fitted)}
{_ttft_chart(fitted)}
{_hourly(day)}
{_incidents(day, now)}
{_advice(s.name, day, now, config)}
{f'<p class="alert">{escape(day.problem)}</p>' if day.problem else ""}
</section>"""


def _notes(s: ServerStatus, config: str | None = None) -> Iterable[str]:
    for n in notes(s, config=config):
        then = f" Next: {escape(n.next)}" if n.next else ""
        css = "alert" if n.level == ALERT else "note"
        yield f'<p class="{css}">{escape(n.label)}: {escape(_cut(n.text))}.{then}</p>'


# /v1/models as the page says it (the status document names the finding).
MODELS_WORDS = {
    "ok": "answers",
    "empty_body": "200, empty body",
    "invalid_json": "not JSON",
    "http_error": "an HTTP error",
    "not_listed": "model not listed",
    "too_large": "answer too large",
    "refused": "refused",
    "timeout": "no answer in time",
    "error": "cannot be read",
}


def _served(day: Day) -> str:
    """The share of the day's probed time served; the span it is a share of, while that is
    not the whole day yet (a fresh watchdog's 2 minutes are not a day)."""
    up = uptime(day)
    if up is None:
        return "-"
    probed = sum(r.end - r.start for r in day.runs)
    of = "" if probed >= DAY - HOUR else f" of {_ago(probed).removesuffix(' ago')}"
    return f"{100 * up:.2f} %{of}"


def uptime(day: Day) -> float | None:
    """The share of the probed time of the day spent serving (healthy, slow or busy); None
    with nothing probed. Time not probed (the watchdog not running) counts for neither."""
    probed = sum(r.end - r.start for r in day.runs)
    if probed <= 0:
        return None
    serving = sum(r.end - r.start for r in day.runs if r.state in SERVING_STATES)
    return serving / probed


def _share(probed: float, serving: float) -> str:
    return "-" if probed <= 0 else f"{100 * min(1.0, serving / probed):.2f} %"


def _strip(day: Day) -> str:
    """The last probes, one mark each, newest at the right (as Uptime Kuma's heartbeat bar):
    what the last minutes were at a glance."""
    if not day.last_probes:
        return ""
    slot = WIDTH / STRIP
    first = STRIP - len(day.last_probes)
    marks = "".join(
        f'<rect class="probe s-{state if state in SHOWN_STATES else UNKNOWN}" '
        f'x="{round((first + i) * slot + 1, 1)}" y="0" width="{round(slot - 2, 1)}" height="16" '
        f'rx="2"><title>{escape(state)} {_clock(at)}</title></rect>'
        for i, (at, state) in enumerate(day.last_probes)
    )
    n = len(day.last_probes)
    return (
        f'<figure class="strip"><svg viewBox="0 0 {WIDTH} 16" role="img" '
        f'aria-label="the last {n} probes">{marks}</svg>'
        f"<figcaption>The last {n} probe{'s' if n != 1 else ''}, newest at the right.</figcaption>"
        "</figure>"
    )


def _numbers(s: ServerStatus, now: float, day: Day) -> str:
    last, since = s.last_token_at, s.state_since
    p50, p95 = s.ttft_p50_s, s.ttft_p95_s
    ttft = "none in the last hour" if p50 is None or p95 is None else f"{p50:.2f} s / {p95:.2f} s"
    items = [
        ("serving", "yes" if s.serving else "no"),
        ("last token", "never" if last is None else _ago(now - last)),
        ("TTFT p50 / p95 (1 h)", ttft),
        ("restarts (24 h)", str(s.restarts_24h)),
        ("restart budget left", _budget(s)),
        ("incidents (24 h)", str(s.incidents_24h)),
        ("clients that gave up (24 h)", str(s.gave_up_24h)),
        ("in the state since", "-" if since is None else _ago(now - since)),
        ("serving (24 h)", _served(day)),
        ("serving (30 d)", _share(*day.month)),
        ("manager", s.manager or "-"),
        ("PID", "-" if s.pid is None else str(s.pid)),
        ("memory", "-" if s.rss_bytes is None else f"{s.rss_bytes / 2**20:.0f} MiB"),
        ("/v1/models", MODELS_WORDS.get(s.models_finding or "", s.models_finding or "-")),
    ]
    cells = "".join(f"<div><dt>{escape(k)}</dt><dd>{escape(v)}</dd></div>" for k, v in items)
    address = f'<div class="addr"><dt>address</dt><dd>{_address(s.url)}</dd></div>'
    return f'<dl class="numbers">{cells}{address}</dl>'


def _address(url: str) -> str:
    """A URL that wraps only after its scheme, between its host's labels and before its
    path: never inside a label, and never between the host and its port."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return escape(url or "-")
    host, slash, path = rest.partition("/")
    labels = host.split(".")
    parts = [f"{scheme}://", *(f"{label}." for label in labels[:-1]), labels[-1]]
    parts += [f"{slash}{path}"] if slash else []
    return "<wbr>".join(f'<span class="nb">{escape(p)}</span>' for p in parts)


def _budget(s: ServerStatus) -> str:
    if s.budget_refill_s is None:
        return str(s.budget_left)
    back = f"one more in {_ago(s.budget_refill_s).removesuffix(' ago')}"
    return f"0: spent, {back}" if s.budget_left == 0 else f"{s.budget_left} ({back})"


def _x(at: float, day: Day) -> float:
    span = max(1.0, day.until - day.since)
    return round(min(WIDTH, max(0.0, (at - day.since) / span * WIDTH)), 1)


def _fit(day: Day) -> Day:
    """The charts' span fits what there is: the last hour while everything seen is younger
    than that (a fresh watchdog's first minutes are not a sliver at the right of a day)."""
    starts = [r.start for r in day.runs] + [at for at, _ in day.ttfts]
    if starts and day.until - min(starts) < HOUR:
        return replace(day, since=day.until - HOUR)
    return day


def _span(day: Day) -> str:
    return "last hour" if day.until - day.since <= HOUR else "last 24 hours"


def _axis(day: Day, y: int) -> str:
    """A tick and a clock label every six hours of the watchdog's local time (every ten
    minutes on an hour's span)."""
    marks = []
    step, every = (600.0, 1) if day.until - day.since <= HOUR else (HOUR, 6)
    first = (int(day.since // step) + 1) * step
    for at in (first + k * step for k in range(24)):
        local = time.localtime(at)
        due = local.tm_hour % every == 0 if every > 1 else True
        if at <= day.until and due:
            x = _x(at, day)
            marks.append(
                f'<line x1="{x}" x2="{x}" y1="0" y2="{y}"/>'
                f'<text x="{x}" y="{y + 11}" text-anchor="middle">{_clock(at, seconds=False)}</text>'
            )
    return "".join(marks)


def _timeline(day: Day) -> str:
    rects = "".join(
        f'<rect class="run s-{r.state}" x="{_x(r.start, day)}" y="0" height="24" '
        f'width="{max(0.5, round(_x(r.end, day) - _x(r.start, day), 1))}">'
        f"<title>{r.state} {_clock(r.start)} to {_clock(r.end)}</title></rect>"
        for r in day.runs
    )
    seen = sorted({r.state for r in day.runs}, key=SHOWN_STATES.index)
    legend = "".join(f'<span><i class="s-{s}"></i>{s}</span>' for s in seen)
    return (
        f'<figure class="timeline"><svg viewBox="0 0 {WIDTH} 40" role="img" '
        f'aria-label="state over the {_span(day)}">{_axis(day, 26)}{rects}</svg>'
        f"<figcaption>State, {_span(day)} ({len(day.runs)} "
        f"stretch{'es' if len(day.runs) != 1 else ''}; blank: not probed). "
        f'<span class="legend">{legend}</span></figcaption></figure>'
    )


def _ttft_chart(day: Day) -> str:
    points = day.ttfts
    if not points:
        return (
            '<figure class="ttft"><figcaption>Time to first token: no token in the '
            f"{_span(day)}.</figcaption></figure>"
        )
    top = max(t for _, t in points) * 1.1 or 1.0

    def y(t: float) -> float:
        return round(100 - t / top * 100, 1)

    # Points alone (a token between two gaps) as dots; the others as lines.
    shapes = "".join(
        f'<polyline class="ttft" points="{" ".join(f"{_x(at, day)},{y(t)}" for at, t in line)}"/>'
        if len(line) > 1
        else f'<circle class="ttft" cx="{_x(line[0][0], day)}" cy="{y(line[0][1])}" r="2"/>'
        for line in lines_of(points, day.step)
    )
    thinned = (
        f", the slowest of each of {len(points)} spans"
        if day.probes_with_token > len(points)
        else ""
    )
    return (
        f'<figure class="ttft"><svg viewBox="0 0 {WIDTH} 116" role="img" '
        f'aria-label="time to first token over the {_span(day)}">{_axis(day, 102)}'
        f'<text x="2" y="9">{top:.2f} s</text><text x="2" y="99">0 s</text>{shapes}</svg>'
        f"<figcaption>Time to first token of each probe, {_span(day)} "
        f"({day.probes_with_token} probes with a token{thinned}; a break: none for over "
        f"three probes).</figcaption></figure>"
    )


def _hourly(day: Day) -> str:
    top = max(1, *day.restarts, *day.gave_up)
    slot = WIDTH / 24
    bars = []
    for kind, counts, shift in (("restarts", day.restarts, 0.15), ("gave-up", day.gave_up, 0.5)):
        for h, n in enumerate(counts):
            if n:
                height = round(max(2.0, n / top * 44), 1)
                start = day.since + h * HOUR
                what = "restart" if kind == "restarts" else "client gave up"
                bars.append(
                    f'<rect class="{kind}" data-hour="{h}" data-count="{n}" '
                    f'x="{round(h * slot + shift * slot, 1)}" y="{round(46 - height, 1)}" '
                    f'width="{round(slot * 0.35, 1)}" height="{height}"><title>{n} '
                    f"{what}{'s' if n != 1 and kind == 'restarts' else ''} "
                    f"from {_clock(start, seconds=False)}</title></rect>"
                )
    return (
        f'<figure class="hourly"><svg viewBox="0 0 {WIDTH} 60" role="img" '
        f'aria-label="restarts and clients that gave up, per hour">{_axis(day, 46)}'
        f"{''.join(bars)}</svg><figcaption>Per hour, last 24 hours (tallest: {top}): "
        f'<span class="legend"><span><i class="restarts"></i>restarts ({sum(day.restarts)})</span>'
        f'<span><i class="gave-up"></i>clients that gave up ({sum(day.gave_up)})</span></span>'
        f"</figcaption></figure>"
    )


def _incidents(day: Day, now: float) -> str:
    if not day.incidents:
        return '<h3>Recent incidents</h3><p class="note">None in the last 24 hours.</p>'
    # Each reason in full once: a row with the same one as a newer row points to that row.
    rows: list[str] = []
    said: dict[str, int] = {}
    for i in day.incidents:
        acts = [
            f"{a.get('action', '?')}: {a.get('outcome', '?')}"
            for a in i.actions
            if isinstance(a, dict)
        ]
        more = len(acts) - ACTIONS_SHOWN
        done = ", ".join(acts[:ACTIONS_SHOWN]) + (f" and {more} more" if more > 0 else "")
        outage = "ongoing" if i.closed_at is None else f"{i.outage_s or 0:.0f} s"
        reason = _cut(i.reason) if i.reason not in said else f"as #{said[i.reason]}"
        said.setdefault(i.reason, i.id)
        rows.append(
            f'<tr class="incident"><td>{i.id}</td><td>{_clock(i.began_at)} ({_ago(now - i.began_at)})</td>'
            f"<td>{escape(i.state)}</td><td>{outage}</td>"
            f'<td class="reason">{escape(reason)}</td><td>{escape(done or "-")}</td>'
            f"<td>{escape(i.outcome or '-')}</td></tr>"
        )
    advised = next((i for i in day.incidents if i.advice), None)
    return (
        '<h3>Recent incidents</h3><div class="wide"><table><thead><tr><th>#</th><th>began</th>'
        "<th>state</th><th>outage</th><th>reason</th><th>what was done</th><th>outcome</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table></div>"
        + (
            f'<p class="advice">Advice from incident #{advised.id} '
            f"({_ago(now - advised.began_at)}): {escape(_cut(advised.advice or ''))}</p>"
            if advised
            else ""
        )
    )


def _advice(name: str, day: Day, now: float, config: str | None) -> str:
    a = day.advice
    if a is None:
        run = suggest("mlx-watchdog calibrate", config, server=name)
        return (
            '<h3>Timeouts clients need</h3><p class="note">Not calibrated yet: run '
            f"<code>{escape(run)}</code>.</p>"
        )
    when = "" if a["at"] is None else f" (calibrated {_ago(now - a['at'])})"
    return (
        f'<h3>Timeouts clients need</h3><p class="calibration">For a '
        f"{int(a['prompt_tokens']):,}-token prompt, about {a['prefill_s']:.0f} s to prefill{when}: "
        f"clients {a['client_s']:.0f} s, agent frameworks {a['agent_s']:.0f} s, load balancers "
        f"and proxies {a['load_balancer_s']:.0f} s. A layer that gives up sooner leaves the "
        f"server working for nobody.</p>"
    )


def _cut(text: str) -> str:
    return text if len(text) <= TEXT_SHOWN else text[:TEXT_SHOWN] + "..."


def _clock(at: float, seconds: bool = True) -> str:
    try:
        return time.strftime("%H:%M:%S" if seconds else "%H:%M", time.localtime(at))
    except (OverflowError, OSError, ValueError):  # a time no clock shows: a hand-edited row
        return "?"


def _ago(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f} s ago"
    if s < 7200:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def _num(value: object) -> str:
    return escape(f"{value:g}" if isinstance(value, int | float) else str(value))
