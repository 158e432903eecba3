"""The scripted expert on real-mail-like questions: answers reworded from the email, an answer only in a quoted
reply, a question naming its sender (searched with from_address), one naming when the mail came (a date
window), and a search that finds nothing ("I don't know"); and its ceiling."""

import asyncio
import json

import pytest

from email_agent.data import build
from email_agent.data.email_db import EmailDB
from email_agent.agent.expert import Ceiling, expert_episodes, holds_answer, sent_window
from email_agent.data.questions import select_questions
from email_agent.agent.episode import Episode

ME = "tana.jones@corp.example"


def mail(n, sender, subject, body, day, to=ME):
    return {"message_id": f"<m{n}@corp.example>", "date": f"{day}T15:00:00Z", "subject": subject,
            "from_address": sender, "to_addresses": [to], "body": body}


EMAILS = [
    mail(1, "marie.heard@corp.example", "Credit Contact",
         "Please be advised that Jay Williams will be our credit contact for all master netting agreement credit "
         "terms.  Jay's phone number is (713) 345-3923.\n\nMarie", "2001-10-30"),
    mail(2, "rob.milnthorp@corp.example", "RE: Canadian legal entity",
         "Dave, I am very concerned with Canada not using UBS AG as the contracting party.\n\n"
         " -----Original Message-----\nFrom: Forster, David\nSubject: Canadian legal entity\n\n"
         "The name for the Canadian entity which will enter into both Master Agreements is: \"UBS Warburg Energy "
         "(Canada) Ltd.\", as confirmed by Lou Eber.", "2002-02-04"),
    mail(3, "stephanie.miller@corp.example", "RE: SoCalGas windowing",
         "I have not seen it so pls forward. FAX 713-646-2391\n\nStephanie", "2001-10-08"),
    mail(4, "john.hodge@corp.example", "fax for the windowing notice",
         "Use my fax 713-555-0100 for the SoCalGas notice.\n\nJohn", "2001-10-09"),
    mail(5, "events@corp.example", "Picnic",
         "The company picnic is at Hermann Park on Saturday; bring the kids.", "2001-09-03"),
    mail(6, "events@corp.example", "Picnic moved",
         "The company picnic moved to Memorial Park because of the rain.", "2001-10-12"),
]
QUESTIONS = [
    ("reworded", "Who is our credit contact for master netting agreement terms?", "Jay Williams, (713) 345-3923", 1,
     "2001-11-01"),
    ("quoted", "What is the name of the Canadian entity for the Master Agreements?", "UBS Warburg Energy (Canada) Ltd.",
     2, "2002-02-06"),
    ("sender", "What fax number did Stephanie Miller give me?", "713-646-2391", 3, "2001-10-15"),
    ("window", "Where is the picnic, per the email I got last week?", "Memorial Park", 6, "2001-10-15"),
    ("nothing", "What did the Zanzibar steering group decide?", "to postpone", 1, "2001-11-01"),
]


@pytest.fixture(scope="module")
def inbox(tmp_path_factory):
    path = tmp_path_factory.mktemp("real-like") / "mail.db"
    questions = [{"id": qid, "question": q, "answer": a, "message_ids": [f"<m{n}@corp.example>"],
                  "inbox_address": ME, "query_date": day, "how_realistic": 0.8, "split": "train"}
                 for qid, q, a, n, day in QUESTIONS]
    build.build_database(EMAILS, questions, path, source="test", progress=False)
    db = EmailDB(path)
    yield db
    db.close()


def episodes(db, max_turns=6):
    questions = select_questions(db, "train")
    trajs = asyncio.run(expert_episodes(db, questions, Episode(max_turns=max_turns, search_results=3)))
    return {q.id: t for q, t in zip(questions, trajs)}


def calls(traj):
    return [(c.function.name, json.loads(c.function.arguments)) for m in traj.messages_and_choices
            if not isinstance(m, dict) for c in m.message.tool_calls]


def test_the_expert_solves_reworded_quoted_and_sender_named_questions(inbox):
    trajs = episodes(inbox)
    for qid in ("reworded", "quoted", "sender", "window"):
        m = trajs[qid].metrics
        assert (m["answer_correct"], m["sources_correct"]) == (1, 1), (qid, calls(trajs[qid]))
        name, args = calls(trajs[qid])[-1]
        gold = next(n for q, *_, n, _ in QUESTIONS if q == qid)
        assert name == "return_final_answer" and args["sources"] == [f"<m{gold}@corp.example>"]
    first_search = calls(trajs["sender"])[0]
    assert first_search == ("search_inbox", {"keywords": ["fax"], "from_address": "stephanie.miller@corp.example"})
    window = calls(trajs["window"])[0][1]
    assert (window["sent_after"], window["sent_before"]) == ("2001-10-07", "2001-10-16")


def test_a_search_that_finds_nothing_ends_in_i_dont_know(inbox):
    traj = episodes(inbox)["nothing"]
    names = [name for name, _ in calls(traj)]
    assert set(names[:-1]) == {"search_inbox"} and len(names) >= 2  # it backs off to fewer words first
    assert calls(traj)[-1] == ("return_final_answer", {"answer": "I don't know", "sources": []})
    assert traj.metrics["returned_i_dont_know"] == 1 and traj.metrics["ran_out_of_turns"] == 0


def test_the_expert_abstains_on_its_last_turn_and_its_ceiling_says_so(inbox):
    trajs = episodes(inbox, max_turns=2)  # a search and an answer: no turn to read
    assert all(calls(t)[-1] == ("return_final_answer", {"answer": "I don't know", "sources": []})
               for t in trajs.values())
    ceiling = Ceiling.of(list(trajs.values()))
    assert (ceiling.questions, ceiling.solved, ceiling.abstained, ceiling.out_of_turns) == (5, 0, 5, 0)
    full = Ceiling.of(list(episodes(inbox).values()))
    assert (full.solved, full.other_source, full.abstained) == (4, 0, 1)
    assert full.describe().startswith("solved 4 of 5 (80%); answered from another email 0; said \"I don't know\" 1")


def test_holds_answer_by_its_words_not_verbatim():
    email = "Jay's phone number is (713) 345-3923; Jay Williams is our credit contact. Atlas has $150mm soft circled."
    assert holds_answer(email, "Jay Williams, at (713) 345-3923")
    assert holds_answer(email, "$150 mm")
    assert not holds_answer(email, "Jay Williams, at (713) 345-3924")  # every number must be there
    assert not holds_answer(email, "Boardroom 7")  # a short answer needs all its words
    assert not holds_answer("The picnic is at Hermann Park.", "Memorial Park")


def test_sent_window_reads_when_the_mail_came():
    assert sent_window("What did Sally send me last week?", "2001-10-15") == {"sent_after": "2001-10-07",
                                                                              "sent_before": "2001-10-16"}
    assert sent_window("What did the email in December say about the audit?", "2002-02-06") == {
        "sent_after": "2001-12-01", "sent_before": "2002-01-01"}
    assert sent_window("When is the meeting on December 3?", "2001-11-20") == {}  # the meeting's date, not the mail's
