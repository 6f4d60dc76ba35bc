"""Every command the docs show exists, with every option they give it: each is checked against
the command's own --help (a renamed option or a removed command fails here, not for a reader)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import mlx_watchdog

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
GROUPS = {"config", "prometheus", "server"}


def shown() -> dict[tuple[str, ...], set[str]]:
    """Each command path the docs show (in code blocks and inline code), with its options."""
    found: dict[tuple[str, ...], set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        args = [
            m.group(1)
            for block in blocks
            for line in block.splitlines()
            if (m := re.search(r"(?:^|[\s/])mlx-watchdog (.*)", line))
        ]
        args += re.findall(r"`(?:sudo )?mlx-watchdog ([^`]*)`", text)
        for arg in args:
            words = arg.split("#")[0].split("|")[0].split(">")[0]
            tokens = words.replace("[", " ").replace("]", " ").split()
            path: list[str] = []
            for t in tokens:
                if (path and path[0] not in GROUPS) or not re.fullmatch(r"[a-z][a-z-]*", t):
                    break
                path.append(t)
            if not path or path == ["--help"]:
                continue
            options = {t.split("=")[0] for t in tokens if t.startswith("--")} - {"--help"}
            found.setdefault(tuple(path), set()).update(options)
    return found


COMMANDS = shown()


def test_the_docs_show_commands_to_check() -> None:
    assert len(COMMANDS) >= 15, COMMANDS  # the extraction still finds them


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_each_command_in_the_docs_has_the_options_they_give_it(path: tuple[str, ...]) -> None:
    help_text = mlx_watchdog(*path, "--help", timeout=60)
    assert help_text.returncode == 0, (path, help_text.stderr)
    missing = sorted(o for o in COMMANDS[path] if o not in help_text.stdout)
    assert not missing, f"mlx-watchdog {' '.join(path)} has no {missing}"


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_a_usage_error_exits_3_as_the_readmes_table_says(path: tuple[str, ...]) -> None:
    """The README's exit-code table: a usage error (an unknown option) is 3, "unknown", for
    every command; never click's 2, which a check reads as critical."""
    typo = mlx_watchdog(*path, "--no-such-option", timeout=60)
    assert typo.returncode == 3, (path, typo.returncode, typo.stderr)


READS_CONFIG = {
    ("status",): (),
    ("history",): (),
    ("probe",): (),
    ("run",): (),
    ("doctor",): (),
    ("calibrate",): (),
    ("drill",): (),
    ("open",): (),
    ("config", "check"): (),
    ("restart",): ("x",),
    ("install",): ("--dry-run",),
}


@pytest.mark.parametrize("path", sorted(READS_CONFIG), ids=" ".join)
def test_a_bad_config_exits_3_naming_the_key_and_the_value(
    path: tuple[str, ...], tmp_path: Path
) -> None:
    assert path in COMMANDS  # shown in the docs
    bad = tmp_path / "bad.toml"
    bad.write_text('[watchdog]\ninterval = "soon"\n')
    done = mlx_watchdog(*path, "--config", str(bad), *READS_CONFIG[path], timeout=60)
    assert done.returncode == 3, (path, done.returncode, done.stdout, done.stderr)
    assert 'watchdog.interval = "soon"' in done.stderr, done.stderr


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_link_between_the_docs_lands_on_a_file_and_a_heading() -> None:
    broken = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            landed = (doc.parent / path).resolve() if path else doc
            if not landed.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and landed.suffix == ".md" and anchor not in anchors(landed):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken


def test_each_alert_links_to_its_own_section_of_the_runbook() -> None:
    from mlx_watchdog import fleet

    rules = fleet.rules()
    alerts = re.findall(r"- alert: (\w+)", rules)
    links = re.findall(r'runbook_url: "docs/runbook\.md#([^"]+)"', rules)
    assert len(alerts) >= 6 and links == [a.lower() for a in alerts]
    assert set(links) <= anchors(ROOT / "docs" / "runbook.md")


def test_every_config_the_docs_show_is_accepted_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each TOML block of the docs that holds servers or watchdog settings loads as a config
    (an api_key_file it names is made, private, in a home of its own)."""
    import tomllib

    from mlx_watchdog.config import parse_config

    monkeypatch.setenv("HOME", str(tmp_path))
    checked = 0
    for doc in DOCS:
        for block in re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S):
            data = tomllib.loads(block)
            if not {"server", "watchdog"} & set(data):
                continue
            for server in data.get("server", []):
                if "api_key_file" in server:
                    key = Path(server["api_key_file"]).expanduser()
                    key.parent.mkdir(parents=True, exist_ok=True)
                    key.write_text("secret\n")
                    key.chmod(0o600)
            parse_config(data)
            checked += 1
    assert checked >= 3


def test_every_cause_has_its_row_in_the_causes_table() -> None:
    from mlx_watchdog.judge.cause import Cause

    rows = re.findall(r"^\| `(\w+)` \|", (ROOT / "docs" / "causes.md").read_text(), re.M)
    assert sorted(rows) == sorted(c.value for c in Cause)
