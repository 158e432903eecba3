"""The offline grader (email_agent.agent.matcher): real-mail answers that leave the gold answer's context out are
right, answers that miss or contradict what the question asks for are wrong, and training's reward pays for the
right ones. How well it agrees with labelled answers overall: tests/test_grader_labels.py."""

import asyncio
import json

import pytest

from email_agent.agent import grading, matcher
from email_agent.agent.episode import Episode
from email_agent.agent.rewards import Rubric
from email_agent.data.questions import Question

# (question, gold answer, the agent's answer) of the make enron evaluation that the grader of that time counted as
# hallucinations and a reading by ART·E's judge rule accepts (the real-mail set's test questions).
RIGHT_BUT_SHORTER = [
    ("How much load in Bergen County is in Rockland Electric's transfer to PJM?", "approximately 400 MW", "400 MW"),
    ("What is the new annual subscription price for Allowance Resource?", "$4,800 (or 23 SO2 allowances)", "4,800"),
    ("From which storage caverns are we trying to sell the pad gas?", "Storage Caverns #13/#14",
     "Caverns #13 and #14"),
    ("Who is the House of Judith contact Jennifer Medcalf told me about?", "Linda Wicker, (281) 374-9557",
     "Linda Wicker"),
    ("In which room is the training class Maggie registered me for?", "room EB 552", "EB 552"),
    ("When is the facility compliance certification report for Station 5 due?", "Jan. 23, 2002", "JAN. 23"),
]


@pytest.mark.parametrize("question, gold, answer", RIGHT_BUT_SHORTER)
def test_an_answer_without_the_gold_answers_context_is_right(question, gold, answer):
    """Catches the grader of c74d04b, which wanted every word of the gold answer and paid these -1.25."""
    verdict = matcher.offline_verdict(answer, gold, question)
    assert verdict.correct, verdict.reasoning
    assert not matcher.strict_verdict(answer, gold, question).correct  # what the old grader said


@pytest.mark.parametrize("question, gold, answer", RIGHT_BUT_SHORTER)
def test_trainings_offline_reward_pays_those_answers_as_right(question, gold, answer):
    """The reward GRPO is paid: the same matcher decides it, so each of those answers earns a right answer's
    reward (>= 1), not a hallucination's (< 0)."""
    q = Question("enron-x", question, gold, ["<m1@x>"], 1.0, "me@x", "2002-01-30", "test")
    rubric = Rubric()
    graded = asyncio.run(grading.grade_answer(rubric, q, answer, ["<m1@x>"], [], Episode(reward="offline",
                                                                                         hallucination_penalty=1.25)))
    assert (rubric.answer_correct, rubric.hallucinated) == (1, 0) and graded.reward >= 1


@pytest.mark.parametrize("question, gold, answer", [
    ("Which room?", "Boardroom 7", "Boardroom 3 or 7"),  # a hedge naming another number
    ("Which West gas desk traders asked to get updates on the California gas side?", "Janie Tholt and Mike Grisby",
     "Janie Tholt"),  # half of what was asked
    ("Which three companies are Jared Kaiser's requested confidentiality agreements with?",
     "Peoples Gas System, NUI Corporation and Jacksonville Electric Authority", "Peoples Gas System and NUI"),
    ("What price did Jim Homco say was paid for the 4250 purchased at the gate on 5/3 for OGY?", "$4.90", "$4.80"),
    ("When did Diann submit the account list to PG&E?", "Nov 1", "Nov 2"),
    ("When is Donna's meeting to plan for the MRM audit?", "10am Monday", "Tuesday at 10am"),
    ("Is the call moved to the morning or the afternoon?", "Friday morning", "Friday afternoon"),  # a choice
    ("When and where is the Vepco meeting?", "Monday, November 5 at 10:00am in conference room EB3125B",
     "Monday, November 5 at 10:00am"),  # asked when and where: only when
    ("What is the balance on PAL K#36621 (Enron Park)?", "1,783 Dth long", "1,783 Dth short"),
    ("When is the facility compliance certification report for Station 5 due?", "Jan. 23, 2002", "Jan. 23, 2003"),
    ("What date is the Kestrel planning session scheduled for?", "Monday, May 27", "Tuesday, April 30"),  # not split
    ("What is my username for OATI webOasis?", "lfcampbell", "tlfcampbell"),  # only names may be a typo apart
    ("What number should I call to reach Dana Eales?", "Dana Eales at (330) 315-7429", "Dana Eales"),  # asked
    ("When will the Cooper database be down for scheduled maintenance?",
     "Saturday, September 15th, 8:00 AM to 5:00 PM", "Saturday, September 15th"),  # the hours are part of when
    ("Whose Louis Dreyfus processing agreement am I asked to review and approve?", "Charlie Otto",
     "Dan Hvyl and Charlie Otto"),  # a second candidate beside the gold's one
    ("Who were appointed directors of LRCI, Inc. on November 26, 2001?",
     "Mark E. Haedicke, Brian L. Redmond and Jean M. Mrha", "Mark E. Haedicke and Brian L. Redmond"),  # 2 of 3
    ("Where and when is the mediation with SoCalGas starting?", "Chicago, on December 4, 2001",
     "December 4th"),  # where is asked too: a name beside the date is no label here
    ("What's the dial-in and passcode for the SoCalGas billing issue call?",
     "1-877-795-3687, passcode 824390 (Omaha participants in Conf. Room 724)", "1-877-795-3687"),  # no passcode
])
def test_an_answer_that_misses_or_contradicts_what_was_asked_is_wrong(question, gold, answer):
    assert not matcher.offline_verdict(answer, gold, question).correct


@pytest.mark.parametrize("question, gold, answer", [
    ("Which West gas desk traders asked to get updates on the California gas side?", "Janie Tholt and Mike Grisby",
     "Mike Grigsby and Janie Tholt"),  # reordered, and the gold answer's typo
    ("Which counterparties have the big imbalances on the HPL shipper contracts?",
     "Duke Energy, Gulf Energy, and Tejas", "Duke, Gulf and Tejas"),
    ("Which three companies are Jared Kaiser's requested confidentiality agreements with?",
     "Peoples Gas System, NUI Corporation and Jacksonville Electric Authority", "Peoples Gas System, NUI and JEA"),
    ("How much incremental value did the El Paso transport assignment to PNM generate?", "$3.0 MM", "$3 million"),
    ("When is Donna's meeting to plan for the MRM audit?", "10am Monday", "Monday at 10:00 AM"),
    ("When did Diann submit the account list to PG&E?", "Nov 1", "November 1st, 2001"),
    ("Where was Andrew Katz interviewing when he asked to use me as a reference?",
     "Constellation, for a regulatory attorney position with David Perlman", "At Constellation"),
    ("What is Cris Sherman's cell phone number?", "713.826.4488", "(713) 826-4488"),
    ("Under which tariff do large industrials like Hanson connect to PG&E's transmission system?", "E-20T", "E20T"),
    ("How many FTEs were approved for Gannet?", "21 FTEs", "21"),  # the unit restates the question
    ("When will the Cooper database be down for scheduled maintenance?",
     "Saturday, September 15th, 8:00 AM to 5:00 PM", "Sat Sept 15 from 8am to 5pm"),
    ("From whom is the TCO book buying gas?", "Power Gas Marketing", "Power Gas Marketing at Trco"),  # a place
    ("To which company is the final Keystone Term Sheet being proposed?", "Northern Natural Gas", "NNG"),
    ("Who did John Dean suggest contacting at FirstEnergy?", "Dana Eales at (330) 315-7429", "Dana Eales"),
    ("How much did finance approve for Falcon?", "$600,000", "$600,000 and 4 FTEs"),  # extra detail, not a hedge
    ("How often does the TNRCC State Summary File data get updated?", "every month, around the 10th",
     "every month"),  # "month," is no weekday: the trailing clause is context
    ("When and where is the Vepco meeting?", "Monday, November 5 at 10:00am in conference room EB3125B",
     "November 5 at 10 am in EB3125B"),
    ("Where and when is the mediation with SoCalGas starting?", "Chicago, on December 4, 2001",
     "Chicago on December 4"),
    ("What's the dial-in and passcode for the SoCalGas billing issue call?",
     "1-877-795-3687, passcode 824390 (Omaha participants in Conf. Room 724)", "1-877-795-3687, code 824390"),
    ("Who will be the mediator in the TW v. SoCalGas mediation?", "Rick Miles of FERC's ADR group",
     "Rick Miles"),  # asked who: where the person is from is context
])
def test_an_answer_that_rewords_the_gold_answer_is_right(question, gold, answer):
    verdict = matcher.offline_verdict(answer, gold, question)
    assert verdict.correct, verdict.reasoning


@pytest.mark.parametrize("answer, gold, reasoning", [
    ("I don't know", "I don't know", "answered I don't know"),  # never right, even against such a gold answer
    ("Tuesday", "?!", "empty gold answer"),  # nothing left of the gold answer to match
    ("Room 3C, as the notes from the meeting say " * 6, "Room 3C", "gold answer buried in an over-long answer"),
])
def test_offline_verdict_rejects_i_dont_know_an_empty_gold_and_a_pasted_answer(answer, gold, reasoning):
    verdict = matcher.offline_verdict(answer, gold, "When?")
    assert (verdict.correct, verdict.judge, verdict.reasoning) == (False, "offline", reasoning)


def test_the_verdict_says_what_it_read_as_the_core_and_what_was_missing():
    """The reasoning is what a user reads in the report to check a grade."""
    right = matcher.offline_verdict("Linda Wicker", "Linda Wicker, (281) 374-9557", "Who is the contact?")
    assert right.reasoning == "holds the gold answer's core ('Linda Wicker')"
    wrong = matcher.offline_verdict("$4.80", "$4.90", "What price was paid?")
    assert wrong.reasoning == "missing 4.9"


@pytest.mark.parametrize("text, normal", [
    ("Caf\u00e9 \u2014 \u20ac4,000", "cafe 4000"),  # accent stripped, symbols with no ASCII form dropped, 4,000 joined
    ("$2.4 million", "24 million"),
    ("An apple, a pear and the plum", "apple pear and plum"),
])
def test_answers_are_compared_without_case_accents_symbols_digit_separators_or_articles(text, normal):
    assert matcher.normalize_answer(text) == normal


@pytest.mark.parametrize("answer, idk", [("I don't know", True), ("i dont know.", True), ("I do not know!", True),
                                         ("I don't know yet", False), ("Not known", False)])
def test_each_way_of_saying_i_dont_know_is_recognised(answer, idk):
    """Catches a spelling of "I don't know" that would be graded as an attempted (wrong, hallucinated) answer."""
    assert matcher.is_i_dont_know(answer) is idk


def test_the_grader_that_decided_is_named_in_an_evaluations_records_and_summary():
    """The report says which grader decided: the matcher's name for offline verdicts (and for a judge's
    failures), the judge's model otherwise; records saved before the name was recorded were the old matcher's."""
    from email_agent.evaluation.scores import graders

    records = [{"verdict": {"judge": "offline", "grader": matcher.GRADER}},
               {"verdict": {"judge": "openai/gpt-4.1-mini"}},
               {"verdict": {"judge": "offline", "error": "judge failed"}},  # an old record: no grader key
               {"verdict": {"judge": "rule"}}, {"verdict": None}]
    assert graders(records) == sorted([matcher.GRADER, "openai/gpt-4.1-mini", matcher.STRICT_GRADER])


def test_a_run_resumed_under_another_grader_says_so_and_records_the_step(tmp_path, capsys):
    """A run whose GRPO steps the old matcher rewarded, resumed today: one sentence, and run_config.json keeps
    the step from which the new grader pays (rewards of two graders are never mixed silently). A run with no
    GRPO step yet (a warm start) changes graders without a word."""
    from email_agent import runs

    from email_agent.config import TrainConfig
    from email_agent.runs import saved_config

    now = saved_config(TrainConfig(db=str(tmp_path / "x.db")), "cpu")
    old = {k: v for k, v in now.items() if k != "offline_grader"}  # saved before the grader was recorded
    warm, grpo = tmp_path / "warm", tmp_path / "grpo"
    for run in (warm, grpo):
        run.mkdir()
        (run / "run_config.json").write_text(json.dumps(old))
    (grpo / "history.jsonl").write_text("".join(json.dumps({"step": s, "train/reward": 0.1}) + "\n" for s in (2, 3)))
    runs.start(warm, now)
    assert "grader" not in capsys.readouterr().err
    assert "grader_changes" not in json.loads((warm / "run_config.json").read_text())
    runs.start(grpo, now)
    err = capsys.readouterr().err
    assert f"GRPO steps up to 3 were rewarded by the {matcher.STRICT_GRADER}; from step 4 the {matcher.GRADER}" in err
    saved = json.loads((grpo / "run_config.json").read_text())
    assert saved["grader_changes"] == [{"from_step": 4, "before": matcher.STRICT_GRADER, "now": matcher.GRADER}]
    runs.start(grpo, now)  # resumed again under the same grader: nothing more to say
    assert "rewarded by" not in capsys.readouterr().err
    assert json.loads((grpo / "run_config.json").read_text())["grader_changes"] == saved["grader_changes"]
