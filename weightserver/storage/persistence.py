"""Versions under ``data_dir``, written so that a crash never shows a torn one:

    <model>/<version:012d>.safetensors   the published bytes, unchanged
    <model>/<version:012d>.json          manifest: written last, it marks a committed version
    <model>/high_water.json              highest version ever committed (written on delete)

A delete removes the data file (works on a full disk), then the manifest: it kept the number from reuse."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from weightserver.protocol import digests, errors
from weightserver.protocol.files import FILE_SUFFIX, version_file_name
from weightserver.protocol.names import MODEL_NAME, PUBLISH_ID, validate_model_name
from weightserver.protocol.safetensors_format import parse_header
from weightserver.storage.hashing import after_commit
from weightserver.storage.index import MAX_VERSION, ModelState, Version, ranges

log = logging.getLogger(__name__)

MANIFEST_SUFFIX = ".json"
HIGH_WATER = "high_water.json"


class Disk:
    """The files of a data directory; `describe` measures a loaded version's description."""

    def __init__(self, data_dir: Path, describe: Callable[[Version], int] | None = None) -> None:
        self.data_dir, self._describe = data_dir, describe
        data_dir.mkdir(parents=True, exist_ok=True)

    def paths(self, model: str, version: int) -> tuple[Path, Path]:
        data = self.data_dir / model / version_file_name(version)
        return data, data.with_suffix(MANIFEST_SUFFIX)

    def write_group(self, records: list[Version]) -> list[Version]:
        """Every data file, then every manifest (`load` drops a torn group); a failed write removes
        what it wrote. Missing sha256s are computed beside the writes (hashlib lets go of the GIL)."""
        written: list[Path] = []
        try:
            with self.writes(), ThreadPoolExecutor(thread_name_prefix="weightserver-sha256") as pool:
                hashing = {i: pool.submit(after_commit, r) for i, r in enumerate(records) if not r.sha256}
                for record in records:
                    (self.data_dir / record.model).mkdir(parents=True, exist_ok=True)
                    written.append(self.paths(record.model, record.version)[0])
                    atomic_write(written[-1], record.data)
                records = [replace(r, **hashing[i].result()) if i in hashing else r for i, r in enumerate(records)]
                for record in records:
                    written.append(self.paths(record.model, record.version)[1])
                    self.write_manifest(record)
        except BaseException:
            for path in reversed(written):
                remove_logged(path)
            raise
        return records

    @contextlib.contextmanager
    def writes(self) -> Iterator[None]:
        """No space left in the data directory: StorageFull, which says what to do."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise errors.StorageFull(
                f"the data directory {self.data_dir} is full ({exc.strerror}), so nothing was written "
                "or changed; free space by deleting versions (weightserver delete) or unpinning them, "
                "lower --keep, or give the data directory more space"
            ) from exc

    def delete_files(self, record: Version, high_water: int) -> None:
        data_path, manifest_path = self.paths(record.model, record.version)
        data_path.unlink(missing_ok=True)
        try:
            with self.writes():
                atomic_write(self.data_dir / record.model / HIGH_WATER, json.dumps({"high_water": high_water}).encode())
        except (errors.StorageFull, OSError) as exc:
            log.warning("keeping %s so that its number is never reused: %s", manifest_path, exc)
            return
        remove_logged(manifest_path)

    def write_manifest(self, record: Version) -> None:
        fields = ("model", "version", "byte_size", "sha256", "created", "metadata", "pinned", "group")
        manifest = {"format": 1, **{name: getattr(record, name) for name in fields}}
        manifest.update(metadata=dict(record.metadata), group=list(record.group))
        if record.publish_id:  # so that a retry finds it after a restart too
            manifest["publish_id"] = record.publish_id
        atomic_write(self.paths(record.model, record.version)[1], json.dumps(manifest, indent=1).encode())

    def remove_files(self, records: list[Version]) -> None:
        for record in records:
            data_path, manifest_path = self.paths(record.model, record.version)
            remove_logged(manifest_path)  # first: without it a leftover data file is debris
            remove_logged(data_path)

    def load(self) -> dict[str, ModelState]:
        """Every model's versions on disk, crash debris and torn groups removed."""
        models: dict[str, ModelState] = {}
        for directory in sorted(p for p in self.data_dir.iterdir() if p.is_dir()):
            try:
                model = validate_model_name(directory.name)
            except errors.InvalidModelName:
                log.warning("ignoring %s: not a valid model name", directory)
                continue
            state = models.setdefault(model, ModelState(high_water=_read_high_water(directory / HIGH_WATER)))
            for tmp in directory.glob("*.tmp"):
                log.warning("removing %s: an unfinished write from before a crash", tmp)
                tmp.unlink(missing_ok=True)
            manifests = {p.stem: p for p in directory.glob("*" + MANIFEST_SUFFIX) if p.name != HIGH_WATER}
            for data_path in sorted(directory.glob("*" + FILE_SUFFIX)):
                if data_path.stem not in manifests:
                    log.warning("removing %s: data without a manifest (publish interrupted by a crash)", data_path)
                    data_path.unlink(missing_ok=True)
            for stem, manifest_path in sorted(manifests.items()):
                record = self._load_one(model, manifest_path, manifest_path.with_suffix(FILE_SUFFIX))
                if record is not None:
                    state.versions[record.version] = record
                # A manifest, even a damaged one, keeps its number from being handed out again.
                if stem.isascii() and stem.isdigit() and int(stem) <= MAX_VERSION:
                    state.high_water = max(state.high_water, int(stem))
            # In number order, which the index keeps: past 12 digits the names sort otherwise ("1000000000000" first)
            state.versions = dict(sorted(state.versions.items()))
        self._drop_torn_groups(models)
        for model, state in models.items():
            if state.versions:
                size = sum(v.byte_size for v in state.versions.values())
                log.info("loaded model %r: versions %s (%d bytes)", model, ranges(list(state.versions)), size)
        return models

    def _drop_torn_groups(self, models: dict[str, ModelState]) -> None:
        """Drop a group's version whose partner never reached its number (no manifest of it or later, no
        high-water mark of a delete at or past it): the group never committed."""
        for model, state in models.items():
            for number, record in list(state.versions.items()):
                for partner in record.group:
                    torn = (model, number, partner)
                    if partner != model and number > (models[partner].high_water if partner in models else 0):
                        log.error("skipping %s v%d: its group with %s did not complete before a crash", *torn)
                        del state.versions[number]
                        self.remove_files([record])
                        break

    def _load_one(self, model: str, manifest_path: Path, data_path: Path) -> Version | None:
        try:
            manifest = _check_manifest(json.loads(manifest_path.read_text()), manifest_path)
            data = data_path.read_bytes()
            if len(data) != manifest["byte_size"]:
                raise errors.IntegrityError(f"{len(data)} bytes on disk, manifest says {manifest['byte_size']}")
            digest = digests.sha256_hex(data)
            if digest != manifest["sha256"]:
                raise errors.IntegrityError(f"sha256 on disk is {digest}, manifest says {manifest['sha256']}")
            header = parse_header(data)  # the format's limits: what was committed loads
            fields = {k: manifest[k] for k in ("version", "metadata", "pinned", "publish_id") if k in manifest}
            fields.update(created=float(manifest.get("created", 0.0)), group=tuple(manifest.get("group", ())))
            fields.update(xxh3=digests.xxh3_hex(data), tensor_xxh3=digests.tensor_digests(data, header))
            record = Version(**fields, model=model, data=data, sha256=digest, header=header)
            if self._describe is not None:
                record = replace(record, description_bytes=self._describe(record))
            return record
        except Exception as exc:  # any damage: skip this version, keep the others
            log.error("skipping %s: torn or corrupt version (%s)", data_path, exc)
            return None


def _check_manifest(manifest: object, path: Path) -> dict:
    """`manifest` if its fields have the types and ranges relied on, else ValueError; its version
    must be its file name's, so a copied one cannot serve another's bytes."""
    if not isinstance(manifest, dict):
        raise ValueError("the manifest is not a JSON object")
    version = manifest.get("version")
    if type(version) is not int or version < 1 or version_file_name(version) != path.stem + FILE_SUFFIX:
        raise ValueError(f"the manifest names version {version!r} but its file name says {path.stem}")
    if version > MAX_VERSION:
        raise ValueError(f"version {version} is over the largest version number, {MAX_VERSION}")
    if type(manifest.get("byte_size")) is not int or not isinstance(manifest.get("sha256"), str):
        raise ValueError("byte_size must be an integer and sha256 a string")
    created = manifest.get("created", 0.0)
    if type(created) not in (int, float) or not 0 <= created < 1e11:  # also rules out NaN and inf
        raise ValueError(f"created must be a Unix time, got {created!r}")
    metadata = manifest.get("metadata", {})
    if not isinstance(metadata, dict) or not all(type(k) is type(v) is str for k, v in metadata.items()):
        raise ValueError("metadata must map strings to strings")
    group = manifest.get("group", [])
    if not isinstance(group, list) or not all(isinstance(g, str) and MODEL_NAME.fullmatch(g) for g in group):
        raise ValueError("group must be a list of model names")
    if not isinstance(manifest.get("pinned", False), bool):
        raise ValueError("pinned must be true or false")
    publish_id = manifest.get("publish_id", "")
    if not isinstance(publish_id, str) or not (publish_id == "" or PUBLISH_ID.fullmatch(publish_id)):
        raise ValueError("publish_id must be empty or up to 128 printable ASCII characters")
    return manifest


def _read_high_water(path: Path) -> int:
    try:
        value = json.loads(path.read_text())["high_water"] if path.exists() else 0
        if type(value) is not int or not 0 <= value <= MAX_VERSION:
            raise ValueError(f"high_water must be an integer in 0-{MAX_VERSION}, got {value!r}")
        return value
    except (ValueError, KeyError, TypeError, OverflowError, OSError) as exc:
        log.error("ignoring %s: %s", path, exc)
        return 0


def atomic_write(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Write `path` so that a crash leaves the old file or the new one, and a failed write no temp file."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        remove_logged(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_logged(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
