"""Request traces for bench/replay.py: the formats of shared/traces/, a slice of one, and the
derived file the project ships (one Mac's share of a production hour, attributed).

Sizes here are the field's (tokens on a Mac's model); replay.py scales them to this machine.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

BLOCK = 512  # tokens a Mooncake hash id stands for


@dataclass(frozen=True)
class Request:
    at: float  # s from the trace's start
    prompt: int  # tokens
    output: int  # tokens
    blocks: tuple[int, ...] = ()  # Mooncake's prefix ids: equal ids, equal text


class TraceError(ValueError):
    """A file that is not one of the trace formats; the message says which line and why."""


def read(path: Path) -> list[Request]:
    """Splitwise's CSV (arrived_at, num_prefill_tokens, num_decode_tokens), Mooncake's JSONL
    (timestamp ms, input_length, output_length, hash_ids), or the derived CSV (at_s, prompt,
    output, blocks; `#` lines say where it came from)."""
    try:
        with path.open(encoding="utf-8") as f:
            lines = [line for line in f if line.strip() and not line.startswith("#")]
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if not lines:
        raise TraceError(f"{path}: no requests")
    if lines[0].lstrip().startswith("{"):
        return sorted(_mooncake(path, lines), key=lambda r: r.at)
    return sorted(_csv(path, lines), key=lambda r: r.at)


def _request(at: float, prompt: int, output: int, blocks: tuple[int, ...]) -> Request:
    if not math.isfinite(at) or at < 0:
        raise ValueError(f"arrival {at} is not a time from the start")
    if prompt < 1 or output < 0:
        raise ValueError(f"sizes {prompt}, {output}: a prompt has a token, an answer none or more")
    return Request(at, prompt, output, blocks)


def _mooncake(path: Path, lines: list[str]) -> Iterator[Request]:
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise TypeError(f"a {type(row).__name__}, not an object")
            blocks = tuple(int(b) for b in row.get("hash_ids") or ())
            yield _request(
                float(row["timestamp"]) / 1000.0,
                int(row["input_length"]),
                int(row["output_length"]),
                blocks,
            )
        except (ValueError, KeyError, TypeError, OverflowError) as exc:
            raise TraceError(f"{path}: request {n} is not a Mooncake request: {exc}") from None


def _csv(path: Path, lines: list[str]) -> Iterator[Request]:
    try:
        reader = csv.DictReader(lines)
        names = set(reader.fieldnames or ())
        rows = list(reader)
    except csv.Error as exc:
        raise TraceError(f"{path}: not CSV: {exc}") from None
    if {"arrived_at", "num_prefill_tokens", "num_decode_tokens"} <= names:
        keys = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
    elif {"at_s", "prompt", "output"} <= names:
        keys = ("at_s", "prompt", "output")
    else:
        raise TraceError(f"{path}: columns {sorted(names)} are neither Splitwise's nor derived")
    for n, row in enumerate(rows, 1):
        try:
            blocks = tuple(int(b) for b in (row.get("blocks") or "").split())
            yield _request(
                float(row[keys[0]]), int(float(row[keys[1]])), int(float(row[keys[2]])), blocks
            )
        except (ValueError, TypeError, OverflowError) as exc:
            raise TraceError(f"{path}: request {n}: {exc}") from None


def derived(path: Path) -> bool:
    """A file already one Mac's share (this project's derived format)."""
    with path.open(encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip() and not line.startswith("#")), "")
    return first.startswith("at_s,")


def sliced(requests: Iterable[Request], start_min: float, minutes: float) -> list[Request]:
    """The requests of [start, start + minutes), their times from the slice's start."""
    begin, end = start_min * 60.0, (start_min + minutes) * 60.0
    return [
        Request(r.at - begin, r.prompt, r.output, r.blocks) for r in requests if begin <= r.at < end
    ]


def session(r: Request) -> tuple[int, ...]:
    """A conversation: Mooncake's first block is one system prompt shared by every request, the
    second starts a conversation, and its later turns extend it. Without blocks, itself."""
    return r.blocks[:2] if len(r.blocks) >= 2 else (-round(r.at * 1000), r.prompt, r.output)


def one_mac(
    requests: list[Request], *, load: float, mac_rate: float, seed: int
) -> tuple[list[Request], float]:
    """A seeded share of whole conversations (their prefix reuse kept) that keeps one Mac at
    `mac_rate` tokens a second busy `load` of the time; returns it and the share kept."""
    if not requests:
        return [], 0.0
    span = max(r.at for r in requests) - min(r.at for r in requests) or 60.0
    work = sum(_new_tokens(requests)) / mac_rate
    share = min(1.0, load * span / work) if work else 1.0
    rng = random.Random(seed)
    sessions = sorted({session(r) for r in requests})
    kept = {s for s in sessions if rng.random() < share}
    return [r for r in requests if session(r) in kept], share


def _new_tokens(requests: list[Request]) -> Iterator[int]:
    """Each request's tokens not in an earlier request's prefix (what a cache cannot serve)."""
    seen: set[tuple[int, ...]] = set()
    for r in requests:
        shared = 0
        for n in range(len(r.blocks), 0, -1):
            if r.blocks[:n] in seen:
                shared = n
                break
        seen.update(r.blocks[:n] for n in range(1, len(r.blocks) + 1))
        yield max(1, r.prompt - shared * BLOCK)


def write_derived(path: Path, requests: list[Request], header: list[str]) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        for line in header:
            f.write(f"# {line}\n")
        out = csv.writer(f)
        out.writerow(["at_s", "prompt", "output", "blocks"])
        for r in requests:
            out.writerow([f"{r.at:.3f}", r.prompt, r.output, " ".join(map(str, r.blocks))])
