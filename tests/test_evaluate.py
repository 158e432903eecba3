"""The evaluation script end to end, with scripted models behind an OpenAI-compatible endpoint."""

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, needs_enron
from email_agent import questions as qmod
from scripted_server import call, expert_script, serve_in_thread

import test_email_search_agent as evaluate


def run_cli(*argv):
    return evaluate.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def demo_questions(demo_db):
    return qmod.select_questions(demo_db, "test", seed=0, limit=6)


def test_report_for_two_scripted_models(demo_db_path, demo_questions, tmp_path, capsys):
    liar = {q.question: [call("return_final_answer", {"answer": "Room 99", "sources": []})] for q in demo_questions}
    scripts = {"expert": {q.question: expert_script(q) for q in demo_questions}, "liar": liar}
    with serve_in_thread(scripts) as server:
        rc = run_cli("--db", demo_db_path, "--model", "hosted_vllm/expert", "--model", "hosted_vllm/liar",
                     "--base-url", server.base_url, "--limit", 6, "--output", tmp_path, "--art-dir", tmp_path / "art")
    assert rc == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 12 and {r["model"] for r in records} == {"hosted_vllm/expert", "hosted_vllm/liar"}
    summary = json.loads((tmp_path / "summary.json").read_text())["models"]
    assert summary["hosted_vllm/expert"]["accuracy"] == 1.0 and summary["hosted_vllm/expert"]["hallucination_rate"] == 0
    assert summary["hosted_vllm/liar"]["accuracy"] == 0.0 and summary["hosted_vllm/liar"]["hallucination_rate"] == 1
    expert = next(r for r in records if r["model"] == "hosted_vllm/expert")
    assert expert["verdict"]["judge"] == "offline" and expert["messages"][2]["tool_calls"]
    html = (tmp_path / "report.html").read_text()
    assert html.count('class="question"') == 6 and "Room 99" in html
    assert "OFFLINE" in capsys.readouterr().err  # no judge configured: said loudly


def test_rejudge_with_an_llm_judge(demo_db_path, demo_questions, tmp_path):
    q = demo_questions[0]
    scripts = {"expert": {q.question: expert_script(q, answer="some paraphrase")},
               "judge": {"*": [{"text": '{"reasoning": "same fact", "accept": true}'}]}}
    with serve_in_thread(scripts) as server:
        assert run_cli("--db", demo_db_path, "--model", "hosted_vllm/expert", "--base-url", server.base_url,
                       "--limit", 1, "--output", tmp_path / "first", "--art-dir", tmp_path / "art") == 0
        first = json.loads((tmp_path / "first" / "results.jsonl").read_text())
        assert first["metrics"]["answer_correct"] == 0 and first["metrics"]["hallucinated"] == 1
        assert run_cli("--rejudge", tmp_path / "first", "--judge-model", "openai/judge", "--judge-base-url",
                       server.base_url, "--output", tmp_path / "second", "--art-dir", tmp_path / "art") == 0
    second = json.loads((tmp_path / "second" / "results.jsonl").read_text())
    assert second["metrics"]["answer_correct"] == 1 and second["metrics"]["hallucinated"] == 0
    assert second["verdict"] == {"correct": True, "judge": "openai/judge", "reasoning": "same fact", "error": None}
    assert second["reward_mode"] == "shaped" and second["reward"] > 1
    assert second["messages"] == first["messages"]  # nothing re-run


def test_judge_failure_is_recorded_not_silent(demo_db_path, demo_questions, tmp_path):
    q = demo_questions[0]
    scripts = {"expert": {q.question: expert_script(q)}, "judge": {"*": [{"status": 500}]}}
    with serve_in_thread(scripts) as server:
        assert run_cli("--db", demo_db_path, "--model", "hosted_vllm/expert", "--base-url", server.base_url,
                       "--limit", 1, "--judge-model", "openai/judge", "--judge-base-url", server.base_url,
                       "--output", tmp_path, "--art-dir", tmp_path / "art") == 0
    record = json.loads((tmp_path / "results.jsonl").read_text())
    assert record["metrics"]["judge_error"] == 1 and "judge openai/judge failed" in record["verdict"]["error"]
    assert record["verdict"]["judge"] == "offline" and record["metrics"]["answer_correct"] == 1  # fallback, flagged


@pytest.mark.parametrize("status, requests", [(500, 3), (429, 3), (401, 1), (400, 1)])
def test_judge_retries_only_transient_errors(status, requests):
    import asyncio

    from email_agent.rewards import LLMJudge

    with serve_in_thread({"*": [{"status": status}] * 5}) as server:
        judge = LLMJudge("openai/judge", api_base=server.base_url, retries=3)
        verdict = asyncio.run(judge.verdict("Which room?", "Room 3C", "Room 3C"))
        asked = len(server.requests)
    assert asked == requests  # a bad request or a wrong key fails the same way every time
    assert verdict.error.startswith(f"judge openai/judge failed after {requests} tr")
    assert verdict.judge == "offline" and verdict.correct  # the offline matcher decided, and it is flagged


def test_bad_model_specs_are_clear_errors(demo_db_path, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert run_cli("--db", demo_db_path, "--model", "nonsense", "--output", tmp_path) == 1
    assert run_cli("--db", demo_db_path, "--model", "openai/o4-mini", "--output", tmp_path) == 1
    assert run_cli("--db", demo_db_path, "--model", "anthropic/claude", "--output", tmp_path) == 1
    err = capsys.readouterr().err
    assert "provider/model" in err and "OPENAI_API_KEY" in err and "--base-url" in err
    assert "Traceback" not in err


def test_ctrl_c_keeps_finished_rollouts(demo_db_path, demo_questions, tmp_path):
    fast = {q.question: expert_script(q) for q in demo_questions[:2]}
    slow = {q.question: [{"sleep": 60, "text": "..."}] for q in demo_questions[2:]}
    with serve_in_thread({**fast, **slow}) as server:
        proc = subprocess.Popen([sys.executable, str(ROOT / "test_email_search_agent.py"), "--db", str(demo_db_path),
                                 "--model", "hosted_vllm/x", "--base-url", server.base_url, "--limit", "6",
                                 "--output", str(tmp_path), "--art-dir", str(tmp_path / "art")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        results = tmp_path / "results.jsonl"
        deadline = time.time() + 60
        while time.time() < deadline and (not results.exists() or len(results.read_text().splitlines()) < 2):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert len(results.read_text().splitlines()) == 2
    assert json.loads((tmp_path / "summary.json").read_text())["models"]["hosted_vllm/x"]["n"] == 2
    assert (tmp_path / "report.html").exists() and "Traceback" not in err


@needs_enron
def test_report_on_the_real_enron_sample(enron_db_path, enron_db, tmp_path):
    qs = qmod.select_questions(enron_db, "train")  # the 2 questions whose gold email is in the sample
    assert len(qs) == 2
    scripts = {q.question: [call("read_email", {"message_id": q.message_ids[0]}),
                            call("return_final_answer", {"answer": q.answer, "sources": q.message_ids})] for q in qs}
    with serve_in_thread(scripts) as server:
        assert run_cli("--db", enron_db_path, "--split", "train", "--model", "hosted_vllm/x", "--base-url",
                       server.base_url, "--output", tmp_path, "--art-dir", tmp_path / "art") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())["models"]["hosted_vllm/x"]
    assert summary["n"] == 2 and summary["accuracy"] == 1.0
