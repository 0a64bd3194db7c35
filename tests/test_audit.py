"""audit.py: JSON lines appended to a file created owner-only, a new file after a rotation and SIGHUP (its
reopen), the truncated file after logrotate's copytruncate, stdout for "-", and the JWT subject only of a
verified credential."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import structlog

from proxy.observe.audit import AuditLog, subject
from proxy.principals import Identity


def read(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_carry_time_and_replica_and_leave_empty_fields_out(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), "replica-1", clock=lambda: 1_764_648_000.25)
    audit.write({"kind": "request", "method": "tools/call", "task_id": None})
    audit.close()
    assert read(path) == [
        {"time": "2025-12-02T04:00:00.250Z", "replica": "replica-1", "kind": "request", "method": "tools/call"}
    ]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_rotated_file_is_left_behind_at_reopen(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), "r")
    audit.write({"n": 1})
    path.rename(tmp_path / "audit.jsonl.1")  # logrotate's default: move the file away, then SIGHUP
    audit.write({"n": 2})  # still the moved file, until the reopen
    audit.reopen()
    audit.write({"n": 3})
    audit.close()
    assert [line["n"] for line in read(tmp_path / "audit.jsonl.1")] == [1, 2]
    assert [line["n"] for line in read(path)] == [3]


def test_copytruncate_needs_nothing_lines_go_on_at_the_start(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path), "r")
    audit.write({"n": 1})
    os.truncate(path, 0)  # logrotate's copytruncate: copied, then truncated in place
    audit.write({"n": 2})
    audit.close()
    assert path.read_bytes().startswith(b"{")  # no hole of NUL bytes before the next line (O_APPEND)
    assert [line["n"] for line in read(path)] == [2]


def test_a_dash_writes_to_stdout(capfd: pytest.CaptureFixture[str]) -> None:
    audit = AuditLog("-", "r")
    audit.write({"kind": "request"})
    audit.close()
    assert json.loads(capfd.readouterr().out)["kind"] == "request"


def test_a_failing_write_is_logged_not_raised(tmp_path: Path) -> None:
    audit = AuditLog(str(tmp_path / "audit.jsonl"), "r")
    assert audit._fd is not None
    os.close(audit._fd)  # as if the disk went away under it
    with structlog.testing.capture_logs() as logs:
        audit.write({"kind": "request"})
    audit._fd = None
    assert [entry["event"] for entry in logs] == ["audit_write_failed"]


def test_only_a_verified_credential_has_a_subject() -> None:
    assert subject(Identity("Bearer eyJ...", owner="https://issuer.example sub:alice")) == (
        "https://issuer.example sub:alice"
    )
    assert subject(Identity("Bearer opaque-token")) is None
    assert subject(None) is None
