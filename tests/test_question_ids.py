"""Question ids as a question file gives them: integers and strings ("q-17") everywhere an id is used."""

import json

import pytest

from email_agent.data import build, email_db, demo
from email_agent.data import questions as qmod
from email_agent.agent.demonstrations import teacher_trajectories
from scripted_server import expert_script, serve_in_thread

import test_email_search_agent as evaluate


@pytest.fixture(scope="module")
def string_id_db(tmp_path_factory):
    """The demo inbox with mixed ids: every third question keeps its integer id, the others become "q-N"."""
    emails, qs = demo.generate(seed=0)
    qs = [dict(q, id=q["id"] if i % 3 == 0 else f"q-{q['id']}") for i, q in enumerate(qs)]
    path = tmp_path_factory.mktemp("ids") / "ids.db"
    summary = build.build_database(emails, qs, path, source="demo with string ids", progress=False)
    assert summary.questions_skipped == 0 and sum(summary.questions.values()) == len(qs)
    return path


def test_normalize_question_keeps_ids_as_given():
    base = {"question": "q?", "answer": "a", "message_ids": ["<m>"], "inbox_address": "A@x", "query_date": "2001-01-02"}
    assert qmod.normalize_question({**base, "id": "q-17"}).id == "q-17"
    assert qmod.normalize_question({**base, "id": 17}).id == 17
    assert qmod.normalize_question({**base, "id": 17.0}).id == 17  # a float column of whole numbers
    for bad in ("", "  ", None, True, 1.5, [1]):
        with pytest.raises(ValueError):
            qmod.normalize_question({**base, "id": bad})
    assert sorted([10, "q-2", 2, "a"], key=qmod.id_sort_key) == [2, 10, "a", "q-2"]


def test_string_ids_in_the_database_and_selection(string_id_db):
    db = email_db.EmailDB(string_id_db)
    try:
        ids = [q.id for q in qmod.select_questions(db, "train")]
        assert any(isinstance(i, str) and i.startswith("q-") for i in ids) and any(isinstance(i, int) for i in ids)
        assert ids == sorted(ids, key=qmod.id_sort_key)  # the database's order: integers, then strings
        stored = dict(db.conn.execute("SELECT id, typeof(id) FROM questions"))
        assert {stored[i] for i in ids} == {"integer", "text"}
    finally:
        db.close()


def test_malformed_questions_are_shown_with_their_reason(tmp_path):
    emails, qs = demo.generate(seed=0)
    bad = [{"id": "q-x", "question": "no answer?"}, dict(qs[0], id=""), dict(qs[1], query_date="someday")]
    bad_emails = [dict(emails[0], message_id="<bad-date@x>", date="the 5th of never"), dict(emails[1], message_id="")]
    summary = build.build_database(emails[:50] + bad_emails, bad + qs[:2], tmp_path / "b.db", source="t",
                                   progress=False)
    assert summary.questions_skipped == 3
    text = "\n".join(summary.lines())
    assert "skipped email     <bad-date@x>: unparseable date 'the 5th of never'" in text
    assert "skipped email     " + emails[1]["file_name"] + ": missing message_id" in text
    assert "record 1 (id 'q-x'): missing answer, message_ids, inbox_address, query_date" in text
    assert "id must be an integer or a non-empty string" in text
    assert "someday" in text


def test_evaluate_report_rejudge_and_teacher_filter_with_string_ids(string_id_db, tmp_path):
    db = email_db.EmailDB(string_id_db)
    test_qs = qmod.select_questions(db, "test")
    picked = [q for q in test_qs if isinstance(q.id, int)][:1] + [q for q in test_qs if isinstance(q.id, str)][:2]
    scripts = {"expert": {q.question: expert_script(q) for q in test_qs},
               "judge": {"*": [{"text": '{"reasoning": "ok", "accept": true}'}]}}
    with serve_in_thread(scripts) as server:
        assert evaluate.main(["--db", str(string_id_db), "--model", "hosted_vllm/expert", "--base-url",
                              server.base_url, "--limit", "40", "--output", str(tmp_path / "ev"),
                              "--art-dir", str(tmp_path / "art")]) == 0
        assert evaluate.main(["--rejudge", str(tmp_path / "ev"), "--judge-model", "openai/judge", "--judge-base-url",
                              server.base_url, "--output", str(tmp_path / "rj"), "--art-dir",
                              str(tmp_path / "art")]) == 0
    for folder in ("ev", "rj"):
        records = [json.loads(line) for line in (tmp_path / folder / "results.jsonl").read_text().splitlines()]
        ids = [r["question_id"] for r in records]
        assert {type(i) for i in ids} == {int, str} and set(ids) <= {q.id for q in test_qs}
        html = (tmp_path / folder / "report.html").read_text()
        shown = [html.index(f"<summary>#{i} ") for i in sorted(ids, key=qmod.id_sort_key)]
        assert shown == sorted(shown)  # the trace viewer lists questions by id: integers, then strings
    assert all(r["verdict"]["judge"] == "openai/judge" for r in records)
    # A teacher's episodes on test questions never reach the warm start, whatever the id's type.
    train_q = qmod.select_questions(db, "train")
    train_str = next(q for q in train_q if isinstance(q.id, str))
    rows = [dict(records[0], question_id=q.id) for q in (picked[1], picked[0], train_str)]
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = teacher_trajectories(tmp_path / "teacher", db)
    assert [t.metadata["question_id"] for t in kept] == [train_str.id]
    db.close()
