"""export / import round trip, malformed lines, reindex, verify (including a corrupted row)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from sqlalchemy import create_engine, text

from agentspec.stores import SQLStore
from agentspec.types import Record
from tests.cli.conftest import EMBEDDER, Invoke, make_invoke, make_records


def _all(url: str) -> list[Record]:
    with SQLStore(url) as store:
        return list(store.iter())


def _same(a: Record, b: Record) -> bool:
    """Every field equal, the embedding bit for bit (Record compares it with compare=False)."""
    emb_a = None if a.embedding is None else a.embedding.tobytes()
    emb_b = None if b.embedding is None else b.embedding.tobytes()
    return a == b and emb_a == emb_b


def test_export_import_round_trip(cli: Invoke, url: str, empty_url: str, tmp_path: Path) -> None:
    # empty_url and url are the same database here; make a second, fresh one
    fresh = f"sqlite:///{tmp_path / 'copy.db'}"
    SQLStore(fresh).close()
    with SQLStore(url) as store:  # a row without an embedding travels too
        store.add(Record(scope="c", model="m1", request_text="r", key_text="k",
                         completion_text="c", completion_ids=(1, 2), hits=5, accepted_tokens=2))
    first = tmp_path / "first.jsonl"
    assert cli("cache", "export", str(first)).exit_code == 0
    assert len(first.read_text().splitlines()) == 31
    res = make_invoke(fresh)("cache", "import", str(first), "--yes")
    assert res.exit_code == 0 and "imported 31" in res.stdout, res.output
    before, after = _all(url), _all(fresh)
    assert len(before) == len(after) == 31
    assert all(_same(a, b) for a, b in zip(before, after, strict=True))
    second = tmp_path / "second.jsonl"
    assert make_invoke(fresh)("cache", "export", str(second)).exit_code == 0
    assert first.read_text() == second.read_text()
    again = make_invoke(fresh)("cache", "import", str(first), "--yes")  # all duplicates
    assert again.exit_code == 0 and "imported 0 record(s), 31 already present" in again.stdout


def test_export_to_stdout(cli: Invoke) -> None:
    res = cli("cache", "export", "-")
    assert res.exit_code == 0 and len(res.stdout.splitlines()) == 30


def test_import_reports_bad_lines_and_keeps_good_ones(empty_url: str, tmp_path: Path) -> None:
    from agentspec.cli.cache_io import to_line

    good = [json.loads(to_line(r)) for r in make_records(3)]
    listed = dict(good[2], embedding=good[2]["embedding_b64"] and
                  EMBEDDER.embed([good[2]["key_text"]])[0].tolist())
    del listed["embedding_b64"]
    lines = [json.dumps(good[0]), "{not json", json.dumps(dict(good[1], completion_ids="abc")),
             "", json.dumps(dict(good[1], hits=-1)), json.dumps(dict(good[1], scope="")),
             json.dumps({"scope": "a"}), json.dumps(dict(good[1], embedding_b64="!!")),
             json.dumps(dict(good[1], dim=3)), json.dumps(listed), "[1, 2]"]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    res = make_invoke(empty_url)("cache", "import", str(path), "--yes")
    assert res.exit_code == 2
    assert "imported 2 record(s), 0 already present, 8 bad line(s)" in res.stdout
    for number in (2, 3, 5, 6, 7, 8, 9, 11):
        assert f"{path}:{number}: " in res.stderr
    assert "completion_ids" in res.stderr and "hits must be an integer >= 0, got -1" in res.stderr
    rows = _all(empty_url)
    assert [r.key_text for r in rows] == [good[0]["key_text"], good[2]["key_text"]]
    assert np.allclose(rows[1].embedding, EMBEDDER.embed([good[2]["key_text"]])[0])


def test_import_missing_file(empty_url: str, tmp_path: Path) -> None:
    res = make_invoke(empty_url)("cache", "import", str(tmp_path / "none.jsonl"), "--yes")
    assert res.exit_code == 2 and "none.jsonl" in res.stderr


def test_reindex_builds_index_files_and_embeds_missing_rows(cli: Invoke, url: str,
                                                            home: Path) -> None:
    with SQLStore(url) as store:
        store.add(Record(scope="a", model="m1", request_text="r", key_text="plain key",
                         completion_text="c", completion_ids=(1, 2)))
    assert cli("cache", "reindex").exit_code == 2  # not a terminal, no --yes
    res = cli("cache", "reindex", "--embedder", "hash", "--yes")
    assert res.exit_code == 0, res.output
    assert "embedded 1 row(s); rebuilt 2 index file(s) with 31 vector(s)" in res.stdout
    assert len(list((home / "index").glob("*.faiss"))) == 2
    index = json.loads(cli("cache", "stats", "--json").stdout)["index"]
    assert index["status"] == "ok"
    assert sorted((f["scope"], f["index_vectors"]) for f in index["files"]) == [("a", 16), ("b", 15)]
    with SQLStore(url) as store:
        row = store.get(31)
    assert row is not None and row.embedder == EMBEDDER.name
    assert np.allclose(row.embedding, EMBEDDER.embed(["plain key"])[0])
    assert cli("cache", "verify").exit_code == 0
    # a deleted row leaves the index stale: stats and verify say so
    assert cli("cache", "rm", "2", "--yes").exit_code == 0
    assert "out of sync" in json.loads(cli("cache", "stats", "--json").stdout)["index"]["status"]
    stale = cli("cache", "verify")
    assert stale.exit_code == 1 and "1 deleted row(s) still indexed" in stale.stdout
    assert cli("cache", "reindex", "--yes").exit_code == 0
    assert cli("cache", "verify").exit_code == 0


def test_verify_ok_and_vocab_size(cli: Invoke) -> None:
    res = cli("cache", "verify", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["ok"] and out["rows"] == 30 and out["vocab_sizes"] == {"m1": 2**31, "m2": 2**31}
    small = cli("cache", "verify", "--vocab-size", "120")
    assert small.exit_code == 1 and "row 30: token id 129 outside [0, 120)" in small.stdout


def test_verify_fails_on_corrupted_rows(cli: Invoke, url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE agentspec_records SET completion_ids = :b WHERE id = 4"),
                             {"b": b"\x01\x02\x03"})
        bad = np.array([5, -7], "<i4").tobytes()
        conn.execute(text("UPDATE agentspec_records SET completion_ids = :b WHERE id = 9"),
                             {"b": bad})
        emb = np.ones(10, "<f4").tobytes()
        conn.execute(text("UPDATE agentspec_records SET embedding = :b WHERE id = 12"),
                             {"b": emb})
    engine.dispose()
    res = cli("cache", "verify", "--json")
    assert res.exit_code == 1
    problems = json.loads(res.stdout)["problems"]
    assert len(problems) == 3, problems
    assert problems[0].startswith("row 4: does not decode")
    assert problems[1].startswith("row 9: token id -7 outside")
    assert problems[2] == "row 12: embedding has dim 10, hash-trigram-64 gives 64"
