"""`mlx-watchdog doctor` against good and bad setups, and the LiteLLM config it reads."""

from __future__ import annotations

import os
import plistlib
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from mlx_watchdog.act.managers import System
from mlx_watchdog.advice.calibrate import Calibration, Fit, Point, advise
from mlx_watchdog.advice.doctor import Finding, exit_code, run_doctor
from mlx_watchdog.advice.litellm import LiteLLMConfigError, fallback_problems, load
from mlx_watchdog.config import Config, parse_config
from mlx_watchdog.record.store import Store
from tests.conftest import Running, mlx_watchdog


def setup(
    tmp_path: Path, url: str, *, key_mode: int | None = None, calibrated: bool = True
) -> Config:
    server: dict[str, object] = {"name": "mac1", "url": url}
    if key_mode is not None:
        key = tmp_path / "key"
        key.write_text("not-the-real-key\n")
        key.chmod(key_mode)
        server["api_key_file"] = str(key)
    config = parse_config({"watchdog": {"state_dir": str(tmp_path / "state")}, "server": [server]})
    if calibrated:
        cal = Calibration(
            "mac1", time.time(), (Point(1024, 0.5), Point(4096, 2.0)), Fit(0, 1 / 2000, 0), 50.0
        )
        store = Store(tmp_path / "state" / "history.db")
        store.save_calibration(
            "mac1", cal.at, {**cal.to_json(), "advice": advise(cal, 64 * 1024).to_json()}
        )
        store.close()
    return config


def litellm(
    tmp_path: Path, url: str, *, timeout: int, retries: int, fallbacks: str, cancel: bool = True
) -> Path:
    path = tmp_path / "litellm.yaml"
    path.write_text(
        f"""model_list:
  - model_name: qwen-mac1
    litellm_params: {{model: openai/qwen, api_base: "{url}/v1", timeout: {timeout}, stream_timeout: {timeout}}}
  - model_name: qwen-mac1-again
    litellm_params: {{model: openai/qwen, api_base: "{url}/v1", timeout: {timeout}}}
  - model_name: qwen-mac2
    litellm_params: {{model: openai/qwen, api_base: "http://10.0.0.12:8080/v1", timeout: 900}}
router_settings:
  num_retries: {retries}
  fallbacks: {fallbacks}
general_settings: {{cancel_on_disconnect: {str(cancel).lower()}}}
"""
    )
    return path


def doctor(config: Config, tmp_path: Path, litellm_path: Path | None = None) -> list[Finding]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return list(run_doctor(config, litellm=litellm_path, home=home, env={"HOME": str(home)}))


def by_level(findings: list[Finding], level: str) -> list[str]:
    return [f"{f.what}: {f.detail}" for f in findings if f.level == level]


@pytest.mark.real_server
def test_a_good_setup_has_no_problems(batched_server: Running, tmp_path: Path) -> None:
    config = setup(tmp_path, batched_server.url, key_mode=0o600)
    ll = litellm(
        tmp_path,
        batched_server.url,
        timeout=900,
        retries=0,
        fallbacks='[{"qwen-mac1": ["qwen-mac2"]}]',
    )
    findings = doctor(config, tmp_path, ll)
    assert by_level(findings, "problem") == []
    ok = "\n".join(by_level(findings, "ok"))
    assert "config: valid" in ok and "mac1: serves: first token in" in ok
    assert "probe cost: 1 prompt token(s) computed" in ok or "probe cost: 0 prompt" in ok
    assert "batched (no --draft-model)" in ok and "is private (mode 600)" in ok
    assert "calibrated 1 min ago: a 64k-token prompt needs about" in ok
    assert 'litellm: "qwen-mac1" (' in ok and "outlasts the prefill" in ok
    warnings = "\n".join(by_level(findings, "warning"))
    assert "not installed as a" in warnings and "watchdog: the watchdog is not running" in warnings
    assert "cancel_on_disconnect" not in warnings
    assert exit_code(findings) == 1


@pytest.mark.real_server
def test_a_bad_setup_is_explained_with_fixes(serial_server: Running, tmp_path: Path) -> None:
    config = setup(tmp_path, serial_server.url, key_mode=0o644)
    ll = litellm(
        tmp_path,
        serial_server.url,
        timeout=60,
        retries=2,
        fallbacks='[{"qwen-mac1": ["qwen-mac1-again", "qwen-mac2"]}]',
        cancel=False,
    )
    findings = doctor(config, tmp_path, ll)
    problems = "\n".join(by_level(findings, "problem"))
    assert "is readable by others (mode 644)" in problems
    assert (
        '"qwen-mac1" (' in problems and "timeout 60 s, stream_timeout 60 s, below the" in problems
    )
    assert (
        'fallback "qwen-mac1" -> "qwen-mac1-again" retries on the deployment that just failed'
        in problems
    )
    warnings = "\n".join(by_level(findings, "warning"))
    assert "serves one request at a time" in warnings and "num_retries = 2" in warnings
    assert "no general_settings.cancel_on_disconnect: a client that gives up at" in warnings
    assert all(f.fix for f in findings if f.level == "problem")
    assert exit_code(findings) == 2


def test_a_server_that_is_down_and_never_calibrated(tmp_path: Path) -> None:
    config = setup(tmp_path, "http://127.0.0.1:1", calibrated=False)
    findings = doctor(config, tmp_path)
    assert any(f.level == "problem" and "no generation" in f.detail for f in findings)
    assert any(f.level == "warning" and "never calibrated" in f.detail for f in findings)


def test_malformed_litellm_yaml_is_a_clear_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text('model_list:\n  - model_name: a\n    litellm_params: {api_base: "x"\n')
    with pytest.raises(LiteLLMConfigError, match=r"bad.yaml: not valid YAML at line 4, column 1"):
        load(bad)
    config = setup(tmp_path, "http://127.0.0.1:1", calibrated=False)
    (finding,) = [f for f in doctor(config, tmp_path, bad) if f.what == "litellm"]
    assert finding.level == "problem" and "not valid YAML at line 4" in finding.detail


def test_the_docs_litellm_config_ends_a_departed_clients_request_and_a_fifo_is_no_config(
    tmp_path: Path,
) -> None:
    """Issue 55: LiteLLM 1.110.2's proxy kept its upstream connection open for a whole 34 s
    prefill after its client left at 1 s; with `general_settings.cancel_on_disconnect: true`
    the server's side was in CLOSE_WAIT within 50 ms (docs/endpoint.md). The docs' file sets
    it, so doctor reads it there; a FIFO named as the file is refused, not waited on."""
    from tests.balancing import docs_block

    path = tmp_path / "litellm.yaml"
    path.write_text(docs_block("yaml"))
    assert load(path).cancel_on_disconnect
    path.write_text(docs_block("yaml").replace("cancel_on_disconnect: true", "x: 1"))
    assert not load(path).cancel_on_disconnect
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(LiteLLMConfigError, match=r"fifo\.yaml: cannot read"):
        load(fifo)


def test_litellm_shapes_that_are_not_a_config(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    for text, message in (
        ("- a\n- b\n", "a mapping with a model_list"),
        ("general_settings: {}\n", "model_list is missing"),
        ("model_list:\n  - litellm_params: {}\n", "model_list\\[0\\] has no model_name"),
        (
            "model_list:\n  - model_name: a\n    litellm_params: {timeout: soon}\n",
            "a.timeout = 'soon'",
        ),
    ):
        path.write_text(text)
        with pytest.raises(LiteLLMConfigError, match=message):
            load(path)


def test_a_fallback_to_the_same_machine_first(tmp_path: Path) -> None:
    path = tmp_path / "l.yaml"
    path.write_text(
        """model_list:
  - {model_name: big, litellm_params: {api_base: "http://mac1:8080/v1"}}
  - {model_name: small, litellm_params: {api_base: "http://mac1:8081/v1"}}
  - {model_name: other, litellm_params: {api_base: "http://mac2:8080/v1"}}
router_settings:
  fallbacks: [{"big": ["small", "other"]}, {"small": ["other"]}]
"""
    )
    (problem,) = fallback_problems(load(path))
    assert problem.startswith('fallback "big" goes to the same machine first (mac1)')


def test_doctor_command_exit_code_and_json(tmp_path: Path) -> None:
    import json

    config = tmp_path / "c.toml"
    config.write_text(
        f'[watchdog]\nstate_dir = "{tmp_path / "s"}"\n[[server]]\nurl = "http://127.0.0.1:1"\n'
    )
    proc = mlx_watchdog("doctor", "--config", str(config), "--json", env={"HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    findings = json.loads(proc.stdout)
    levels = {f["level"] for f in findings}
    assert levels == {"ok", "note", "warning", "problem"}
    # the notes are the kind's known failure modes (mlx_lm by default), each with what avoids it
    notes = [f for f in findings if f["level"] == "note"]
    # manager = "none" (the default): said first, with what to do; then the failure modes
    assert notes[0]["detail"].startswith('manager = "none": the watchdog only watches')
    assert "restart it yourself" in notes[0]["fix"]
    modes = notes[1:]
    assert modes and all(f["detail"].startswith("mlx_lm.server: ") and f["fix"] for f in modes)


def test_on_a_mac_doctor_names_what_launchd_jobs_trip_over(tmp_path: Path) -> None:
    from mlx_watchdog.advice.doctor import mac_findings
    from mlx_watchdog.config import parse_config

    class Headless(System):
        def run(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
            assert list(argv) == ["launchctl", "print", f"gui/{self.uid()}"]
            return 113, "Could not find domain"

    home = tmp_path / "home"
    config = parse_config(
        {
            "watchdog": {"alerts": ["macosx://", "ntfy://topic"]},
            "server": [
                {
                    "url": "http://127.0.0.1:8080",
                    "manager": "process",
                    "command": ["mlx_lm.server", "--model", str(home / "Downloads" / "qwen")],
                }
            ],
        }
    )
    findings = list(mac_findings(config, home, Headless(), python="/Volumes/ext/venv/bin/python"))
    text = [(f.level, f.what, f.detail) for f in findings]
    assert any(lvl == "warning" and "GUI session" in d for lvl, _, d in text), text
    assert any("~/Downloads" in d and "qwen" in d for _, _, d in text), text
    assert any("an external volume" in d for _, _, d in text), text
    notifier = [f for f in findings if "terminal-notifier" in f.detail]
    assert notifier and notifier[0].fix == "brew install terminal-notifier"  # not on Linux

    calm = parse_config({"server": [{"url": "http://127.0.0.1:8080"}]})
    assert list(mac_findings(calm, home, Headless(), python="/opt/venv/bin/python")) == []


def test_a_state_folder_others_can_write_is_a_problem_with_its_fix(tmp_path: Path) -> None:
    config = setup(tmp_path, "http://127.0.0.1:1", calibrated=False)
    state = config.watchdog.state_dir
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(0o700)
    fine = [f for f in doctor(config, tmp_path) if f.what == "state"]
    assert [f.level for f in fine] == ["ok"]
    state.chmod(0o777)
    try:
        (found,) = [f for f in doctor(config, tmp_path) if f.what == "state"]
    finally:
        state.chmod(0o700)
    assert found.level == "problem" and f"run: chmod 700 {state}" in found.detail


def test_a_retry_loop_in_the_history_is_named_with_the_timeout_it_needs(tmp_path: Path) -> None:
    config = setup(tmp_path, "http://127.0.0.1:1")
    store = Store(tmp_path / "state" / "history.db")
    now = time.time()
    for n, (tokens, waited) in enumerate(((43_118, 55.0), (43_120, 54.0), (43_200, 56.5))):
        evidence = {"prefill_total": tokens, "gave_up_after_s": [waited], "prefill_rate_tps": 312.0}
        store.open_incident("mac1", now - 3000 + n * 600, "wedged", "wedged: ...", evidence)
    store.close()
    loops = [f for f in doctor(config, tmp_path) if "retry loop" in f.detail]
    assert len(loops) == 1 and loops[0].level == "warning" and loops[0].what == "mac1"
    assert loops[0].detail == (
        "a retry loop in the last day: a client resends a ~43k-token prompt and gives up after "
        "~55 s each time (3 times); at 312 tok/s it needs ~138 s; it will never succeed until "
        "its timeout is above 170 s"
    )
    assert "raise that client's timeout" in loops[0].fix


def test_each_command_doctor_suggests_works_as_typed(tmp_path: Path) -> None:
    """A config in a folder of its own (a space in its name): the commands doctor suggests
    carry it, so typed as shown they find the server; without --config they would not."""
    import json
    import shlex
    import sys

    folder = tmp_path / "my configs"
    folder.mkdir()
    cfg = folder / "w.toml"
    cfg.write_text(
        f'[watchdog]\nstate_dir = "{tmp_path / "state"}"\nlisten = "off"\n'
        '[[server]]\nname = "m64"\nurl = "http://127.0.0.1:9"\n'
    )
    run = mlx_watchdog("doctor", "--config", str(cfg), "--json")
    found = json.loads(run.stdout)
    fixes = [f["fix"] for f in found if f["fix"].startswith("mlx-watchdog calibrate")]
    assert fixes, run.stdout
    for fix in fixes:
        argv = shlex.split(fix)
        assert argv[:2] == ["mlx-watchdog", "calibrate"] and str(cfg) in argv, fix
        typed = subprocess.run(
            [sys.executable, "-m", "mlx_watchdog", *argv[1:]],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env={k: v for k, v in os.environ.items() if k != "MLX_WATCHDOG_CONFIG"},
        )
        said = typed.stdout + typed.stderr
        assert "no server named" not in said and "m64" in said, said
    human = mlx_watchdog("doctor", "--config", str(cfg))
    assert f"calibrate --config {shlex.quote(str(cfg))} --server m64" in human.stdout


def test_config_init_takes_its_path_as_an_argument(tmp_path: Path) -> None:
    target = tmp_path / "new.toml"
    run = mlx_watchdog("config", "init", str(target))
    assert run.returncode == 0 and target.exists(), run.stderr
    assert mlx_watchdog("config", "check", "--config", str(target)).returncode == 0
    both = mlx_watchdog("config", "init", str(target), "--config", str(tmp_path / "other.toml"))
    assert both.returncode == 3 and "two places given" in both.stderr


def test_the_deadline_a_resent_prompt_needs_is_named_from_the_last_days_recoveries(
    tmp_path: Path,
) -> None:
    """Read from the recovered events' data, never from their prose: a hand-edited value that
    is not text, an older one beyond the day or another server's, are left out."""
    config = setup(tmp_path, "http://127.0.0.1:1")
    store = Store(tmp_path / "state" / "history.db")
    now = time.time()
    said = "a client resent an abandoned ~29 KiB prompt; ... a client deadline above 30 s"
    store.add_event("mac1", now - 2 * 86400, "recovered", "old", {"resent": "two days ago"})
    store.add_event("other", now - 60, "recovered", "x", {"resent": "another server's"})
    store.add_event("mac1", now - 120, "recovered", "serving again", {"resent": said})
    store.add_event("mac1", now - 60, "recovered", "a resent prompt, says it", {"resent": 7})
    store.close()
    found = [f for f in doctor(config, tmp_path) if f.detail.startswith("in the last day")]
    assert [(f.level, f.what, f.detail) for f in found] == [
        ("warning", "mac1", f"in the last day {said}")
    ]


def test_a_launchd_job_without_process_type_interactive_is_named_with_the_key(
    tmp_path: Path,
) -> None:
    from mlx_watchdog.advice.doctor import process_type

    plist = tmp_path / "com.example.mlx-server.plist"
    job = {"Label": "com.example.mlx-server", "ProgramArguments": ["mlx_lm.server"]}
    plist.write_bytes(plistlib.dumps(job))
    raw = {
        "watchdog": {"state_dir": str(tmp_path / "state")},
        "server": [
            {
                "name": "mac1",
                "url": "http://127.0.0.1:1",
                "manager": "launchd",
                "label": "com.example.mlx-server",
                "plist": str(plist),
            }
        ],
    }
    findings = doctor(parse_config(raw), tmp_path)
    (said,) = [f for f in findings if "ProcessType" in f.detail]
    assert said.level == "warning" and "no ProcessType" in said.detail
    assert "<key>ProcessType</key><string>Interactive</string>" in said.fix
    plist.write_bytes(plistlib.dumps({**job, "ProcessType": "Background"}))
    assert process_type(plist) == ("Background", None)
    plist.write_bytes(plistlib.dumps({**job, "ProcessType": "Interactive"}))
    findings = doctor(parse_config(raw), tmp_path)
    assert any(f.level == "ok" and "ProcessType Interactive" in f.detail for f in findings)
    for garbage in (b"<plist><dict><key>x", b"\x00garbage", plistlib.dumps([1, 2])):
        plist.write_bytes(garbage)
        kind, problem = process_type(plist)
        assert kind is None and problem is not None and str(plist) in problem
    assert process_type(tmp_path / "absent.plist")[1] is not None


def test_a_server_process_the_system_holds_back_is_named(
    tmp_path: Path, bad_server: Callable[..., Running]
) -> None:
    if sys.platform == "darwin":
        pytest.skip("macOS reads ps -o pri=, not nice")
    srv = bad_server("ok", under=("nice", "-n", "15"))
    config = parse_config(
        {
            "watchdog": {"state_dir": str(tmp_path / "state")},
            "server": [{"name": "mac1", "url": srv.url, "match": "badserver"}],
        }
    )
    findings = doctor(config, tmp_path)
    (said,) = [f for f in findings if "holds its process" in f.detail]
    assert said.level == "warning" and f"PID {srv.proc.pid}" in said.detail
    assert "nice 1" in said.detail and "ProcessType Interactive" in said.fix
