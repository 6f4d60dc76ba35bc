"""The Prometheus rules and the Grafana dashboard, with the real tools: `promtool check rules`,
`promtool test rules` for every alert, and a real Prometheus scraping a real watchdog whose
server is wedged, its wedge alert reaching "firing"."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mlx_watchdog import fleet
from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from tests.conftest import BadByPidfile, DaemonThread, free_port, mlx_watchdog, until

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool")
BASE = "https://example.org/mlx-watchdog/docs/runbook.md"


def rules_file(tmp_path: Path, text: str | None = None) -> Path:
    path = tmp_path / "mlx-watchdog.rules.yml"
    path.write_text(text if text is not None else fleet.rules(BASE))
    return path


@needs_promtool
def test_the_rules_pass_promtool_check(tmp_path: Path) -> None:
    done = subprocess.run(
        ["promtool", "check", "rules", str(rules_file(tmp_path))], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 10 rules found" in done.stdout


@needs_promtool
@pytest.mark.parametrize("base", ['https://x/a"b', "C:\\docs\\README.md", "it's here"])
def test_a_runbook_base_with_quotes_or_backslashes_keeps_the_rules_valid(
    tmp_path: Path, base: str
) -> None:
    text = fleet.rules(base)
    doc = yaml.safe_load(text)
    urls = [
        r["annotations"]["runbook_url"] for g in doc["groups"] for r in g["rules"] if "alert" in r
    ]
    assert urls and all(u.startswith(base + "#") for u in urls)
    path = tmp_path / "rules.yml"
    path.write_text(text)
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_a_runbook_base_with_template_braces_keeps_the_rules_valid(tmp_path: Path) -> None:
    """An annotation is a Go template: "{{" opened an action and promtool refused the file.
    It is written as an action that prints it."""
    text = fleet.rules("https://x/{{ a }}/b")
    doc = yaml.safe_load(text)
    urls = [
        r["annotations"]["runbook_url"] for g in doc["groups"] for r in g["rules"] if "alert" in r
    ]
    assert urls and all(u.startswith('https://x/{{ "{{" }} a }}/b#') for u in urls)
    path = tmp_path / "rules.yml"
    path.write_text(text)
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_runbook_base_with_a_control_character_is_refused() -> None:
    run = mlx_watchdog("prometheus", "rules", "--runbook-base", "https://x/a\x1bb")
    assert run.returncode == 3 and "control character" in run.stderr


def test_a_runbook_base_is_an_absolute_url_or_the_links_are_said_relative() -> None:
    """Alertmanager makes a link only of an absolute URL."""
    relative = mlx_watchdog("prometheus", "rules", "--runbook-base", "docs/README.md")
    assert relative.returncode == 3 and "must be an absolute http(s) URL" in relative.stderr
    bare = mlx_watchdog("prometheus", "rules")
    assert bare.returncode == 0 and "runbook_url is relative" in bare.stderr
    assert 'runbook_url: "docs/runbook.md#' in bare.stdout


def alerts() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(fleet.rules(BASE))
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def expected(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """What promtool must see: the rule's labels and its annotations filled for `labels`."""
    rule = alerts()[name]
    notes = {
        k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], v)
        for k, v in rule["annotations"].items()
    }
    return {"exp_labels": {**labels, **rule["labels"]}, "exp_annotations": notes}


@needs_promtool
def test_each_alert_fires_after_its_for_and_not_on_a_busy_server(tmp_path: Path) -> None:
    mac1 = {"instance": "mac1:9464", "job": "mlx-watchdog", "server": "qwen"}
    mac2 = {"instance": "mac2:9464", "job": "mlx-watchdog", "server": "qwen"}

    def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return {"series": f"{name}{{{inner}}}", "values": values}

    tests = [
        {  # wedged from minute 1 on mac1; mac2 is busy (serving a long request) all along
            "interval": "1m",
            "input_series": [
                series("mlx_watchdog_state", {**mac1, "state": "wedged"}, "0 1 1 1 1 1"),
                series("mlx_watchdog_state", {**mac2, "state": "wedged"}, "0 0 0 0 0 0"),
                series("mlx_watchdog_state", {**mac2, "state": "busy"}, "1 1 1 1 1 1"),
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "MLXServerWedged", "exp_alerts": []},
                {
                    "eval_time": "4m",
                    "alertname": "MLXServerWedged",
                    "exp_alerts": [expected("MLXServerWedged", {**mac1, "state": "wedged"})],
                },
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                series("mlx_watchdog_needs_person", mac1, "0 1 1 1"),
                series("mlx_watchdog_needs_person", mac2, "0 0 0 0"),
                series(
                    "mlx_watchdog_history_in_memory",
                    {"instance": "mac1:9464", "job": "mlx-watchdog"},
                    "1x20",
                ),
                series("up", {"instance": "mac2:9464", "job": "mlx-watchdog"}, "1 1 0 0 0 0 0 0 0"),
                series("mlx_watchdog_abandoned_connections", mac1, "0 0 2 0 0"),
                series("mlx_watchdog_abandoned_connections", mac2, "0 0 0 0 0"),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "3m",
                    "alertname": "MLXServerNeedsPerson",
                    "exp_alerts": [expected("MLXServerNeedsPerson", mac1)],
                },
                {"eval_time": "5m", "alertname": "MLXWatchdogDown", "exp_alerts": []},
                {
                    "eval_time": "8m",
                    "alertname": "MLXWatchdogDown",
                    "exp_alerts": [
                        expected(
                            "MLXWatchdogDown", {"instance": "mac2:9464", "job": "mlx-watchdog"}
                        )
                    ],
                },
                {"eval_time": "9m", "alertname": "MLXWatchdogHistoryInMemory", "exp_alerts": []},
                {
                    "eval_time": "11m",
                    "alertname": "MLXWatchdogHistoryInMemory",
                    "exp_alerts": [
                        expected(
                            "MLXWatchdogHistoryInMemory",
                            {"instance": "mac1:9464", "job": "mlx-watchdog"},
                        )
                    ],
                },
                {
                    "eval_time": "4m",
                    "alertname": "MLXClientsGiveUp",
                    "exp_alerts": [expected("MLXClientsGiveUp", mac1)],
                },
            ],
        },
        {  # 5 restarts within the hour on mac1, 1 on mac2
            "interval": "10m",
            "input_series": [
                series(
                    "mlx_watchdog_restarts_total", {**mac1, "reason": "wedged"}, "0 1 2 3 4 5 5"
                ),
                series(
                    "mlx_watchdog_restarts_total", {**mac2, "reason": "wedged"}, "0 1 1 1 1 1 1"
                ),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "60m",
                    "alertname": "MLXServerRestartsHigh",
                    "exp_alerts": [
                        expected(
                            "MLXServerRestartsHigh",
                            {k: v for k, v in mac1.items() if k != "job"},
                        )
                    ],
                },
            ],
        },
    ]
    rules = rules_file(tmp_path)
    spec = tmp_path / "tests.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "tests": tests}))
    done = subprocess.run(
        ["promtool", "test", "rules", spec.name], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_commands_print_the_rules_and_a_dashboard_of_metrics_that_exist(
    tmp_path: Path, hanging: BadByPidfile, run_daemon: Callable[[object], DaemonThread]
) -> None:
    printed = mlx_watchdog("prometheus", "rules", "--runbook-base", BASE)
    assert printed.returncode == 0, printed.stderr
    assert yaml.safe_load(printed.stdout) == yaml.safe_load(fleet.rules(BASE))
    assert f"{BASE}#mlxserverwedged" in printed.stdout and "@RUNBOOK@" not in printed.stdout
    board = mlx_watchdog("prometheus", "dashboard")
    assert board.returncode == 0, board.stderr
    doc = json.loads(board.stdout)
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"mlx_watchdog[a-z_:0-9]+", e)}
    used |= {m for e in [fleet.rules()] for m in re.findall(r"mlx_watchdog_[a-z_]+", e)}

    # Every metric they read is one a real watchdog exports (or a rule records).
    daemon = Daemon(parse_config(watched(tmp_path, hanging))).open()
    t = run_daemon(daemon)
    until(lambda: daemon.endpoint is not None and daemon.cycles["bad"].verdict, 30, "a verdict")
    host, port = daemon.endpoint.server_address[:2]  # type: ignore[union-attr]
    text = httpx.get(f"http://{host}:{port}/metrics").text
    # Families, as `# TYPE` names them (a counter with no sample yet still has its family).
    families = set(re.findall(r"^# TYPE (mlx_watchdog_[a-z_]+) ", text, re.MULTILINE))
    exported = {f + s for f in families for s in ("", "_total", "_bucket", "_sum", "_count")}
    recorded = {
        r["record"]
        for g in yaml.safe_load(fleet.rules())["groups"]
        for r in g["rules"]
        if "record" in r
    }
    missing = {m for m in used if m not in exported and m not in recorded}
    assert missing == set(), missing
    t.stop()


@needs_promtool
def test_each_state_is_one_code_per_server(tmp_path: Path) -> None:
    """The dashboard colours a server by mlx_watchdog:state:code: checked with promtool."""
    states = ("healthy", "busy", "slow", "starting", "wedged", "dead", "down", "unknown")
    now = {"mac1:9464": "wedged", "mac2:9464": "busy", "mac3:9464": "unknown"}
    series = [
        {
            "series": f'mlx_watchdog_state{{instance="{i}",job="mlx-watchdog",server="qwen",'
            f'state="{s}"}}',
            "values": "1" if s == state else "0",
        }
        for i, state in now.items()
        for s in states
    ]
    expected = [
        {"labels": f'mlx_watchdog:state:code{{instance="{i}",server="qwen"}}', "value": code}
        for i, code in (("mac1:9464", 4), ("mac2:9464", 1), ("mac3:9464", 7))
    ]
    test = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [
            {"expr": "mlx_watchdog:state:code", "eval_time": "0m", "exp_samples": expected}
        ],
    }
    rules = rules_file(tmp_path)
    spec = tmp_path / "tests.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "tests": [test]}))
    done = subprocess.run(
        ["promtool", "test", "rules", spec.name], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dashboard_reads_at_a_glance() -> None:
    """Filtered by instance and server everywhere, states coloured by what they mean, and
    what a person needs first at the top."""
    doc = json.loads(fleet.dashboard())
    names = [v["name"] for v in doc["templating"]["list"]]
    assert names == ["datasource", "instance", "server"]
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    for name in names[1:]:
        assert all(f'{name}=~"${name}"' in e for e in exprs), name
    assert all(p["datasource"]["uid"] == "${datasource}" for p in doc["panels"])
    colours: dict[str, str] = {}
    for p in doc["panels"]:
        if "mlx_watchdog:state:code" in p["targets"][0]["expr"]:
            (mapping,) = p["fieldConfig"]["defaults"]["mappings"]
            shown = {o["text"]: o["color"] for o in mapping["options"].values()}
            assert not colours or shown == colours
            colours = shown
    from mlx_watchdog.serve.page import COLOURS

    assert colours == COLOURS  # one colour per state, as the page shows them
    top = {p["title"] for p in doc["panels"] if p["gridPos"]["y"] == 0}
    assert {"State now", "A person is needed", "Restart budget left"} <= top
    # The codes the dashboard maps are the codes the rule records.
    rule = next(
        r["expr"]
        for g in yaml.safe_load(fleet.rules())["groups"]
        for r in g["rules"]
        if r.get("record") == "mlx_watchdog:state:code"
    )
    coded = dict(re.findall(r'state="([a-z]+)"\} == 1\) \* (\d)', rule))
    (mapping,) = next(p for p in doc["panels"] if p["title"] == "State now")["fieldConfig"][
        "defaults"
    ]["mappings"]
    assert {o["text"]: code for code, o in mapping["options"].items()} == coded
    assert len(coded) == 8


def watched(tmp_path: Path, bad: BadByPidfile) -> dict[str, object]:
    return {
        "watchdog": {
            "interval": "500ms",
            "listen": "127.0.0.1:0",
            "state_dir": str(tmp_path / "state"),
        },
        "server": [
            {
                "name": "bad",
                "url": bad.url,
                "match": "badserver",
                "probe": {"slow_after": "500ms", "wedge_after": "1s", "startup_grace": "1s"},
            }
        ],
    }


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus")
def test_a_real_prometheus_fires_the_wedge_alert_for_a_real_watchdog(
    tmp_path: Path, hanging: BadByPidfile, run_daemon: Callable[[object], DaemonThread]
) -> None:
    daemon = Daemon(
        parse_config(watched(tmp_path, hanging))
    ).open()  # observe only: it stays wedged
    run_daemon(daemon)
    until(lambda: daemon.endpoint is not None, 30, "the endpoint")
    host, port = daemon.endpoint.server_address[:2]  # type: ignore[union-attr]
    # The rules as shipped, but for: 2m is 2s here, so the test does not wait two minutes.
    rules = rules_file(tmp_path, fleet.rules(BASE).replace("for: 2m", "for: 2s"))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {
                        "job_name": "mlx-watchdog",
                        "static_configs": [{"targets": [f"{host}:{port}"]}],
                    }
                ],
            }
        )
    )
    web = free_port()
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def firing() -> bool:
            try:
                doc = httpx.get(f"http://127.0.0.1:{web}/api/v1/alerts", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                return False
            return any(
                a["labels"]["alertname"] == "MLXServerWedged"
                and a["state"] == "firing"
                and a["labels"]["server"] == "bad"
                for a in doc["data"]["alerts"]
            )

        until(firing, 90, "the wedge alert to fire")
        assert daemon.cycles["bad"].verdict is not None
        assert daemon.cycles["bad"].verdict.state == "wedged"
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(20)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()


def test_fleet_shows_machines_side_by_side_with_how_often_each_is_provoked(
    tmp_path: Path, hanging: BadByPidfile, run_daemon: Callable[[object], DaemonThread]
) -> None:
    import socket

    (tmp_path / "ok").mkdir()
    ok = BadByPidfile(tmp_path / "ok", "ok")
    try:
        wedged = Daemon(parse_config(watched(tmp_path / "a", hanging))).open()
        serving = Daemon(parse_config(watched(tmp_path / "b", ok))).open()
        for d in (wedged, serving):
            run_daemon(d)
        until(lambda: wedged.endpoint and serving.endpoint, 30, "both endpoints")
        # A client that gives up on the wedged server: counted once, however long it lingers.
        with socket.create_connection(("127.0.0.1", hanging.port)) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
            )
        until(
            lambda: (
                wedged.status().servers[0].gave_up_24h == 1
                and wedged.status().servers[0].state == "wedged"
            ),
            30,
            "the departed client counted and the wedge judged",
        )
        until(lambda: serving.status().servers[0].state == "healthy", 30, "healthy")
        urls = []
        for d in (wedged, serving):
            host, port = d.endpoint.server_address[:2]  # type: ignore[union-attr]
            urls.append(f"http://{host}:{port}")
        silent = f"http://127.0.0.1:{free_port()}"

        both = mlx_watchdog("fleet", *urls, "--json")
        assert both.returncode == 2, both.stderr  # the worst: a wedged server
        rows = json.loads(both.stdout)["rows"]
        assert [(r["machine"], r["state"]) for r in rows] == [
            (urls[0], "wedged"),
            (urls[1], "healthy"),
        ]
        assert rows[0]["incidents_24h"] == 1 and rows[0]["gave_up_per_hour"] == round(1 / 24, 2)
        assert rows[1]["incidents_24h"] == 0 and rows[1]["gave_up_per_hour"] == 0

        with_silent = mlx_watchdog("fleet", urls[1], silent)
        assert with_silent.returncode == 3  # a watchdog that does not answer is unknown
        assert "unreachable" in with_silent.stdout and "healthy" in with_silent.stdout
    finally:
        ok.kill()
