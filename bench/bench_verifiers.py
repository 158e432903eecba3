"""Does verifiers' own evaluation CLI agree with this project's? (a script that prints figures; not a test)

One CPU vLLM server is started the way the evaluation starts it (email_agent.models.servers: the run's base
model, its checkpoint loaded as a LoRA named RUN@STEP) and both harnesses play against it, with greedy decoding,
the run's episode limits, the grounding check as `make demo` evaluates, on the same questions:

  project    test_email_search_agent.py --model RUN@STEP --limit N --grounded-answers   (EMAIL_AGENT_VLLM_URL=server)
  verifiers  vf-eval email-inbox -m RUN@STEP -n N --sampling.temperature 0 --env.taskset.run RUN ... (.venv-verifiers)

Printed: each harness's accuracy (answer_correct), wrong answers, "I don't know", no answer, mean reward and
minutes; on how many questions the two gave the same verdict and the same replies; each question they differ on,
the turn where the replies first differ, and why when the harnesses' known differences explain it
(docs/verifiers.md). Everything is kept in --output (both harnesses' records, the server's log, summary.json).

    .venv/bin/python bench/bench_verifiers.py                         # make demo's run `demo`, 50 test questions
    .venv/bin/python bench/bench_verifiers.py --run demo@1 --questions 20

Needs .venv-verifiers (`make setup-verifiers`). The machine's load is printed: other jobs slow both harnesses alike
but not equally (they run one after the other).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from email_agent.agent.tools import TOOLS
from email_agent.errors import UserError
from email_agent.runs import find_run


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="demo", help="a trained run, RUN or RUN@STEP (default demo, its latest step)")
    p.add_argument("--questions", type=int, default=50, help="the first N test questions of the seeded order")
    p.add_argument("--concurrency", type=int, default=8, help="episodes in flight, in each harness")
    p.add_argument("--art-dir", default=".art")
    p.add_argument("--venv", default=str(ROOT / ".venv-verifiers"), help="the venv `make setup-verifiers` makes")
    p.add_argument("--output", default=None, help="default eval/verifiers-RUN")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(bench(args))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


async def bench(args) -> int:
    vf_eval = Path(args.venv) / "bin" / "vf-eval"
    if not vf_eval.exists():
        raise UserError(f"no verifiers venv at {args.venv}: make it with `make setup-verifiers`")
    name, _, step = args.run.partition("@")
    run = find_run(name, args.art_dir)
    if run is None:
        raise UserError(f"no trained run {name!r} under {args.art_dir}; `make demo` trains the run `demo`")
    number, checkpoint = run.checkpoint(step or "latest")
    label = f"{run.name}@{number}"
    out = Path(args.output or ROOT / "eval" / f"verifiers-{run.name}")
    out.mkdir(parents=True, exist_ok=True)
    db = run.config["db"]

    # here, not at the top: the CPU backend imports torch, transformers and ART (seconds)
    from email_agent.models import opened
    from email_agent.models.servers import Servers

    print(f"{label}: {checkpoint}\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    async with contextlib.AsyncExitStack() as stack:
        options = opened.Options(art_dir=args.art_dir, concurrency=args.concurrency, log_dir=str(out / "logs"))
        client, served = await Servers(options, stack).on_cpu(run.base_model, checkpoint, label,
                                                                lora_rank=run.config.get("lora_rank", 8))
        url = str(client.base_url).rstrip("/")
        print(f"vLLM at {url} serves the LoRA as {served!r}", flush=True)

        project_dir, verifiers_dir = out / "project", out / "verifiers"
        project_argv = [sys.executable, str(ROOT / "test_email_search_agent.py"), "--quiet", "--db", db,
                        "--art-dir", args.art_dir, "--model", label, "--limit", str(args.questions),
                        "--concurrency", str(args.concurrency), "--grounded-answers", "--output", str(project_dir)]
        verifiers_argv = [str(vf_eval), "email-inbox", "-m", served, "--client.base-url", url,
                          "--client.api-key-var", "EMAIL_AGENT_VLLM_KEY", "-n", str(args.questions),
                          "-c", str(args.concurrency), "--sampling.temperature", "0",
                          "--env.taskset.db", db, "--env.taskset.run", str(run.path),
                          "--env.taskset.task.grounded-answers", "true",
                          "--no-push", "--no-rich", "--clean", "-o", str(out), "--run.dir", "verifiers"]
        minutes = {}
        # verifiers first: the evaluation, on a server of EMAIL_AGENT_VLLM_URL, unloads the LoRA it loaded when it ends
        for harness, argv, env in (
                ("verifiers", verifiers_argv, {"PATH": f"{Path(args.venv) / 'bin'}{os.pathsep}{os.environ['PATH']}",
                                               "EMAIL_AGENT_VLLM_KEY": "local"}),
                ("project", project_argv, {"EMAIL_AGENT_VLLM_URL": url})):
            print(f"$ {' '.join(argv)}", flush=True)
            started = time.monotonic()
            with open(out / f"{harness}.log", "w") as log:
                done = subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
            minutes[harness] = (time.monotonic() - started) / 60
            if done.returncode != 0:
                raise UserError(f"{harness} exited with {done.returncode}; its output: {out / f'{harness}.log'}")

    project = read_project(project_dir / "results.jsonl")
    verifiers = read_verifiers(verifiers_dir / "traces.jsonl")
    summary = compare(project, verifiers, minutes)
    summary.update(run=label, checkpoint=str(checkpoint), questions=args.questions, concurrency=args.concurrency,
                   project_command=" ".join(project_argv), verifiers_command=" ".join(verifiers_argv))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"figures and both harnesses' records: {out}")
    return 0


# ----------------------------------------------------------------------------------------------
# Each harness's episodes, in one form: {question_id: {verdict fields, answer, replies, how it ended}}
# ----------------------------------------------------------------------------------------------

def replies(messages) -> list[tuple]:
    """The assistant replies as (text, ((tool, arguments), ...)), arguments parsed where they are JSON."""
    def parsed(arguments):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except (TypeError, ValueError):
            return arguments

    out = []
    for m in messages:
        if m.get("role") != "assistant":
            continue
        calls = tuple((c["function"]["name"], parsed(c["function"]["arguments"])) if "function" in c else
                      (c["name"], parsed(c["arguments"])) for c in m.get("tool_calls") or [])
        out.append(((m.get("content") or "").strip(), calls))
    return out


def read_project(path: Path) -> dict:
    episodes = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        m = r["metrics"]
        episodes[str(r["question_id"])] = {
            "correct": m["answer_correct"], "wrong": m["hallucinated"], "idk": m["returned_i_dont_know"],
            "answered": int(r["answer"] is not None), "reward": r["reward"], "answer": r["answer"],
            "replies": replies(r["messages"]), "prompt_tokens": m["prompt_tokens"],
            "ended": "out of turns" if m["ran_out_of_turns"] else
            ("answer" if r["answer"] is not None else (r.get("error") or "no answer"))}
    return episodes


def read_verifiers(path: Path) -> dict:
    episodes = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        trace = record["traces"][0]
        data, metrics = trace["task"]["data"], trace["metrics"] or {}
        graded = (trace.get("info") or {}).get("email_inbox", {}).get("graded", {})
        messages = [node["message"] for node in trace["nodes"]]
        reward = trace["rewards"].get("reward") or {}
        episodes[str(data["question_id"])] = {
            "correct": metrics.get("answer_correct"), "wrong": metrics.get("hallucinated"),
            "idk": metrics.get("returned_i_dont_know"), "answered": int(graded.get("answer") is not None),
            "reward": reward.get("score"), "answer": graded.get("answer"), "replies": replies(messages),
            # verifiers counts cache reads apart (Usage.from_openai); the project's count includes them
            "prompt_tokens": sum(c["usage"]["prompt_tokens"] + (c["usage"].get("cached_input_tokens") or 0)
                                 for c in trace["calls"] if c.get("usage")),
            "tools": [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                      for t in trace["tools"]],
            "ended": trace.get("stop_condition"), "errors": [e.get("message", "")[:200] for e in trace["errors"]]}
    return episodes


def compare(project: dict, verifiers: dict, minutes: dict) -> dict:
    ids = [qid for qid in project if qid in verifiers]
    summary = {"missing": {"project": sorted(set(verifiers) - set(project)),
                           "verifiers": sorted(set(project) - set(verifiers))}}
    print(f"\n{'harness':<10} {'questions':>9} {'right':>6} {'wrong':>6} {'IDK':>5} {'no answer':>9} "
          f"{'reward':>7} {'minutes':>8}")
    for harness, episodes in (("project", project), ("verifiers", verifiers)):
        rows = [episodes[qid] for qid in ids]
        figures = {key: sum(e[key] or 0 for e in rows) for key in ("correct", "wrong", "idk")}
        figures["no_answer"] = sum(1 - e["answered"] for e in rows)
        figures["mean_reward"] = sum(e["reward"] or 0 for e in rows) / len(rows) if rows else None
        figures["accuracy"] = figures["correct"] / len(rows) if rows else None
        figures["minutes"] = minutes.get(harness)
        summary[harness] = figures
        print(f"{harness:<10} {len(rows):>9} {figures['correct']:>6.0f} {figures['wrong']:>6.0f} "
              f"{figures['idk']:>5.0f} {figures['no_answer']:>9} {figures['mean_reward']:>7.3f} "
              f"{figures['minutes'] or 0:>8.1f}")
    same_verdict = [qid for qid in ids if project[qid]["correct"] == verifiers[qid]["correct"]]
    same_replies = [qid for qid in ids if project[qid]["replies"] == verifiers[qid]["replies"]]
    same_prompts = [qid for qid in same_replies if project[qid]["prompt_tokens"] == verifiers[qid]["prompt_tokens"]]
    tools_as_project = all(e["tools"] == TOOLS for e in verifiers.values())
    print(f"\nsame verdict on {len(same_verdict)}/{len(ids)} questions; the same replies, turn for turn, on "
          f"{len(same_replies)}/{len(ids)}, and of those the same prompt tokens (as the server counted them) on "
          f"{len(same_prompts)}/{len(same_replies)}; verifiers offered the project's tool schemas: {tools_as_project}")
    differences = []
    for qid in ids:
        p, v = project[qid], verifiers[qid]
        if p["replies"] == v["replies"]:
            continue
        turn = next((i for i, (a, b) in enumerate(zip(p["replies"], v["replies"])) if a != b),
                    min(len(p["replies"]), len(v["replies"])))
        why = explain(p, v, turn)
        differences.append({"question_id": qid, "turn": turn + 1, "why": why, "project": p["answer"],
                            "verifiers": v["answer"], "project_correct": p["correct"],
                            "verifiers_correct": v["correct"], "project_ended": p["ended"],
                            "verifiers_ended": v["ended"],
                            "project_reply": p["replies"][turn] if turn < len(p["replies"]) else None,
                            "verifiers_reply": v["replies"][turn] if turn < len(v["replies"]) else None})
        print(f"  q{qid}: replies differ from turn {turn + 1} ({why}); project {p['answer']!r} "
              f"[{'right' if p['correct'] else 'not right'}], verifiers {v['answer']!r} "
              f"[{'right' if v['correct'] else 'not right'}]")
    summary.update(same_verdict=len(same_verdict), same_replies=len(same_replies), same_prompt_tokens=len(same_prompts),
                   tools_as_project=tools_as_project, compared=len(ids),
                   differences=differences)
    return summary


def explain(p: dict, v: dict, turn: int) -> str:
    """Which known difference between the harnesses shows at `turn` (docs/verifiers.md), if any."""
    if turn >= len(v["replies"]) and turn < len(p["replies"]):
        last = v["replies"][-1] if v["replies"] else None
        if last is not None and not last[1]:
            return "a reply with no tool call ends verifiers' episode; the project tells the model to call a tool"
        return f"verifiers' episode ended ({v['ended']}) where the project's went on"
    if turn >= len(p["replies"]):
        return f"the project's episode ended ({p['ended']}) where verifiers' went on"
    if turn > 0 and not p["replies"][turn - 1][1]:
        return "after a reply with no tool call (the project's nudge)"
    return "a different reply to the same prompt (batch composition on the server, or the streaming tool-call parser)"


if __name__ == "__main__":
    sys.exit(main())
