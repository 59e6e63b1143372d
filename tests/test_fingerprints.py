"""Input fingerprints are remembered by file identity: an unchanged file is not read again,
and any write (even one that keeps the size and the modification time) is seen."""

from __future__ import annotations

import os

from draftsmith import fingerprints


def test_a_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprints, "_remembered", None)
    data = tmp_path / "data.jsonl"
    data.write_text('{"id": 1}\n')
    reads = []

    def digest(path):
        reads.append(path)
        return fingerprints.sha256_file(path)

    first = fingerprints.remembered_digest(data, digest)
    assert fingerprints.remembered_digest(data, digest) == first and len(reads) == 1
    monkeypatch.setattr(fingerprints, "_remembered", None)  # a new process reads the file
    assert fingerprints.remembered_digest(data, digest) == first and len(reads) == 1

    # Same size, modification time put back: the change time still moves.
    stat = data.stat()
    data.write_text('{"id": 2}\n')
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = fingerprints.remembered_digest(data, digest)
    assert second != first and len(reads) == 2
    # Replaced by a copy with the old content: another inode, hashed again.
    data.unlink()
    (tmp_path / "data.jsonl").write_text('{"id": 1}\n')
    assert fingerprints.remembered_digest(data, digest) == first and len(reads) == 3


def test_the_watcher_sees_new_content_at_the_same_path_only(tmp_path, monkeypatch):
    """The data watcher's comparison (flows/watch_data.py): a first look and a source that
    reads another file since are recorded, new content at the same path is a change."""
    from draftsmith.config import parse_config

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprints, "_remembered", None)
    a, b, other = (tmp_path / f"{n}.jsonl" for n in ("a", "b", "other"))
    for path in (a, b, other):
        path.write_text(f'{{"id": "{path.stem}"}}\n')

    def look(**paths):
        return fingerprints.watched_files(parse_config({
            "data": {"sources": [{"name": n, "path": str(p)} for n, p in paths.items()]}}))

    first = look(a=a, b=b)
    assert fingerprints.changed_files({}, first) == []  # a first look records
    assert fingerprints.changed_files(first, look(a=a, b=b)) == []
    a.write_text('{"id": "a"}\n{"id": "a2"}\n')
    now = look(a=a, b=other, c=other)  # b reads another file since; c is new
    assert fingerprints.changed_files(first, now) == ["a"]
    a.unlink()  # a file that is gone is left out (the run that reads it names it)
    assert set(look(a=a, b=b)) == {"b"}
