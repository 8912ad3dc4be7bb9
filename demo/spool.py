"""The spool: how experience travels from the collectors to the trainer, through a directory.

A collector writes each batch as a TensorDict memmap into ``incoming/`` and renames the
finished directory into ``ready/`` (a rename within one file system is atomic), so the trainer
never sees half a batch. The trainer loads a ready batch into memory and deletes it.

The trainer opens a fresh *session* at start (a directory named by a random id, announced in
``session.json``), so that batches and markers left in a persistent volume by an earlier run
are never mixed into this one. Layout::

    <spool>/session.json            {"id": ...}: the session collectors write into
    <spool>/<id>/incoming/<batch>/  being written
    <spool>/<id>/ready/<batch>/     complete; oldest first by name
    <spool>/<id>/reports/<name>.json  each collector's final statistics
    <spool>/<id>/STOP               the trainer is done training (holds its final version)
    <spool>/<id>/FINISHED           the trainer consumed everything and wrote its summary
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from tensordict import TensorDict, TensorDictBase

from demo.jsonfile import write_json_atomic

SESSION_FILE = "session.json"
SESSION_ID = re.compile(r"[0-9a-f]{12}")


class SpoolSession:
    """One run's batches, reports and markers under ``<spool>/<id>/``."""

    def __init__(self, root: Path, session_id: str) -> None:
        self.id = session_id
        self.dir = Path(root) / session_id
        self.incoming = self.dir / "incoming"
        self.ready_dir = self.dir / "ready"
        self.reports_dir = self.dir / "reports"

    def create(self) -> SpoolSession:
        for path in (self.incoming, self.ready_dir, self.reports_dir):
            path.mkdir(parents=True, exist_ok=True)
        return self

    # collector side
    def put(self, batch: TensorDictBase, name: str) -> Path:
        """Write `batch` as a memmap under incoming/, then rename it into ready/."""
        tmp = self.incoming / name
        batch.memmap(prefix=str(tmp))
        final = self.ready_dir / name
        os.rename(tmp, final)
        return final

    def pending(self) -> int:
        """Batches written and not yet consumed."""
        try:
            return sum(1 for _ in os.scandir(self.ready_dir))
        except FileNotFoundError:
            return 0

    def write_report(self, name: str, report: dict[str, Any]) -> None:
        write_json_atomic(self.reports_dir / f"{name}.json", report)

    # trainer side
    def ready(self) -> list[Path]:
        """Complete batches, oldest first (names start with a nanosecond timestamp); none if
        the session is gone (a newer trainer took the spool over)."""
        try:
            return sorted(self.ready_dir.iterdir())
        except FileNotFoundError:
            return []

    def take(self, path: Path) -> TensorDictBase:
        """Load a ready batch into memory and delete it from the spool."""
        batch = TensorDict.load_memmap(path).clone()  # clone: plain tensors, not views of files
        shutil.rmtree(path)
        return batch

    def reports(self) -> dict[str, dict[str, Any]]:
        found = {}
        for path in self.reports_dir.glob("*.json"):
            found[path.stem] = json.loads(path.read_text())
        return found

    def leftovers(self) -> list[str]:
        """Everything still in incoming/ or ready/ (empty after a clean end)."""
        return sorted(str(p.relative_to(self.dir)) for d in (self.incoming, self.ready_dir) for p in d.iterdir())

    def remove_incoming(self) -> None:
        """Half-written batches of collectors that died mid-write."""
        for path in self.incoming.iterdir():
            shutil.rmtree(path, ignore_errors=True)

    # markers
    def stop(self, final_version: int | None) -> None:
        write_json_atomic(self.dir / "STOP", {"final_version": final_version})

    def stopped(self) -> bool:
        return (self.dir / "STOP").exists()

    def final_version(self) -> int | None:
        """The trainer's final version, as its STOP holds it (None before STOP, or if it has none)."""
        try:
            return json.loads((self.dir / "STOP").read_text())["final_version"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return None

    def finish(self) -> None:
        write_json_atomic(self.dir / "FINISHED", {"time": time.time()})

    def finished(self) -> bool:
        return (self.dir / "FINISHED").exists()


class Spool:
    """The spool directory: the trainer opens sessions, collectors join the current one."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def open_session(self) -> SpoolSession:
        """Trainer: remove the sessions an earlier run left, start a new one, announce it.
        Nothing else in the directory is touched."""
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.root.iterdir():
            if SESSION_ID.fullmatch(path.name) and (path / "ready").is_dir():
                shutil.rmtree(path, ignore_errors=True)
        session = SpoolSession(self.root, uuid.uuid4().hex[:12]).create()
        write_json_atomic(self.root / SESSION_FILE, {"id": session.id})
        return session

    def current_session(self) -> SpoolSession | None:
        """Collector: the session the trainer announced, or None before it did."""
        try:
            session_id = json.loads((self.root / SESSION_FILE).read_text())["id"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return None
        return SpoolSession(self.root, session_id)
