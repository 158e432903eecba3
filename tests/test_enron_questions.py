"""The Enron question set (data/enron-questions): its checker's rules on small synthetic inputs, and the committed
set against the real sample (skipped when ../shared/data/enron is absent)."""

import importlib.util
import json

import pytest

from conftest import ENRON_EMAILS, ROOT, needs_enron

SET_DIR = ROOT / "data" / "enron-questions"
_spec = importlib.util.spec_from_file_location("enron_assemble", SET_DIR / "assemble.py")
assemble = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(assemble)

INBOX = "sara.shackleton@enron.com"


def email(mid, day, body, sender="tanya.rohauer@enron.com", to=(INBOX,), subject="LCs"):
    return {"message_id": mid, "date": f"{day}T15:00:00Z", "subject": subject, "from_address": sender,
            "to_addresses": list(to), "cc_addresses": [], "bcc_addresses": [], "body": body}


@pytest.fixture()
def sample(tmp_path):
    rows = [email("<1>", "2001-12-20", "Enserco will extend the $1,200,000.00 LC to January 31st."),
            email("<2>", "2001-12-21", "Bob Georgio heads Customer Accounts at CSFB."),
            email("<3>", "2001-12-21", "Call Don Perkins.", sender="a@x.com", to=("b@x.com",)),
            email("<4>", "2001-12-22", "The Citibank value is USD 2,311,531.00 for the FX deals.",
                  sender="SARA.Shackleton@enron.com", to=())]
    path = tmp_path / "emails.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return assemble.load_emails(path)


def draft(question, answer, ids, query_date="2002-01-05", inbox=INBOX, realistic=0.7):
    return {"question": question, "answer": answer, "message_ids": ids, "inbox_address": inbox,
            "query_date": query_date, "how_realistic": realistic}


def test_a_question_citing_a_missing_email_is_dropped(sample):
    assert assemble.problem(draft("What did Enserco agree?", "January 31st", ["<9>"]), sample) == \
        "cites an email not in the sample"


def test_a_question_citing_an_email_outside_its_inbox_is_dropped(sample):
    assert assemble.problem(draft("Who should I call?", "Don Perkins", ["<3>"]), sample) == \
        "cites an email outside the inbox"


def test_membership_uses_build_dbs_normalisation(sample):
    # A sender written in capitals is in the lower-cased inbox, as build-db's mailbox table has it.
    assert assemble.problem(draft("What value did Citibank give?", "USD 2,311,531", ["<4>"]), sample) is None


def test_a_question_dated_on_or_before_its_email_is_dropped(sample):
    late = "cites an email dated on or after query_date"
    assert assemble.problem(draft("Who heads CSFB accounts?", "Bob Georgio", ["<2>"], "2001-12-21"), sample) == late
    assert assemble.problem(draft("Who heads CSFB accounts?", "Bob Georgio", ["<2>"], "2001-12-10"), sample) == late
    assert assemble.problem(draft("Who heads CSFB accounts?", "Bob Georgio", ["<2>"], "2001-12-22"), sample) is None


def test_an_answer_not_in_the_cited_email_is_dropped(sample):
    assert assemble.problem(draft("Who heads CSFB accounts?", "Marcel McNeal", ["<2>"]), sample) == \
        "answer not in the cited emails"
    # The other email holds the words, but it is not cited.
    assert assemble.problem(draft("Who heads CSFB accounts?", "Enserco", ["<2>"]), sample) == \
        "answer not in the cited emails"


def test_an_answer_that_is_just_the_subject_line_is_dropped(sample):
    assert assemble.problem(draft("What did Tanya write about?", "LCs", ["<1>"]), sample) == \
        "answer is just a cited email's subject"
    assert assemble.problem(draft("What did Enserco agree about the LCs?", "extend the LC to January 31st", ["<1>"]),
                            sample) is None


def test_answers_match_however_the_figure_is_written(sample):
    for answer in ("$1,200,000", "1200000", "$1,200,000.00 LC", "the LC: January 31st"):
        assert assemble.problem(draft("How large is Enserco's LC?", answer, ["<1>"]), sample) is None, answer
    assert assemble.words("$1,200.50 and 5.00MM") == ["1200.5", "5", "mm"]


def test_malformed_drafts_are_dropped(sample):
    good = draft("Who heads CSFB accounts?", "Bob Georgio", ["<2>"])
    assert assemble.problem({**good, "answer": ""}, sample).startswith("malformed")
    assert assemble.problem({**good, "how_realistic": 1.5}, sample).startswith("malformed")
    assert assemble.problem({**good, "query_date": "Jan 5"}, sample).startswith("malformed")
    assert assemble.problem({**good, "message_ids": ["<2>", "<2>"]}, sample).startswith("malformed")


def test_near_duplicates_are_dropped(sample):
    first = draft("Who heads Customer Accounts at CSFB?", "Bob Georgio", ["<2>"])
    reworded = draft("Who heads the Customer Accounts at CSFB now?", "Bob Georgio", ["<2>"], "2002-01-09")
    same_fact = draft("Whom should I fax the ENA agreement to?", "Bob Georgio", ["<2>"], "2002-01-08")
    other_inbox = {**reworded, "inbox_address": "tanya.rohauer@enron.com"}
    kept, dropped = assemble.assemble([reworded, same_fact, first, other_inbox], sample)
    assert [q["question"] for q in kept] == [first["question"], reworded["question"]]
    assert [q["inbox_address"] for q in kept] == [INBOX, "tanya.rohauer@enron.com"]
    assert sorted(reason for _, reason in dropped) == [
        "near-duplicate question (content-word Jaccard >= 0.7)", "near-duplicate: same answer from the same email"]


def test_ids_are_stable_and_the_split_never_shares_an_email(sample):
    drafts = [draft(f"Question {n} about the LC extension?", f"{word}", [mid], f"2002-01-{n + 1:02d}")
              for n, (word, mid) in enumerate([("Enserco", "<1>"), ("January", "<1>"), ("31st", "<1>"),
                                               ("Georgio", "<2>"), ("CSFB", "<2>"), ("Citibank", "<4>")])]
    kept, dropped = assemble.assemble(drafts, sample)
    again, _ = assemble.assemble(list(reversed(drafts)), sample)
    assert not dropped and kept == again
    assert [q["id"] for q in kept] == [f"enron-{n:04d}" for n in range(1, 7)]
    split_of = {}
    for q in kept:
        for mid in q["message_ids"]:
            assert split_of.setdefault(mid, q["split"]) == q["split"]
    assert set(split_of.values()) == {"train", "test"}


def committed():
    return [json.loads(line) for line in (SET_DIR / "questions.jsonl").read_text().splitlines()]


def test_the_committed_set_has_the_schema_and_disjoint_splits():
    questions = committed()
    assert all(set(q) == {"id", "question", "answer", "message_ids", "how_realistic", "inbox_address",
                          "query_date", "split"} for q in questions)
    assert len({q["id"] for q in questions}) == len(questions)
    assert len(questions) >= 400
    assert len({q["inbox_address"] for q in questions}) >= 6
    assert sum(q["split"] == "test" for q in questions) >= 120
    train = {m for q in questions if q["split"] == "train" for m in q["message_ids"]}
    test = {m for q in questions if q["split"] == "test" for m in q["message_ids"]}
    assert train and test and not train & test


@needs_enron
def test_every_committed_question_passes_every_rule_against_the_sample():
    emails = assemble.load_emails(ENRON_EMAILS)
    questions = committed()
    assert [(q["id"], assemble.problem(q, emails)) for q in questions if assemble.problem(q, emails)] == []
    drafts = assemble.read_drafts(sorted(SET_DIR.glob("draft-*.jsonl")))
    kept, _ = assemble.assemble(drafts, emails)
    assert kept == questions  # the committed set is what the drafts and the rules give
