"""Evaluation's records: what one question x model leaves in results.jsonl, and that record graded again.

Owns `make_record` (one line of results.jsonl: enough to report, re-judge and warm-start from without playing
again; `scores` checks and reads it, `report` and the warm start use it), its price (`cost_usd`), re-judging an
earlier evaluation's records (`--rejudge`) and the episode that says how an evaluation grades (`scoring_episode`).
It serves and plays nothing (see `opened`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from email_agent.agent import grading
from email_agent.agent.episode import Episode
from email_agent.data.questions import Question
from email_agent.errors import UserError
from email_agent.results_file import read_results

log = logging.getLogger(__name__)


def scoring_episode(reward: str | None, judge_model: str | None, judge_base_url: str | None, art_dir: str,
                    grounded_answers: bool = False) -> Episode:
    """An Episode carrying how answers are graded and whether ungrounded ones are withheld (each opened model
    plays it with its own limits: `OpenedModel.episode`)."""
    mode, judge = grading.configure(reward, judge_model, judge_base_url, art_dir)
    if mode == "ruler":  # RULER ranks groups during training; an evaluation grades each answer on its own
        mode = "shaped" if judge else "offline"
    return Episode(reward=mode, judge=judge, grounded_answers=grounded_answers)


def cost_usd(price_model: str | None, prompt_tokens: int, completion_tokens: int) -> float | None:
    if price_model is None:
        return None
    # here, not at the top: litellm takes ~1.5 s to import (openai, pydantic), and --help loads this module
    import litellm

    try:
        prompt_cost, completion_cost = litellm.cost_per_token(model=price_model, prompt_tokens=prompt_tokens,
                                                              completion_tokens=completion_tokens)
    except Exception:  # litellm raises for models it has no price for
        return None
    return prompt_cost + completion_cost


def grader_of(judge: str | None) -> str | None:
    """Who decided a verdict: the offline matcher by name (this version's), the judge model, or "rule" ("I don't
    know" is wrong by rule)."""
    return grading.GRADER if judge == "offline" else judge


def make_record(opened_model, question: Question, traj, episode: Episode) -> dict:
    """One line of results.jsonl for `opened_model` (a `models.opened.OpenedModel`) having played `episode`: enough to
    report, re-judge and warm-start from without re-running."""
    m, meta = traj.metrics, traj.metadata
    verdict = None
    if meta.get("answer") is not None:
        verdict = {"correct": bool(m["answer_correct"]), "judge": meta.get("verdict_judge"),
                   "reasoning": meta.get(grading.VERDICT_REASONING), "error": meta.get(grading.VERDICT_ERROR),
                   "grader": grader_of(meta.get("verdict_judge"))}
    return {"model": opened_model.label, "question_id": question.id, "question": question.question,
            "gold_answer": question.answer, "gold_message_ids": question.message_ids, "inbox": question.inbox_address,
            "query_date": question.query_date, "answer": meta.get("answer"), "sources": json.loads(meta["sources"]),
            "withheld": json.loads(meta["withheld"]) if meta.get("withheld") else None,
            "grounded_answers": episode.grounded_answers,
            "reward": traj.reward, "reward_mode": episode.reward, "max_turns": episode.max_turns, "verdict": verdict,
            "episode": opened_model.limits.limits(), "tool_choice": opened_model.tool_choice,
            "backend": opened_model.backend,
            "concurrency": opened_model.policy.max_concurrency,
            "metrics": dict(m),
            "cost_usd": cost_usd(opened_model.price_model, m["prompt_tokens"], m["completion_tokens"]),
            "error": meta.get("error"), "messages": traj.messages()}


async def rejudge_folder(folder: Path, episode: Episode, grounded_answers: bool) -> list[dict]:
    """Every answer of an earlier evaluation (its results.jsonl) scored again with `episode`'s judge, without
    playing the episodes again."""
    results = folder / "results.jsonl"
    if not results.is_file():
        raise UserError(f"--rejudge {folder}: no results.jsonl there (an output folder of this command).")
    stored, torn = read_results(results)
    if torn:
        log.warning("note: %d unreadable line(s) in %s skipped", torn, results)
    if not stored:
        raise UserError(f"--rejudge {folder}: results.jsonl holds no results to re-score.")
    unique = {}
    for record in stored:  # two files joined by hand would count each question twice
        unique.setdefault((record["model"], str(record["question_id"])), record)
    if len(unique) < len(stored):
        log.warning("note: %d repeated answer(s) (same model and question) in %s skipped", len(stored) - len(unique),
                    results)
    if any(bool(r.get("grounded_answers")) != grounded_answers for r in unique.values()):
        log.warning("note: re-scoring %s the grounding check (--grounded-answers), unlike the evaluation in %s",
                    "with" if grounded_answers else "without", folder)
    return [await rejudge_record(r, episode) for r in tqdm(list(unique.values()), desc="re-judging", unit=" answers")]


async def rejudge_record(record: dict, episode: Episode) -> dict:
    """Re-score a stored record with another judge: the agent's answer stays, the verdict and reward change.
    An answer the grounding check withheld is judged as the agent gave it, and withheld again only if `episode`
    asks for the check (so `--rejudge DIR --grounded-answers` applies it to an evaluation made without)."""
    question = Question(record["question_id"], record["question"], record["gold_answer"], record["gold_message_ids"],
                        None, record["inbox"], record["query_date"], "")
    rubric, graded = await grading.regrade(record["metrics"], question, record["answer"], record["sources"],
                                           record.get("withheld"), record["messages"], episode,
                                           record.get("max_turns", episode.max_turns))
    verdict = graded.verdict
    new = dict(record, answer=graded.answer, sources=graded.sources, withheld=graded.withheld,
               grounded_answers=episode.grounded_answers, metrics={**record["metrics"], **asdict(rubric)},
               reward=graded.reward, reward_mode=episode.reward)
    new["verdict"] = None if verdict is None else {"correct": verdict.correct, "judge": verdict.judge,
                                                   "reasoning": verdict.reasoning, "error": verdict.error,
                                                   "grader": grader_of(verdict.judge)}
    return new
