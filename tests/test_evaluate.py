"""The evaluation script end to end, with scripted models behind an OpenAI-compatible endpoint."""

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, needs_enron
from email_agent.evaluation import report
from email_agent.models import opened, servers
from email_agent import runs
from email_agent.data import questions as qmod
from email_agent.errors import UserError
from email_agent.agent.llm_judge import JUDGE_PROBE, judge_request
from art_doubles import GPUService, on_a_gpu_machine
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
    output = capsys.readouterr()
    assert "OFFLINE" in output.err  # no judge configured: said loudly
    (pair,) = json.loads((tmp_path / "summary.json").read_text())["pairs"]
    assert (pair["only_a"], pair["only_b"], pair["p_value"]) == (6, 0, 2 / 64)  # exact McNemar, 6 discordant
    assert "McNemar p=0.0312: hosted_vllm/expert is better" in output.out
    assert "tool_choice required" in output.out


def test_a_served_checkpoint_named_as_art_names_it_is_a_prompted_model(demo_db_path, demo_questions, tmp_path):
    """ART (and this project's CPU path) serves a checkpoint as NAME@STEP: `hosted_vllm/agent@7` is that name on
    the --base-url server, not step 7 of a run called hosted_vllm/agent."""
    scripts = {"agent@7": {q.question: expert_script(q) for q in demo_questions}}
    with serve_in_thread(scripts) as server:
        rc = run_cli("--db", demo_db_path, "--model", "hosted_vllm/agent@7", "--base-url", server.base_url,
                     "--limit", 6, "--output", tmp_path, "--art-dir", tmp_path / "art")
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())["models"]
    assert summary["hosted_vllm/agent@7"]["accuracy"] == 1.0


def test_each_model_plays_a_few_whole_episodes_at_once_and_cpu_models_take_turns():
    """Catches episodes all started at once (none ends until nearly all have played every turn, and the CPU
    server's prefix cache misses: no real-mail episode of 360 ended in ten minutes), more CPU-served models
    sharing the cores at once than `cpu_at_once`, and a turn passed on before its model's last episode ended."""
    import asyncio
    from types import SimpleNamespace

    labels = [("base", "cpu"), ("o4-mini", "api"), ("demo@1", "cpu"), ("demo@7", "cpu")]
    opened_models = [SimpleNamespace(label=label, backend=backend) for label, backend in labels]
    events, playing, most = [], dict.fromkeys(dict(labels), 0), {}

    async def play():
        scheduler = opened.EpisodeScheduler(opened_models, rollouts_each=5, concurrency=2, cpu_at_once=2)

        async def one(label, i):
            async with scheduler.slot(label):
                playing[label] += 1
                most[label] = max(most.get(label, 0), playing[label])
                events.append(("start", label))
                await asyncio.sleep(0.01 * (5 - i) * (2 if label == "base" else 1))  # the first to start ends last
                events.append(("end", label))
                playing[label] -= 1

        await asyncio.gather(*(one(c.label, i) for c in opened_models for i in range(5)))

    asyncio.run(play())
    assert most == dict.fromkeys(dict(labels), 2)  # never more than the concurrency, per model
    cpu = [e for e in events if e[1] != "o4-mini"]
    assert cpu[:4] == [("start", "base")] * 2 + [("start", "demo@1")] * 2  # two CPU models at once, in order
    demo = [e for e in events if e[1] in ("demo@1", "demo@7")]
    assert demo.index(("start", "demo@7")) == 10  # demo@7 waits for the first model to finish all five
    last_of_base = len(cpu) - 1 - cpu[::-1].index(("end", "base"))
    assert cpu.index(("start", "demo@7")) < last_of_base  # ... not for base, which ends later
    assert events.index(("start", "o4-mini")) < events.index(("end", "base"))  # prompted models do not wait


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
    assert second["verdict"] == {"correct": True, "judge": "openai/judge", "reasoning": "same fact", "error": None,
                                 "grader": "openai/judge"}
    assert second["reward_mode"] == "shaped" and second["reward"] > 1
    assert second["messages"] == first["messages"]  # nothing re-run

    # a results.jsonl whose last line a killed evaluation cut off: the whole lines are re-scored
    torn = tmp_path / "torn"
    torn.mkdir()
    text = (tmp_path / "first" / "results.jsonl").read_text()
    record = json.loads(text)
    mistyped = [{**record, "metrics": "s"}, {**record, "metrics": {**record["metrics"], "num_turns": "3"}},
                {**record, "sources": "<a@b>"}, {**record, "reward": None}, {**record, "withheld": {"answer": 1}},
                {**record, "messages": ["hi"]}, {**record, "max_turns": None}, [record]]
    (torn / "results.jsonl").write_text(text + text[:40] + "\n" + '{"model": "x"}\n'  # and a record of nothing
                                        + "".join(json.dumps(r) + "\n" for r in mistyped)  # and of the wrong types
                                        + text)  # and the same answer again
    assert run_cli("--rejudge", torn, "--output", tmp_path / "third") == 0
    assert len((tmp_path / "third" / "results.jsonl").read_text().splitlines()) == 1

    # an evaluation written where one already is moves the earlier one aside, never over it
    earlier = (tmp_path / "third" / "results.jsonl").read_text()
    assert run_cli("--rejudge", tmp_path / "second", "--output", tmp_path / "third") == 0
    [kept] = tmp_path.glob("third-*")
    assert (kept / "results.jsonl").read_text() == earlier and (tmp_path / "third" / "report.html").exists()
    # only the evaluation's own files move: a folder that holds other things keeps them
    (tmp_path / "third" / "demo.db").write_text("not ours")
    assert run_cli("--rejudge", tmp_path / "second", "--output", tmp_path / "third") == 0
    assert ((tmp_path / "third" / "demo.db").read_text() == "not ours"
            and (tmp_path / "third" / "results.jsonl").exists())
    assert sorted(p.name for p in max(tmp_path.glob("third-*"), key=lambda p: p.stat().st_mtime).iterdir()) == [
        "eval_config.json", "report.html", "report.md", "results.jsonl", "summary.json"]


def test_grounded_answers_withhold_invented_answers_live_and_on_rejudge(demo_db_path, demo_questions, tmp_path,
                                                                        capsys):
    q = demo_questions[0]
    scripts = {"inventor": {q.question: expert_script(q, answer="Zanzibar 9")}}
    with serve_in_thread(scripts) as server:
        assert run_cli("--db", demo_db_path, "--model", "hosted_vllm/inventor", "--base-url", server.base_url,
                       "--limit", 1, "--output", tmp_path / "plain", "--art-dir", tmp_path / "art") == 0
        assert run_cli("--db", demo_db_path, "--model", "hosted_vllm/inventor", "--base-url", server.base_url,
                       "--limit", 1, "--grounded-answers", "--output", tmp_path / "live", "--art-dir",
                       tmp_path / "art") == 0
    plain = json.loads((tmp_path / "plain" / "results.jsonl").read_text())
    live = json.loads((tmp_path / "live" / "results.jsonl").read_text())
    assert plain["answer"] == "Zanzibar 9" and plain["withheld"] is None and plain["metrics"]["hallucinated"] == 1
    assert live["answer"] == "I don't know" and live["withheld"]["unseen"] == ["Zanzibar", "9"]
    assert (live["metrics"]["withheld_answer"], live["metrics"]["hallucinated"]) == (1, 0)
    summary = json.loads((tmp_path / "live" / "summary.json").read_text())["models"]["hosted_vllm/inventor"]
    assert summary["hallucination_rate"] == 0 and summary["outcomes"]["withheld"] == 1
    assert "Withheld by the grounding check" in (tmp_path / "live" / "report.md").read_text()
    # --rejudge applies the check to an evaluation made without it, and takes it off again
    assert run_cli("--rejudge", tmp_path / "plain", "--grounded-answers", "--output", tmp_path / "on") == 0
    on = json.loads((tmp_path / "on" / "results.jsonl").read_text())
    keys = ("answer", "withheld", "reward")
    assert {k: on[k] for k in keys} == {k: live[k] for k in keys}
    assert "re-scoring with the grounding check" in capsys.readouterr().err  # unlike the evaluation
    assert run_cli("--rejudge", tmp_path / "on", "--output", tmp_path / "off") == 0
    off = json.loads((tmp_path / "off" / "results.jsonl").read_text())
    keys = ("answer", "sources", "withheld", "reward", "metrics", "grounded_answers")
    assert {k: off[k] for k in keys} == {k: plain[k] for k in keys}
    # a record written before the check existed (no withheld keys) re-scores as the agent answered
    old = {k: v for k, v in plain.items() if k not in ("withheld", "grounded_answers")}
    old["metrics"] = {k: v for k, v in plain["metrics"].items() if not k.startswith("withheld")}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.jsonl").write_text(json.dumps(old) + "\n")
    assert run_cli("--rejudge", tmp_path / "old", "--grounded-answers", "--output", tmp_path / "old-on") == 0
    assert json.loads((tmp_path / "old-on" / "results.jsonl").read_text())["withheld"] == live["withheld"]


def test_eval_config_is_saved_beside_the_report_and_read_back_by_rejudge_and_a_rerun(demo_db_path, demo_questions,
                                                                                        tmp_path, capsys):
    """eval_config.json holds every setting but the API key; --rejudge takes what was played from it (the flags
    it takes, how answers are scored, from the command line), and --config starts a run from it, flags winning."""
    scripts = {"expert": {q.question: expert_script(q) for q in demo_questions}}
    with serve_in_thread(scripts) as server:
        assert run_cli("--db", demo_db_path, "--model", "hosted_vllm/expert", "--base-url", server.base_url,
                       "--api-key", "sk-never-on-disk-123", "--limit", 2, "--max-turns", 5, "--grounded-answers",
                       "--output", tmp_path / "first", "--art-dir", tmp_path / "art") == 0
        assert (f"settings: --model hosted_vllm/expert --db {demo_db_path} --limit 2 --max-turns 5"
                in capsys.readouterr().err)  # told at the start, as training tells its config
        saved = json.loads((tmp_path / "first" / "eval_config.json").read_text())
        assert (saved["model"], saved["db"], saved["limit"], saved["max_turns"], saved["grounded_answers"]) == (
            ["hosted_vllm/expert"], str(demo_db_path), 2, 5, True)
        assert "api_key" not in saved and "output" not in saved and "sk-never" not in json.dumps(saved)

        assert run_cli("--rejudge", tmp_path / "first", "--output", tmp_path / "again") == 0
        rejudged = json.loads((tmp_path / "again" / "eval_config.json").read_text())
        assert {k: rejudged[k] for k in ("model", "db", "limit", "max_turns")} == {
            k: saved[k] for k in ("model", "db", "limit", "max_turns")}  # what was played, read back
        assert rejudged["rejudge"] == str(tmp_path / "first") and rejudged["grounded_answers"] is False

        assert run_cli("--config", tmp_path / "first" / "eval_config.json", "--limit", 3, "--no-grounded-answers",
                       "--output", tmp_path / "rerun") == 0
    rerun = json.loads((tmp_path / "rerun" / "eval_config.json").read_text())
    assert rerun == {**saved, "limit": 3, "grounded_answers": False}  # the flags given win, the rest read back
    results = [json.loads(line) for line in (tmp_path / "rerun" / "results.jsonl").read_text().splitlines()]
    assert len(results) == 3 and {r["max_turns"] for r in results} == {5}


def test_a_saved_config_of_the_wrong_kind_is_one_sentence(tmp_path, capsys):
    (tmp_path / "eval_config.json").write_text('{"limit": "2"}')
    assert run_cli("--config", tmp_path / "eval_config.json", "--model", "base", "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'eval_config.json'}: limit is '2'" in err and "Traceback" not in err
    (tmp_path / "eval_config.json").write_text('{"limit": 0}')  # the declared range holds for a saved value too
    assert run_cli("--config", tmp_path / "eval_config.json", "--model", "base", "--output", tmp_path / "out") == 1
    assert "--limit must be at least 1, not 0" in capsys.readouterr().err and not (tmp_path / "out").exists()


JUDGE_OK = {judge_request(*JUDGE_PROBE): [{"text": '{"reasoning": "same room", "accept": true}'}]}


def test_judge_failure_is_recorded_not_silent(demo_db_path, demo_questions, tmp_path):
    q = demo_questions[0]
    scripts = {"expert": {q.question: expert_script(q)}, "judge": {**JUDGE_OK, "*": [{"status": 500}]}}
    with serve_in_thread(scripts) as server:
        assert run_cli("--db", demo_db_path, "--model", "hosted_vllm/expert", "--base-url", server.base_url,
                       "--limit", 1, "--judge-model", "openai/judge", "--judge-base-url", server.base_url,
                       "--output", tmp_path, "--art-dir", tmp_path / "art") == 0
    record = json.loads((tmp_path / "results.jsonl").read_text())
    assert record["metrics"]["judge_error"] == 1 and "judge openai/judge failed" in record["verdict"]["error"]
    assert record["verdict"]["judge"] == "offline" and record["metrics"]["answer_correct"] == 1  # fallback, flagged


def test_a_judge_that_cannot_run_stops_the_evaluation_before_any_rollout(demo_db_path, demo_questions, tmp_path,
                                                                        capsys):
    """Not an evaluation graded offline in silence, each answer after its retries."""
    q = demo_questions[0]
    with serve_in_thread({"expert": {q.question: expert_script(q)}, "judge": {"*": [{"status": 401}]}}) as server:
        assert run_cli("--db", demo_db_path, "--model", "hosted_vllm/expert", "--base-url", server.base_url,
                       "--limit", 1, "--judge-model", "openai/judge", "--judge-base-url", server.base_url,
                       "--output", tmp_path / "eval", "--art-dir", tmp_path / "art") == 1
        assert [r["model"] for r in server.requests] == ["judge"]  # the probe, and no rollout
    err = capsys.readouterr().err
    assert "judge openai/judge failed after 1 try (AuthenticationError" in err
    assert "(JUDGE_API_KEY, or the provider's own variable such as OPENAI_API_KEY)" in err
    assert "Traceback" not in err and not (tmp_path / "eval").exists()


@pytest.mark.parametrize("status, requests", [(500, 3), (429, 3), (401, 1), (400, 1)])
def test_judge_retries_only_transient_errors(status, requests):
    import asyncio

    from email_agent.agent.llm_judge import LLMJudge

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
    slow = {q.question: [{"sleep": 900, "text": "..."}] for q in demo_questions[2:]}  # unfinished at the Ctrl-C
    with serve_in_thread({**fast, **slow}) as server:
        proc = subprocess.Popen([sys.executable, str(ROOT / "test_email_search_agent.py"), "--db", str(demo_db_path),
                                 "--model", "hosted_vllm/x", "--base-url", server.base_url, "--limit", "6",
                                 "--output", str(tmp_path), "--art-dir", str(tmp_path / "art")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        results = tmp_path / "results.jsonl"
        deadline = time.time() + 300  # a busy CI machine takes a while to start the evaluation
        while time.time() < deadline and (not results.exists() or len(results.read_text().splitlines()) < 2):
            time.sleep(0.2)
        assert results.exists(), "the two fast questions were not recorded within 300 s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert len(results.read_text().splitlines()) == 2
    assert json.loads((tmp_path / "summary.json").read_text())["models"]["hosted_vllm/x"]["n"] == 2
    assert (tmp_path / "report.html").exists() and "Traceback" not in err


def test_ctrl_c_before_any_rollout_finished_writes_nothing(demo_db_path, demo_questions, tmp_path):
    """Nothing to report: no empty results.jsonl (for --rejudge to trip on), the previous evaluation left in place."""
    (tmp_path / "results.jsonl").write_text("previous\n")
    with serve_in_thread({q.question: [{"sleep": 900, "text": "..."}] for q in demo_questions[:2]}) as server:
        proc = subprocess.Popen([sys.executable, str(ROOT / "test_email_search_agent.py"), "--db", str(demo_db_path),
                                 "--model", "hosted_vllm/x", "--base-url", server.base_url, "--limit", "2",
                                 "--output", str(tmp_path), "--art-dir", str(tmp_path / "art")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while time.time() < deadline and len(server.requests) < 2:  # the probe, then a rollout's first request
            time.sleep(0.2)
        assert len(server.requests) >= 2, "no rollout had started within 300 s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted before any rollout finished: nothing written" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]
    assert (tmp_path / "results.jsonl").read_text() == "previous\n"


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


# ---- fail fast: every endpoint is probed before the first rollout ----------------------------------------

def test_endpoint_down_fails_within_seconds_and_writes_nothing(demo_db_path, tmp_path, capsys):
    started = time.perf_counter()
    rc = run_cli("--db", demo_db_path, "--model", "hosted_vllm/x", "--base-url", "http://127.0.0.1:9/v1",
                 "--limit", 2, "--output", tmp_path / "out", "--art-dir", tmp_path / "art")
    err = capsys.readouterr().err
    assert rc == 1 and time.perf_counter() - started < 30
    assert "hosted_vllm/x: cannot reach http://127.0.0.1:9/v1" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # no report full of n/a


@pytest.mark.parametrize("server_kwargs, spec, message", [
    ({"api_key": "right"}, "hosted_vllm/expert", "refused the API key (HTTP 401)"),
    ({"models": ["expert", "liar"]}, "hosted_vllm/nope", "does not serve a model named 'nope'; it serves expert, liar"),
])
def test_probe_refused_key_and_unknown_model(demo_db_path, tmp_path, capsys, server_kwargs, spec, message):
    with serve_in_thread({}, **server_kwargs) as server:
        models = [arg for model in dict.fromkeys(["hosted_vllm/expert", spec]) for arg in ("--model", model)]
        rc = run_cli("--db", demo_db_path, *models, "--base-url", server.base_url, "--api-key", "wrong", "--limit", 2,
                     "--output", tmp_path / "out")
        asked = [r["messages"][0]["content"] for r in server.requests]
    err = capsys.readouterr().err
    assert rc == 1 and message in err and "Traceback" not in err
    assert all(q == "Say OK." for q in asked)  # no rollout started
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--limit", "-5"], "--limit must be at least 1, not -5"),
    (["--limit", "0"], "--limit must be at least 1, not 0"),
    (["--concurrency", "0"], "--concurrency must be at least 1, not 0"),
    (["--model", "base", "--model", "base"], "--model base is given twice"),
    (["--split", "tests"], "--split 'tests': "),
    (["--timeout", "nan"], "--timeout is seconds per model request, more than 0; not nan"),
    (["--timeout", "0"], "--timeout is seconds per model request, more than 0; not 0.0"),
    (["--temperature", "nan"], "--temperature must be between 0 and 2, not nan"),
    (["--temperature", "-1"], "--temperature must be between 0 and 2, not -1.0"),
    (["--reward", "rlhf"], "--reward is offline, shaped, judge or ruler, not 'rlhf'"),
    (["--rejudge", "eval/x", "--model", "base", "--limit", "3"], "runs no model, so --model, --limit, --db would"),
    (["--model", "base\udcff"], "the argument 'base\\xff' is not UTF-8 text"),
])
def test_numbers_that_would_slice_or_hang_are_refused(demo_db_path, tmp_path, capsys, flags, message):
    models = [] if "--model" in flags else ["--model", "base"]
    assert run_cli("--db", demo_db_path, *models, *flags, "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "out").exists()


def test_an_output_that_cannot_be_a_folder_is_refused_before_any_model_runs(demo_db_path, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    for output in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert run_cli("--db", demo_db_path, "--model", "nonsense-is-never-opened", "--output", output) == 1
        err = capsys.readouterr().err
        assert f"--output {output}: {tmp_path / 'afile'} is a file; give a folder" in err and "Traceback" not in err


def test_failed_rollouts_count_as_wrong_and_a_model_that_always_fails_exits_nonzero(demo_db_path, demo_questions,
                                                                                    tmp_path, capsys):
    half = {q.question: expert_script(q) for q in demo_questions[:3]}
    half.update({q.question: [{"status": 400}] for q in demo_questions[3:]})  # 400: not retried, fast
    scripts = {"half": half, "broken": {"*": [{"status": 400}]}}
    with serve_in_thread(scripts) as server:
        rc = run_cli("--db", demo_db_path, "--model", "hosted_vllm/half", "--model", "hosted_vllm/broken",
                     "--base-url", server.base_url, "--limit", 6, "--output", tmp_path, "--art-dir", tmp_path / "art")
    err = capsys.readouterr().err
    assert rc == 1 and "every rollout of hosted_vllm/broken failed" in err and "BadRequestError" in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    half_s = summary["models"]["hosted_vllm/half"]
    assert (half_s["n"], half_s["n_errors"], half_s["accuracy"], half_s["accuracy_scored"]) == (6, 3, 0.5, 1.0)
    assert summary["models"]["hosted_vllm/broken"]["accuracy"] == 0.0
    assert "| hosted_vllm/half | 6 | 3 | 50.0%" in (tmp_path / "report.md").read_text()


def test_partial_failures_alone_exit_zero(demo_db_path, demo_questions, tmp_path):
    scripts = {q.question: expert_script(q) for q in demo_questions[:5]}
    scripts[demo_questions[5].question] = [{"status": 400}]
    with serve_in_thread(scripts) as server:
        assert run_cli("--db", demo_db_path, "--model", "hosted_vllm/x", "--base-url", server.base_url,
                       "--limit", 6, "--output", tmp_path, "--art-dir", tmp_path / "art") == 0
    s = json.loads((tmp_path / "summary.json").read_text())["models"]["hosted_vllm/x"]
    assert (s["n_errors"], s["accuracy"]) == (1, pytest.approx(5 / 6))


# ---- a run is served by the backend it was trained on, with the limits it was trained with ------------

GPU_LIMITS = {"max_turns": 4, "max_tokens": 64, "max_body_chars": 600, "search_results": 3}


def make_gpu_run(art_dir, name="gpu"):
    run = art_dir / "email-agent" / "models" / name
    for step in (1, 2):
        (run / "checkpoints" / f"{step:04d}").mkdir(parents=True)
    config = {"name": name, "backend": "local", "base_model": "Qwen/Qwen2.5-7B-Instruct", "lora_rank": 8,
              "lora_alpha": 16, "max_seq_length": 4096, "gpu_memory_utilization": 0.6, "enforce_eager": True,
              "max_num_seqs": 16, "episode": GPU_LIMITS, **GPU_LIMITS}
    (run / "run_config.json").write_text(json.dumps(config))
    (run / "history.jsonl").write_text(json.dumps({"step": 2, "val/reward": 0.5}) + "\n")
    return run


def test_a_gpu_run_is_served_by_art_at_the_requested_step(demo_db_path, demo_questions, tmp_path, monkeypatch):
    run = make_gpu_run(tmp_path / "art")
    scripts = {q.question: expert_script(q) for q in demo_questions[:2]}
    monkeypatch.setenv("WANDB_API_KEY", "wandb-test-key")
    with on_a_gpu_machine(monkeypatch, scripts) as (made, server, wandb_runs):
        rc = run_cli("--db", demo_db_path, "--model", "gpu@1", "--model", "hosted_vllm/expert", "--base-url",
                     server.base_url, "--limit", 2, "--output", tmp_path / "out", "--art-dir", tmp_path / "art",
                     "--concurrency", 3)
        requests, adapters = list(server.requests), list(server.adapters)
    assert rc == 0 and wandb_runs == []  # serving a run starts no W&B run
    (backend,) = made
    assert backend.closed and backend._path == str(tmp_path / "art")
    (service,) = GPUService.made
    assert service.config["engine_args"]["gpu_memory_utilization"] == 0.6  # the run's own settings, through ART
    assert service.config["init_args"]["max_seq_length"] == 4096
    # Step 1 is not the latest (2): its LoRA is loaded into vLLM by name, as ART does after a training step.
    assert adapters == [{"lora_name": "gpu@1", "lora_path": str((run / "checkpoints" / "0001").resolve()),
                         "load_inplace": True}]
    trained = [r for r in requests if r["model"] == "gpu@1" and r["messages"][0]["role"] == "system"]
    prompted = [r for r in requests if r["model"] == "expert" and r["messages"][0]["role"] == "system"]
    assert trained and all(r["max_completion_tokens"] == 64 and "tool_choice" not in r for r in trained)
    # The prompted model plays with the run's limits too (like for like), with tool_choice required.
    assert prompted and all(r["max_completion_tokens"] == 64 and r["tool_choice"] == "required" for r in prompted)
    assert "up to 4 turns" in trained[0]["messages"][0]["content"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["models"]["gpu@1"]["episode"] == GPU_LIMITS and summary["models"]["gpu@1"]["backend"] == "local"
    assert summary["models"]["gpu@1"]["tool_choice"] == "auto"
    assert summary["models"]["gpu@1"]["concurrency"] == summary["models"]["hosted_vllm/expert"]["concurrency"] == 3
    assert summary["models"]["hosted_vllm/expert"]["tool_choice"] == "required"
    assert [(p["a"], p["b"]) for p in summary["pairs"]] == [("gpu@1", "hosted_vllm/expert")]


def test_two_steps_of_one_gpu_run_share_one_backend(demo_db_path, demo_questions, tmp_path, monkeypatch):
    """Each ART backend starts a trainer and a vLLM on the GPU: two steps of one run must not start two."""
    make_gpu_run(tmp_path / "art")
    with on_a_gpu_machine(monkeypatch, {q.question: expert_script(q) for q in demo_questions[:2]}) as (made, server, _):
        rc = run_cli("--db", demo_db_path, "--model", "gpu@1", "--model", "gpu", "--limit", 2,
                     "--output", tmp_path / "out", "--art-dir", tmp_path / "art")
        requests, adapters = list(server.requests), list(server.adapters)
    assert rc == 0
    assert len(made) == 1 and len(GPUService.made) == 1
    assert [a["lora_name"] for a in adapters] == ["gpu@1"]
    assert {r["model"] for r in requests if r.get("tools")} == {"gpu@1", "gpu@2"}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert sorted(summary["models"]) == ["gpu@1", "gpu@2"] and summary["models"]["gpu@2"]["n"] == 2


def test_flags_override_the_run_limits_and_the_latest_step_needs_no_adapter_load(demo_db_path, demo_questions,
                                                                               tmp_path, monkeypatch):
    make_gpu_run(tmp_path / "art")
    with on_a_gpu_machine(monkeypatch, {q.question: expert_script(q) for q in demo_questions[:1]}) as (_, server, _):
        assert run_cli("--db", demo_db_path, "--model", "gpu@latest", "--max-tokens", 99, "--limit", 1,
                       "--output", tmp_path / "out", "--art-dir", tmp_path / "art") == 0
        assert server.adapters == []
        assert {r["max_completion_tokens"] for r in server.requests if r.get("tools")} == {99}
    record = json.loads((tmp_path / "out" / "results.jsonl").read_text())
    assert record["model"] == "gpu@2" and record["episode"] == {**GPU_LIMITS, "max_tokens": 99}


def test_a_gpu_run_without_a_gpu_says_what_is_missing_and_the_alternative(demo_db_path, tmp_path, capsys,
                                                                         monkeypatch):
    from email_agent import backends

    run = make_gpu_run(tmp_path / "art")
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    assert run_cli("--db", demo_db_path, "--model", "gpu", "--output", tmp_path / "out",
                   "--art-dir", tmp_path / "art") == 1
    err = capsys.readouterr().err
    assert "trained on the local backend" in err and "needs a CUDA GPU" in err and "Traceback" not in err
    assert f"--lora-modules gpu={run / 'checkpoints' / '0002'}" in err and "--model hosted_vllm/gpu" in err
    assert not (tmp_path / "out").exists()


def test_a_cpu_checkpoint_emptied_by_hand_names_the_others(demo_db_path, tmp_path, capsys):
    run = make_gpu_run(tmp_path / "art", name="cpu")
    config = json.loads((run / "run_config.json").read_text())
    (run / "run_config.json").write_text(json.dumps({**config, "backend": "cpu", "base_model": "smollm2"}))
    assert run_cli("--db", demo_db_path, "--model", "cpu@latest", "--art-dir", tmp_path / "art",
                   "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert f"Could not load the LoRA checkpoint {run / 'checkpoints' / '0002'}" in err and "Traceback" not in err
    assert "The run's other checkpoints: 1 (--model cpu@1)." in err and not (tmp_path / "out").exists()


def test_a_damaged_run_config_is_one_error_and_does_not_hide_the_other_runs(tmp_path, caplog):
    make_gpu_run(tmp_path / "art", name="good")
    bad = make_gpu_run(tmp_path / "art", name="bad")
    config = json.loads((bad / "run_config.json").read_text())
    mistyped = [{**config, "base_model": 7}, {**config, "episode": [4]}, {**config, "episode": {"max_turns": "4"}},
                {**config, "episode": None, "max_tokens": 0}, {**config, "lora_rank": 8.5}]
    for content in (b"{not json", b"[1]", b"\xff\xfe", *(json.dumps(c).encode() for c in mistyped)):
        (bad / "run_config.json").write_bytes(content)
        with pytest.raises(UserError, match="run_config.json is damaged"):
            runs.Run.load(bad)
        assert [run.name for run in runs.list_runs(str(tmp_path / "art"))] == ["good"]
    assert "skipping a run" in caplog.text


@pytest.mark.parametrize("spec, message", [("gpu@\u00b2", "a step is a number or 'latest'"),
                                           ("base@3", "'base' is the untrained model; it has no steps")])
def test_steps_that_are_not_steps_are_refused(demo_db_path, tmp_path, capsys, spec, message):
    make_gpu_run(tmp_path / "art")
    assert run_cli("--db", demo_db_path, "--model", spec, "--art-dir", tmp_path / "art",
                   "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("specs, message", [(["tiny", "tiny@2"], "--model: tiny@2 is given twice (tiny and tiny@2)"),
                                            (["base", "tiny@"], "--model tiny@: give a step after '@'"),
                                            (["base", "tiny@5"], "has no checkpoint '5'; it has 1, 2")])
def test_model_specs_are_checked_before_any_model_is_served(demo_db_path, tmp_path, capsys, monkeypatch, specs,
                                                            message):
    run = make_gpu_run(tmp_path / "art", name="tiny")
    config = json.loads((run / "run_config.json").read_text())
    (run / "run_config.json").write_text(json.dumps({**config, "backend": "cpu"}))

    async def no_serving(*args, **kwargs):
        raise AssertionError("a model was served")

    monkeypatch.setattr(servers.Servers, "on_cpu", no_serving)
    argv = [arg for spec in specs for arg in ("--model", spec)]
    assert run_cli("--db", demo_db_path, *argv, "--art-dir", tmp_path / "art", "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_output_in_a_training_runs_folder_is_refused(demo_db_path, tmp_path, capsys):
    run = make_gpu_run(tmp_path / "art")
    assert run_cli("--db", demo_db_path, "--model", "base", "--output", run) == 1
    assert "is a training run's folder" in capsys.readouterr().err and run.is_dir()
    assert run_cli("--db", demo_db_path, "--model", "base", "--output", run / "checkpoints" / "eval") == 1
    assert "is in a training run's folder" in capsys.readouterr().err
    assert not (run / "checkpoints" / "eval").exists()
    # a project folder that merely has a checkpoints/ folder is no run
    (tmp_path / "project" / "checkpoints").mkdir(parents=True)
    report.check_output(tmp_path / "project" / "eval")
    report.check_output(tmp_path / "project")


def test_remote_runs_go_to_their_backend_and_need_its_key(demo_db_path, tmp_path, capsys, monkeypatch):
    run = make_gpu_run(tmp_path / "art", name="remote")
    config = json.loads((run / "run_config.json").read_text())
    for backend, key in (("serverless", "WANDB_API_KEY"), ("tinker", "TINKER_API_KEY")):
        (run / "run_config.json").write_text(json.dumps({**config, "backend": backend}))
        monkeypatch.delenv(key, raising=False)
        assert run_cli("--db", demo_db_path, "--model", "remote", "--art-dir", tmp_path / "art",
                       "--output", tmp_path / "out") == 1
        err = capsys.readouterr().err
        assert f"trained on the {backend} backend" in err and key in err and "Traceback" not in err


def test_no_model_evaluates_the_most_recent_run(demo_db_path, demo_questions, tmp_path, monkeypatch, capsys):
    assert run_cli("--db", demo_db_path, "--art-dir", tmp_path / "empty", "--output", tmp_path / "none") == 1
    assert "no trained run under" in capsys.readouterr().err
    make_gpu_run(tmp_path / "art", name="older")
    time.sleep(0.05)
    make_gpu_run(tmp_path / "art", name="newer")
    config = json.loads((tmp_path / "art" / "email-agent" / "models" / "newer" / "run_config.json").read_text())
    (tmp_path / "art" / "email-agent" / "models" / "newer" / "run_config.json").write_text(
        json.dumps({**config, "db": str(demo_db_path)}))
    with on_a_gpu_machine(monkeypatch, {q.question: expert_script(q) for q in demo_questions[:1]}):
        # no --db either: the run's own database
        assert run_cli("--limit", 1, "--output", tmp_path / "out", "--art-dir", tmp_path / "art") == 0
    assert json.loads((tmp_path / "out" / "results.jsonl").read_text())["model"] == "newer@2"
    # the run's database moved away: said, not replaced by the default one
    (tmp_path / "art" / "email-agent" / "models" / "newer" / "run_config.json").write_text(
        json.dumps({**config, "db": str(tmp_path / "gone.db")}))
    assert run_cli("--limit", 1, "--output", tmp_path / "out2", "--art-dir", tmp_path / "art") == 1
    assert f"run 'newer' was trained on the database {tmp_path / 'gone.db'}, which is not there" in (
        capsys.readouterr().err)


def test_wandb_traces_rollouts_and_judge_with_weave(demo_db_path, demo_questions, tmp_path, monkeypatch):
    import weave
    from weave.trace.op import is_op

    from email_agent import tracing

    inits, wrapped = [], []
    monkeypatch.setattr(weave, "init", lambda project, **kw: inits.append(project))
    real = tracing.traced_rollout
    monkeypatch.setattr(tracing, "traced_rollout",
                        lambda project, rollout, judge=None: (wrapped.append(real(project, rollout, judge))
                                                              or wrapped[-1]))
    with serve_in_thread({"x": {demo_questions[0].question: expert_script(demo_questions[0])}}) as server:
        assert run_cli("--db", demo_db_path, "--model", "hosted_vllm/x", "--base-url", server.base_url, "--limit", 1,
                       "--wandb", "--project", "my-proj", "--output", tmp_path, "--art-dir", tmp_path / "art") == 0
    assert inits == ["my-proj"] and len(wrapped) == 1 and is_op(wrapped[0])
    assert json.loads((tmp_path / "results.jsonl").read_text())["metrics"]["answer_correct"] == 1


def test_traced_rollout_wraps_the_judge_and_never_requires_weave(monkeypatch):
    import weave
    from weave.trace.op import is_op

    from email_agent.agent.llm_judge import LLMJudge
    from email_agent.agent.rollout import rollout
    from email_agent.tracing import traced_rollout

    judge = LLMJudge("openai/judge")
    monkeypatch.setattr(weave, "init", lambda project, **kw: None)
    assert is_op(traced_rollout("p", rollout, judge)) and is_op(judge.verdict)

    def no_weave(project, **kw):
        raise RuntimeError("no WANDB_API_KEY")
    monkeypatch.setattr(weave, "init", no_weave)
    assert traced_rollout("p", rollout) is rollout  # tracing is a nicety: off, and the run goes on


def test_a_crashing_rollout_keeps_the_finished_ones(demo_db_path, demo_questions, tmp_path, monkeypatch):
    import asyncio

    import email_agent.agent.rollout

    real_rollout = email_agent.agent.rollout.rollout
    crash_on = demo_questions[1].question

    async def buggy_rollout(policy, question, db, config):
        if question.question == crash_on:
            await asyncio.sleep(3)  # after the other rollout has finished
            raise RuntimeError("a bug in our own code")
        return await real_rollout(policy, question, db, config)

    monkeypatch.setattr(email_agent.agent.rollout, "rollout", buggy_rollout)
    scripts = {"expert": {q.question: expert_script(q) for q in demo_questions[:2]}}
    with serve_in_thread(scripts) as server:
        with pytest.raises(RuntimeError, match="a bug in our own code"):  # surfaces: it is a bug, not a failure
            run_cli("--db", demo_db_path, "--model", "hosted_vllm/expert", "--base-url", server.base_url,
                    "--limit", 2, "--concurrency", 1, "--output", tmp_path / "out", "--art-dir", tmp_path / "art")
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["question"] for r in records] == [demo_questions[0].question]
    assert (tmp_path / "out" / "report.html").exists()  # the finished rollout is reported


def test_rejudge_of_a_folder_without_results_is_a_clear_error(tmp_path, capsys):
    assert run_cli("--rejudge", tmp_path / "nothing-here", "--output", tmp_path / "out") == 1
    assert "no results.jsonl there" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "results.jsonl").write_text("")
    assert run_cli("--rejudge", tmp_path / "empty", "--output", tmp_path / "out") == 1
    assert "holds no results to re-score" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_ctrl_c_while_the_servers_close_says_where_the_report_is(demo_db_path, demo_questions, tmp_path):
    """Catches "interrupted: nothing written" said after the report was written (a second Ctrl-C while the
    models' servers shut down)."""
    out = tmp_path / "out"
    # the evaluation as a user runs it, with a Ctrl-C arriving once the servers' shutdown has begun
    script = f"""
import asyncio, contextlib, os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
import test_email_search_agent
real_exit = contextlib.AsyncExitStack.__aexit__
async def interrupted_exit(self, *exc):
    await real_exit(self, *exc)
    if os.path.exists({str(out / "report.html")!r}):
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(10)
contextlib.AsyncExitStack.__aexit__ = interrupted_exit
sys.exit(test_email_search_agent.main(sys.argv[1:]))
"""
    q = demo_questions[0]
    with serve_in_thread({q.question: expert_script(q)}) as server:
        proc = subprocess.run([sys.executable, "-c", script, "--db", str(demo_db_path), "--model", "hosted_vllm/x",
                               "--base-url", server.base_url, "--limit", "1", "--output", str(out),
                               "--art-dir", str(tmp_path / "art")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert f"interrupted: the report is in {out}" in proc.stderr and "Traceback" not in proc.stderr


def test_base_beside_a_gpu_run_points_to_its_first_checkpoint(demo_db_path, tmp_path, capsys):
    """`base` is the CPU path's SmolLM2 (served by .venv-vllm, which a GPU venv lacks): beside a GPU run the user
    is told the run's own untrained model, RUN@0, before anything is served."""
    make_gpu_run(tmp_path / "art")
    rc = run_cli("--db", demo_db_path, "--model", "base", "--model", "gpu", "--limit", 2,
                 "--output", tmp_path / "out", "--art-dir", tmp_path / "art")
    err = capsys.readouterr().err
    assert rc == 1 and "--model gpu@0" in err and "Qwen/Qwen2.5-7B-Instruct" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_base_without_the_cpu_vllm_says_what_base_is(demo_db_path, tmp_path, capsys, monkeypatch):
    """A GPU venv has no .venv-vllm: `--model base` there says why it cannot be served and what to type instead."""
    monkeypatch.setenv("EMAIL_AGENT_VLLM_PYTHON", str(tmp_path / "no-vllm" / "python"))
    monkeypatch.delenv("EMAIL_AGENT_VLLM_URL", raising=False)  # the session's shared server would serve it
    rc = run_cli("--db", demo_db_path, "--model", "base", "--limit", 2, "--output", tmp_path / "out",
                 "--art-dir", tmp_path / "art")
    err = capsys.readouterr().err
    assert rc == 1 and "vLLM is not installed" in err and "--model RUN@0" in err and "Traceback" not in err
