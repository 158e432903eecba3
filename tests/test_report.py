"""Tests for email_agent.evaluation.report: statistics, history loading and the rendered reports."""
import json
import re

import pytest

from email_agent.redact import redact
from email_agent.evaluation.report import write_report
from email_agent.evaluation.scores import episode_outcome, load_history, summarize, wilson_interval


def _rec(model, qid, *, correct=1, halluc=0, idk=0, latency=1.0, valid=1, calls=1, cost=0.001, error=None,
         answer="Thursday March 14", messages=None, parse_errors=0):
    metrics = {} if error else {"parse_errors": parse_errors,
        "answer_correct": correct, "sources_correct": correct, "attempted_answer": 1 - idk, "returned_i_dont_know": idk,
        "hallucinated": halluc, "num_turns": 3, "ran_out_of_turns": 0, "valid_tool_calls": valid, "tool_calls": calls,
        "prompt_tokens": 1000, "completion_tokens": 100, "latency_s": latency,
    }
    return {
        "model": model, "question_id": qid, "question": f"Question {qid}?", "gold_answer": "Thursday, March 14",
        "gold_message_ids": ["<demo.1@larkspur.example>"], "inbox": "ana@larkspur.example", "query_date": "2024-03-20",
        "answer": None if error else answer, "sources": [], "reward": float(correct),
        "verdict": {"correct": None if error else bool(correct), "judge": "offline", "reasoning": "r", "error": None},
        "metrics": metrics, "cost_usd": cost, "error": error,
        "messages": messages or [{"role": "system", "content": "You are an email agent."},
                                 {"role": "user", "content": f"Question {qid}?"}],
    }


@pytest.fixture
def records():
    return [
        _rec("trained", 1, correct=1, halluc=0, latency=1.0, valid=3, calls=3, cost=0.001),
        _rec("base", 1, correct=0, halluc=0, idk=1, latency=5.0, valid=0, calls=0, cost=None, parse_errors=2),
        _rec("trained", 2, correct=0, halluc=1, latency=2.0, valid=2, calls=4, cost=0.002),
        _rec("base", 2, correct=1, latency=7.0, valid=0, calls=0, cost=0.01),
        _rec("trained", 3, correct=1, latency=4.0, valid=1, calls=1, cost=0.003),
        _rec("trained", 4, error="rollout crashed: boom", cost=None),
    ]


def test_wilson_interval_hand_values():
    # z = 1.96, z^2/n = 0.38416 for n = 10.
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.38416 / 1.38416))
    assert wilson_interval(10, 10) == pytest.approx((1 / 1.38416, 1.0))
    lo, hi = wilson_interval(5, 10)
    half = 1.96 / 1.38416 * (0.25 / 10 + 0.38416 / 40) ** 0.5
    assert (lo, hi) == pytest.approx((0.5 - half, 0.5 + half))
    assert (lo, hi) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 0.0)  # documented choice for "no data"


def test_summarize_two_models(records):
    s = summarize(records)
    assert list(s["models"]) == ["trained", "base"]  # order of first appearance
    assert s["n_questions"] == 4
    t, b = s["models"]["trained"], s["models"]["base"]
    assert (t["n"], t["n_errors"], t["n_scored"]) == (4, 1, 3)
    assert t["accuracy"] == pytest.approx(2 / 4)  # the errored record counts as wrong...
    assert t["accuracy_ci"] == pytest.approx(list(wilson_interval(2, 4)))
    assert t["accuracy_scored"] == pytest.approx(2 / 3)  # ...and the scored-only figure stands beside it
    assert t["hallucination_rate"] == pytest.approx(1 / 3)
    assert t["latency_p50_s"] == pytest.approx(2.0)
    assert t["latency_p95_s"] == pytest.approx(3.8)  # linear interpolation over [1, 2, 4]
    assert t["valid_tool_call_rate"] == pytest.approx(6 / 8)
    assert t["cost_per_1k_usd"] == pytest.approx(2.0)  # errored record's missing cost does not count
    assert t["avg_turns"] == pytest.approx(3.0)
    assert t["mean_reward"] == pytest.approx(2 / 3)
    assert b["cost_per_1k_usd"] is None  # one base record lacks a price
    assert b["valid_tool_call_rate"] == 0.0  # two turns of plain text: no valid call in two attempts
    assert b["idk_rate"] == pytest.approx(0.5)
    assert (b["n"], b["n_errors"], b["accuracy"]) == (2, 0, 0.5)


def test_outcomes_say_how_close_each_episode_came_to_the_gold_email(tmp_path):
    def rec(qid, *, read=0, listed=0, out_of_turns=False, **kw):
        r = _rec("m", qid, **kw)
        r["metrics"].update(ever_read_right_email=read, ever_found_right_email=listed or read)
        if out_of_turns:
            r["metrics"].update(attempted_answer=0, returned_i_dont_know=0, ran_out_of_turns=1)
        return r

    records = [rec(1, read=1), rec(2, correct=0, halluc=1, read=1), rec(3, correct=0, halluc=1, read=1),
               rec(4, correct=0, halluc=1, listed=1), rec(5, correct=0, halluc=1),
               rec(6, correct=0, idk=1, listed=1), rec(7, correct=0, idk=1), rec(8, correct=0, out_of_turns=True),
               _rec("m", 9, error="rollout crashed")]
    assert [episode_outcome(r) for r in records] == [
        "right", "wrong_read", "wrong_read", "wrong_listed", "wrong_unseen", "idk_seen", "idk_unseen", "no_answer",
        "no_answer"]  # each episode its own outcome, not only the right counts
    outcomes = summarize(records)["models"]["m"]["outcomes"]
    assert outcomes == {"right": 1, "wrong_read": 2, "wrong_listed": 1, "wrong_unseen": 1, "withheld": 0,
                        "idk_seen": 1, "idk_unseen": 1, "no_answer": 2}
    md = write_report(tmp_path, records, summarize(records))["markdown"].read_text()
    assert "| m | 1 (11%) | 2 (22%) | 1 (11%) | 1 (11%) | 1 (11%) | 1 (11%) | 2 (22%) |" in md
    assert "Where answers went wrong" in (tmp_path / "report.html").read_text()
    assert "Withheld by the grounding check |" not in md  # no column for a check that was off

    # answers the grounding check withheld: a column of their own, saying how many would have been right
    withheld = [rec(10 + i, correct=0, idk=1, read=1) for i in range(2)]
    for r, was_right in zip(withheld, (1, 0)):
        r["metrics"].update(withheld_answer=1, withheld_right=was_right)
        r["withheld"] = {"answer": f"Room {r['question_id']}Z", "sources": [], "unseen": [f"{r['question_id']}Z"]}
    for r in records + withheld:
        r["grounded_answers"] = True
    summary = summarize(records + withheld)
    assert summary["models"]["m"]["outcomes"]["withheld"] == 2 and summary["models"]["m"]["withheld_right"] == 1
    assert summary["models"]["m"]["outcomes"]["idk_seen"] == 1  # withheld answers are not counted twice
    md = write_report(tmp_path, records + withheld, summary)["markdown"].read_text()
    assert "| Withheld by the grounding check |" in md and "| 2 (18%), 1 of them right |" in md
    html = (tmp_path / "report.html").read_text()
    assert "Withheld by the grounding check:</b> Room 10Z (right; 10Z in nothing the agent saw)" in html
    md = write_report(tmp_path, records, summarize(records))["markdown"].read_text()
    assert "| 0 (0%), 0 of them right |" in md  # the check was on and withheld nothing: the column says so


def test_summarize_all_errored_model_is_all_wrong():
    m = summarize([_rec("x", 1, error="crash")])["models"]["x"]
    assert m["accuracy"] == 0.0 and m["accuracy_scored"] is None and m["n_errors"] == 1
    assert summarize([])["models"] == {}


def test_valid_tool_call_rate_counts_turns_without_a_call():
    from email_agent.agent.rewards import valid_tool_call_rate

    # One valid call in 4 turns of which 3 were plain text: 25%, not the 100% of calls alone.
    assert valid_tool_call_rate([{"tool_calls": 1, "valid_tool_calls": 1, "parse_errors": 3}]) == 0.25
    assert valid_tool_call_rate([{"tool_calls": 2, "valid_tool_calls": 1, "parse_errors": 0},
                                 {"tool_calls": 0, "valid_tool_calls": 0, "parse_errors": 2}]) == 0.25
    assert valid_tool_call_rate([{"tool_calls": 0, "valid_tool_calls": 0, "parse_errors": 0}]) is None


def test_paired_mcnemar_for_every_pair_in_summary_and_reports(tmp_path):
    from email_agent.evaluation.scores import mcnemar_exact

    # A right on 1-8, B right on 1-2; C errors everywhere (counted wrong). Question 9 only A and B played.
    records = [_rec("A", q, correct=int(q <= 8)) for q in range(1, 11)]
    records += [_rec("B", q, correct=int(q <= 2)) for q in range(1, 11)]
    records += [_rec("C", q, error="APIConnectionError") for q in range(1, 9)]
    s = summarize(records)
    pairs = {(p["a"], p["b"]): p for p in s["pairs"]}
    assert list(pairs) == [("A", "B"), ("A", "C"), ("B", "C")]
    assert pairs["A", "B"] == {"a": "A", "b": "B", "n": 10, "only_a": 6, "only_b": 0,
                               "p_value": pytest.approx(mcnemar_exact(6, 0)), "higher_a": 6, "higher_b": 0,
                               "score_p_value": pytest.approx(mcnemar_exact(6, 0))}
    assert pairs["A", "B"]["p_value"] == pytest.approx(2 / 64)
    assert (pairs["A", "C"]["n"], pairs["A", "C"]["only_a"], pairs["A", "C"]["only_b"]) == (8, 8, 0)
    assert (pairs["B", "C"]["only_a"], pairs["B", "C"]["p_value"]) == (2, 0.5)
    write_report(tmp_path, records, s)
    md = (tmp_path / "report.md").read_text()
    assert "## Paired comparison" in md and "| A | B | 10 | 6 | 0 | 0.0312 | A is better (p < 0.05) | 6 | 0 |" in md
    assert "| B | C | 8 | 2 | 0 | 0.5 | no significant difference | 2 | 0 | 0.5 | no significant difference |" in md
    assert json.loads((tmp_path / "summary.json").read_text())["pairs"][0]["p_value"] == pytest.approx(0.03125)
    assert "Paired comparison" in (tmp_path / "report.html").read_text()


def test_the_score_is_right_minus_hallucinated_and_its_sign_test_says_what_training_changed(tmp_path):
    from email_agent.evaluation.scores import mcnemar_exact, score

    # The warm start answers all 10: right on 1-5, wrong on 6-10. The final agent keeps 1-4 right, says "I don't
    # know" on 5-9 and stays wrong on 10: fewer right answers (McNemar sees only question 5), a higher score.
    records = [_rec("run@1", q, correct=int(q <= 5), halluc=int(q > 5)) for q in range(1, 11)]
    records += [_rec("run", q, correct=int(q <= 4), halluc=int(q == 10), idk=int(5 <= q <= 9)) for q in range(1, 11)]
    records += [_rec("other", q, error="APIConnectionError") for q in range(1, 11)]
    assert [score(r) for r in records[10:20]] == [1] * 4 + [0] * 5 + [-1] and score(records[-1]) == 0
    s = summarize(records)
    assert s["models"]["run@1"]["score"] == pytest.approx(0.0) and s["models"]["run"]["score"] == pytest.approx(0.3)
    pair = s["pairs"][0]
    assert (pair["only_a"], pair["only_b"], pair["higher_a"], pair["higher_b"]) == (1, 0, 1, 4)
    assert pair["score_p_value"] == pytest.approx(mcnemar_exact(1, 4))
    write_report(tmp_path, records, s)
    md = (tmp_path / "report.md").read_text()
    # only checkpoints of one run are compared as training: "other" is another model
    assert md.count("- From ") == 1
    assert ('- From run@1 to run: right 50.0% -> 40.0%, hallucinated 50.0% -> 10.0%, "I don\'t know" 0.0% -> 50.0%, '
            'score (right minus hallucinated) +0.00 -> +0.30: higher on 4 questions, lower on 1 (sign test p = 0.375).'
            ) in md
    assert "| run@1 | 10 | 0 | 50.0%" in md and "| +0.00 |" in md and "| +0.30 |" in md
    assert "What training changed" in (tmp_path / "report.html").read_text()


def test_report_states_tool_choice_and_episode_limits(tmp_path):
    trained = dict(_rec("run@3", 1), tool_choice="auto", backend="cpu", concurrency=8,
                   episode={"max_turns": 4, "max_tokens": 64, "max_body_chars": 600, "search_results": 3})
    prompted = dict(_rec("openai/o4-mini", 1), tool_choice="required", backend="api",
                    episode={"max_turns": 10, "max_tokens": 1024, "max_body_chars": 4000, "search_results": 10})
    s = summarize([trained, prompted])
    assert s["models"]["run@3"]["tool_choice"] == "auto" and s["models"]["openai/o4-mini"]["tool_choice"] == "required"
    assert s["models"]["run@3"]["episode"]["max_turns"] == 4
    write_report(tmp_path, [trained, prompted], s)
    md = (tmp_path / "report.md").read_text()
    assert "| run@3 | cpu | 8 | auto | 4 | 64 | 600 | 3 |" in md
    assert "| openai/o4-mini | api | — | required | 10 | 1024 | 4000 | 10 |" in md  # records from before it was kept
    assert "waiting for a free slot is not counted" in md
    assert "counts errored rollouts" in md and "turns that made no call" in md


def test_write_report_files_and_structure(tmp_path, records):
    s = summarize(records)
    paths = write_report(tmp_path / "out", records, s)
    assert {p.name for p in paths.values()} == {"summary.json", "report.md", "report.html"}
    assert json.loads(paths["summary"].read_text()) == json.loads(json.dumps(s))
    page = paths["html"].read_text()
    assert page.count('<tr class="model-row">') == 2
    assert page.count('<details class="question"') == 4
    assert "<link" not in page and "src=" not in page and "http" not in page  # self-contained
    assert page.count("<svg") >= 5
    md = paths["markdown"].read_text()
    assert "50.0% [15.0–85.0] | 66.7% |" in md  # errors count as wrong; scored-only beside it
    assert "| base |" in md and "—" in md  # base cost unknown
    assert "Learning curve" not in md and "Learning curve" not in page


def test_untrusted_text_is_escaped_and_secrets_scrubbed(tmp_path):
    evil = "<script>alert(1)</script>"
    messages = [
        {"role": "system", "content": "key sk-abcdefgh12345678XYZ and Authorization: Bearer tok_123.secret"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "read_email", "arguments": '{"message_id": "<m1>"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Body: " + evil + "x" * 5000},
    ]
    recs = [_rec("m", 1, answer=evil, messages=messages)]
    page = write_report(tmp_path, recs, summarize(recs))["html"].read_text()
    assert evil not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "sk-abcdefgh" not in page and "tok_123" not in page
    assert "sk-[redacted]" in page and "Bearer [redacted]" in page
    assert "truncated 3,031 more characters" in page  # 5,031-char tool result cut to 2,000
    assert "&quot;message_id&quot;: &quot;&lt;m1&gt;&quot;" in page  # pretty-printed, escaped arguments
    assert len(re.findall(r"<script>", page)) == 1  # only the page's own filter script


def test_trace_verdict_badges(tmp_path, records):
    page = write_report(tmp_path, records, summarize(records))["html"].read_text()
    for css in ("correct", "wrong", "idk", "error"):
        assert f'class="badge {css}"' in page
    # Only question 3 has no non-correct attempt (q1: base said I don't know, q2: wrong, q4: error).
    assert page.count('data-haswrong="1"') == 3 and page.count('data-haswrong="0"') == 1


def test_load_history_skips_corrupt_lines(tmp_path):
    p = tmp_path / "history.jsonl"
    p.write_text('{"step": 0, "val/reward": 0.1}\n\nnot json\n[1, 2]\n{"step": 5, "train/reward": 0.3}\n'
                 '{"step": 10, "val/re')
    assert load_history(p) == [{"step": 0, "val/reward": 0.1}, {"step": 5, "train/reward": 0.3}]
    assert load_history(p, until_step=4) == [{"step": 0, "val/reward": 0.1}]  # the curve of checkpoint 4


def test_learning_curve_section_with_histories(tmp_path, records):
    hist = {"run-a": [{"step": 0, "val/reward": 0.1, "val/answer_correct": 0.2}, {"step": 5, "train/reward": 0.5},
                      {"step": 10, "val/reward": 0.4, "val/answer_correct": 0.6}],
            "run-b": [{"step": 0, "val/reward": 0.05}]}
    paths = write_report(tmp_path, records, summarize(records), histories=hist)
    md, page = paths["markdown"].read_text(), paths["html"].read_text()
    assert "## Learning curve" in md and "### run-a" in md
    assert "| step | phase | train/reward | val/reward | val/answer_correct |" in md
    assert "| 10 |  | — | 0.4 | 0.6 |" in md
    assert "| 5 | GRPO | 0.5 | — | — |" in md
    # train/reward: a; val/reward: a+b; answer_correct: a. No warm start in these runs: nothing greyed.
    assert "Learning curve" in page and page.count("<polyline") == 4 and 'class="warm"' not in page


def test_learning_curve_marks_the_warm_start_and_merges_a_steps_rows(tmp_path, records):
    """As ART writes history.jsonl for warm start + GRPO: the untrained step 0 validated, two SFT epochs (ART's
    train_sft row with a loss, the trainer's sft_epoch marker), validation after them, then GRPO steps whose
    training and validation rows are separate lines."""
    rows = [{"step": 0, "val/reward": -0.5, "val/answer_correct": 0.0},
            {"step": 1, "train/loss": 1.2}, {"step": 1, "train/sft_epoch": 1},
            {"step": 2, "train/loss": 0.8}, {"step": 2, "train/sft_epoch": 2},
            {"step": 2, "val/reward": 0.1, "val/answer_correct": 0.4},
            {"step": 3, "train/reward": 0.2, "train/loss": 0.01},
            {"step": 4, "train/reward": 0.3, "train/loss": 0.02},
            {"step": 4, "val/reward": 0.3, "val/answer_correct": 0.5},
            {"step": 5, "train/loss": 0.9}]  # an older run's SFT row (no marker) still counts as warm start
    from email_agent.evaluation.scores import warm_start_steps

    assert warm_start_steps(rows) == {1, 2, 5}
    paths = write_report(tmp_path, records, summarize(records), histories={"learn": rows[:-1]})
    md, page = paths["markdown"].read_text(), paths["html"].read_text()
    assert "| 1 | warm start | — | — | — |" in md
    assert "| 2 | warm start | — | 0.1 | 0.4 |" in md
    assert "| 4 | GRPO | 0.3 | 0.3 | 0.5 |" in md
    assert page.count('class="warm"') == 3  # one grey span per chart: train/reward, val/reward, val/answer_correct
    assert "warm start (supervised), steps 0-2" in page
    assert page.count("<polyline") == 3


def test_valid_tool_call_rate_counts_turns_without_a_call_as_failed_attempts():
    """Catches: a missing count taken as anything but 0 (an episode's metrics from an older evaluation may lack
    one), or turns of plain text left out of the attempts."""
    from email_agent.agent.rewards import valid_tool_call_rate

    assert valid_tool_call_rate([{"tool_calls": 3, "valid_tool_calls": 2}, {"parse_errors": 1}]) == 2 / 4
    assert valid_tool_call_rate([{"parse_errors": 2}, {"tool_calls": 2, "valid_tool_calls": 2}]) == 2 / 4
    assert valid_tool_call_rate([{}]) is None and valid_tool_call_rate([]) is None


def test_mcnemar_exact_matches_the_binomial():
    from email_agent.evaluation.scores import mcnemar_exact

    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(6, 0) == pytest.approx(2 / 64)  # all 6 discordant pairs favour A: 2 * 0.5**6
    assert mcnemar_exact(1, 9) == pytest.approx(2 * 11 / 1024)  # 2 * P(X <= 1), X ~ Bin(10, 1/2)
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)


def test_redact_removes_keys_in_use_whatever_their_shape(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "ant-key-0123456789")
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghij")
    monkeypatch.setenv("POLICY_API_KEY", "x")  # a placeholder too short to be a secret: left alone
    text = ("401: invalid key ant-key-0123456789 (token hf_abcdefghij, given gk-given-secret, "
            "header Bearer abc.def, key sk-proj-0123456789) for model x")
    shown = redact(text, "gk-given-secret", None)
    for secret in ("ant-key-0123456789", "hf_abcdefghij", "gk-given-secret", "abc.def", "sk-proj-0123456789"):
        assert secret not in shown
    assert shown.endswith("for model x") and shown.count("[redacted]") == 5


def test_flat_learning_curve_spans_zero_not_one_above_its_value(tmp_path, records):
    """A metric that never moved (validation accuracy 0.25 at every step, valid calls 1.0) is drawn against an
    axis from 0, not from its value to its value + 1 (which read as a 125% accuracy)."""
    rows = [{"step": 1, "val/reward": -0.2, "val/answer_correct": 0.25, "val/valid_tool_call_rate": 1.0},
            {"step": 3, "val/reward": -0.2, "val/answer_correct": 0.25, "val/valid_tool_call_rate": 1.0}]
    page = write_report(tmp_path, records, summarize(records), histories={"flat": rows})["html"].read_text()
    axes = dict(re.findall(r'aria-label="([^"]+)">.*?text-anchor="end">([^<]+)</text>', page))
    assert axes == {"val/reward": "0", "val/answer_correct": "0.25", "val/valid_tool_call_rate": "1"}


def test_every_mean_reads_its_own_metric():
    """Each per-model figure averages the metric it names (a misspelt key reads as "no data", n/a)."""
    def metrics(i):
        return {"num_turns": 2 + i, "ran_out_of_turns": i, "prompt_tokens": 1000 * (i + 1),
                "completion_tokens": 10 * (i + 1), "sources_correct": i, "hallucinated": 0,
                "returned_i_dont_know": 1 - i}
    rs = [{**_rec("m", i), "metrics": {**_rec("m", i)["metrics"], **metrics(i)}} for i in (0, 1)]
    m = summarize(rs)["models"]["m"]
    assert (m["avg_turns"], m["ran_out_of_turns_rate"], m["mean_prompt_tokens"], m["mean_completion_tokens"],
            m["sources_correct"], m["hallucination_rate"], m["idk_rate"]) == (2.5, 0.5, 1500, 15, 0.5, 0, 0.5)


def test_records_without_an_id_or_a_model_are_told_apart_by_their_question_and_shown_as_unknown():
    """Older result files lack question_id: questions are then told apart (and paired) by their text; a record
    without a model is grouped as "?", not as "None"."""
    rs = [{key: value for key, value in _rec(model, q, correct=int(model == "a")).items() if key != "question_id"}
          for model in ("a", "b") for q in (1, 2, 3)]
    s = summarize(rs)
    assert s["n_questions"] == 3 and (s["pairs"][0]["n"], s["pairs"][0]["only_a"]) == (3, 3)
    unnamed = {key: value for key, value in _rec("x", 1).items() if key != "model"}
    assert list(summarize([unnamed])["models"]) == ["?"]


def test_results_file_lines_that_a_reader_cannot_use_are_counted_not_read(tmp_path):
    """read_results keeps well-typed records and counts the rest: a cut line, a metric that is not a number, a
    max_turns that is not an integer, a message that is not an object, a non-object line; bytes that are not
    UTF-8 are replaced, not fatal."""
    from email_agent.results_file import read_results

    good = _rec("m", 1)
    bad = [{**good, "metrics": {**good["metrics"], "answer_correct": "yes"}}, {**good, "max_turns": "5"},
           {**good, "max_turns": 5.0}, {**good, "messages": [*good["messages"], "a message that is not an object"]}]
    path = tmp_path / "results.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in [good, *bad, {**good, "max_turns": 5}])
                     + b"[1]\n\n" + json.dumps({**good, "question": "caf\xe9?"}, ensure_ascii=False).encode("latin-1")
                     + b"\n"
                     + json.dumps(good).encode()[:-9])
    records, unreadable = read_results(path)
    assert [r.get("max_turns") for r in records] == [None, 5, None] and unreadable == 6
    assert records[2]["question"] == "caf\ufffd?"  # the Latin-1 byte, replaced


def test_load_history_keeps_the_evaluated_step_and_reads_past_bytes_that_are_not_utf8(tmp_path):
    p = tmp_path / "history.jsonl"
    p.write_bytes(b'{"step": 3, "val/reward": 0.1}\n{"step": 4, "note": "caf\xe9"}\n{"step": 5, "val/reward": 0.2}\n')
    assert [row["step"] for row in load_history(p, until_step=4)] == [3, 4]  # the checkpoint's own step counts
    assert load_history(p)[1]["note"] == "caf\ufffd"


def test_console_lines_state_each_figure_and_what_is_unknown():
    from email_agent.evaluation.scores import console_lines

    known = {"accuracy": 0.5, "hallucination_rate": 0.125, "score": 0.375, "avg_turns": 3.25, "n": 8, "n_errors": 1,
             "tool_choice": "auto", "episode": {"max_turns": 6, "max_tokens": 512}}
    unknown = {"accuracy": None, "hallucination_rate": None, "avg_turns": None, "n": 0, "n_errors": 0}
    pairs = [{"a": "trained", "b": "base", "only_a": 1, "only_b": 7, "p_value": 0.0703125},
             {"a": "trained", "b": "other", "only_a": 0, "only_b": 6, "p_value": 0.03125, "higher_a": 5,
              "higher_b": 0, "score_p_value": 0.0625}]
    lines = console_lines({"models": {"trained": known, "base": unknown}, "pairs": pairs})
    assert lines == [
        f"{'trained':>32}  accuracy 50.0%  hallucination 12.5%  score +0.38  turns 3.2  n=8  errors 1  "
        "tool_choice auto  limits 6 turns/512 tokens",
        f"{'base':>32}  accuracy n/a  hallucination n/a  score n/a  turns n/a  n=0  errors 0  tool_choice n/a  "
        "limits ? turns/? tokens",
        "trained vs base: 1 vs 7 questions only one got right, McNemar p=0.0703: no significant difference",
        "trained vs other: 0 vs 6 questions only one got right, McNemar p=0.0312: other is better",
        "trained vs other on the score (right +1, hallucinated -1): higher on 5 vs 0 questions, sign test "
        "p=0.0625: no significant difference",
    ]


def test_small_samples_percentiles_errored_and_withheld_records(tmp_path):
    """Hand values where an off-by-one would hide: the interval of one question, the median of four latencies;
    an errored record counts wrong (and as no answer) whatever its metrics say; judge errors and records are
    counted; a record's withheld answer must be an object with a text answer and a list of sources."""
    from email_agent.evaluation.scores import warm_start_steps
    from email_agent.results_file import read_results

    lo, hi = wilson_interval(1, 1)  # z^2 = 3.8416: centre (1 + 1.9208) / 4.8416
    assert (lo, hi) == pytest.approx((0.2065, 1.0), abs=1e-4)
    rs = [_rec("m", q, latency=lat) for q, lat in enumerate([8.0, 1.0, 4.0, 2.0])]
    rs[0]["verdict"]["error"] = "judge unreachable"
    crashed = {**_rec("m", 9), "error": "rollout crashed after answering"}  # metrics still say right
    s = summarize(rs + [crashed])
    m = s["models"]["m"]
    assert m["latency_p50_s"] == pytest.approx(3.0)  # halfway between 2 and 4
    assert (m["accuracy"], m["judge_errors"], s["n_records"]) == (0.8, 1, 5)
    assert episode_outcome(crashed) == "no_answer"
    good = _rec("m", 1)
    withheld_shapes = [("a text", False), ({"answer": "a"}, False), ({"answer": 5, "sources": []}, False),
                       ({"answer": "a", "sources": "x"}, False), ({"answer": "a", "sources": ["<x@y>"]}, True),
                       (None, True)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps({**good, "withheld": w}) + "\n"
                                                    for w, _ in withheld_shapes))
    records, unreadable = read_results(tmp_path / "results.jsonl")
    assert [r["withheld"] for r in records] == [w for w, ok in withheld_shapes if ok] and unreadable == 4
    # the trainer's marker alone makes a warm-start step, whatever else its row logs
    assert warm_start_steps([{"step": 2, "train/sft_epoch": 1, "train/reward": 0.0},
                             {"step": 5, "train/reward": 0.1}]) == {2}
    # a row without a step is passed over, not the end of the history
    rows = [{"train/loss": 1.0}, {"step": 1, "train/sft_epoch": 1}, {"step": "2", "train/loss": 1}]
    assert warm_start_steps(rows) == {1}
