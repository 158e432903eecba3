"""The episodes the warm start imitates (`--sft-from`), before RL: successful trajectories, supervised on their
assistant turns by `training.warm_start`.

A small model that never emits a valid tool call gives every rollout the same reward, so GRPO has no
advantage to learn from. Supervised fine-tuning on good episodes first fixes that. Sources:

  expert        the scripted expert (`expert`) plays the train questions through the real rollout code:
                its successful episodes, plus abstentions (episodes that end in "I don't know" because
                the search really failed: the expert's own failures, and questions replayed the day
                before their gold email was sent, so the inbox cannot hold the answer). Any question set
                whose questions cite their emails: the demo's, ART·E's, generate-questions', your own.
  demo-expert   the same expert searching the question's names first (the demo preset's warm start,
                unchanged since it knew only the demo inbox); `expert` searches its rarest words first
  <folder>      an evaluation folder from test_email_search_agent.py (e.g. a prompted o4-mini on the
                train split): its judged-correct, correctly-cited episodes

Test-split questions are never used, whatever the source says. `train` gathers them among its start-up checks
(a teacher folder with nothing to learn from is refused before a model loads).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import art

from email_agent.errors import UserError
from email_agent.data.email_db import EmailDB
from email_agent.agent.expert import Ceiling, ExpertPolicy
from email_agent.data.questions import Question, withheld
from email_agent.agent.episode import PROMPT_LIMITS, Episode
from email_agent.agent.rollout import rollout
from email_agent.agent.tools import TOOLS
from email_agent.results_file import read_results

EXPERT_NAMES = ("expert", "demo-expert")  # the scripted expert; demo-expert searches the question's names first

logger = logging.getLogger(__name__)


def successful(traj: art.Trajectory) -> bool:
    m = traj.metrics
    return bool(m["answer_correct"] and m["sources_correct"] and not m["api_errors"])


def abstained(traj: art.Trajectory) -> bool:
    """Ended in "I don't know" without having seen the gold email: the search really failed."""
    m = traj.metrics
    return bool(m["returned_i_dont_know"] and not m["ever_found_right_email"] and not m["api_errors"]
                and not (m["bad_tool_args"] or m["bad_tool_name"] or m["parse_errors"]))


async def expert_trajectories(db: EmailDB, questions: list[Question], episode: Episode,
                              abstain_share: float = 0.25, seed: int = 0, rarest_first: bool = True
                              ) -> list[art.Trajectory]:
    """The expert's episodes on `questions` (train split only), shuffled so that any prefix keeps the mix.

    Successful episodes, plus abstentions making up about `abstain_share` of the result: the expert's own
    "I don't know"s where its search failed, topped up with withheld-gold replays of other questions.
    An agent that only ever saw answers learns to invent one when the search fails.
    """
    questions = [q for q in questions if q.split != "test"]
    policy = ExpertPolicy(questions, db, max_turns=episode.max_turns, rarest_first=rarest_first)
    trajs = [await rollout(policy, q, db, episode) for q in questions]
    logger.info("expert on the %d train questions, in %d turns: %s", len(questions), episode.max_turns,
                Ceiling.of(trajs).describe())
    solved = [t for t in trajs if successful(t)]
    abstentions = [t for t in trajs if abstained(t)]
    wanted = round(abstain_share / (1 - abstain_share) * len(solved))  # abstentions / (solved + abstentions) = share
    solved_ids = {t.metadata["question_id"] for t in solved}
    for q in questions:  # only solvable questions are replayed: their gold email is known to be findable otherwise
        if len(abstentions) >= wanted:
            break
        replay = withheld(q, db) if q.id in solved_ids else None
        if replay is not None:
            traj = await rollout(policy, replay, db, episode)
            if abstained(traj):
                traj.metadata["withheld_gold"] = True
                abstentions.append(traj)
    mixed = solved + abstentions[:wanted]
    random.Random(seed).shuffle(mixed)
    return mixed


def teacher_trajectories(folder: str | Path, db: EmailDB, episode: Episode | None = None,
                         held_out: list[Question] = ()) -> list[art.Trajectory]:
    """Judged-correct, correctly cited episodes from an evaluation folder's results.jsonl, never of the test
    split nor of the `held_out` questions (those training validates on).

    With `episode`, warns when the teacher played with other episode limits than the ones being trained: its system
    prompt names another number of turns and its tool replies are longer or shorter than the student's will be.
    """
    path = Path(folder) / "results.jsonl"
    if not path.is_file():
        raise UserError(f"--sft-from {folder}: no results.jsonl there (an output folder of test_email_search_agent.py)")
    test_ids = {row[0] for row in db.conn.execute("SELECT id FROM questions WHERE split = 'test'")}
    records, unreadable = read_results(path, keys=("model", "question_id", "messages", "metrics", "reward"))
    if unreadable:
        logger.warning("--sft-from %s: %d unreadable line(s) in results.jsonl skipped", folder, unreadable)
    if not records:
        raise UserError(f"--sft-from {folder}: results.jsonl holds no episodes (is it an evaluation's results?)")
    held_out_ids = {q.id for q in held_out}
    trajs, played_limits, skipped = [], set(), 0
    for record in records:
        played = record.get("episode") or {}
        played_limits.add(tuple(played.get(key) for key in PROMPT_LIMITS))
        m = record.get("metrics") or {}
        if record.get("error") or record["question_id"] in test_ids or not (m.get("answer_correct")
                                                                              and m.get("sources_correct")):
            continue
        if record["question_id"] in held_out_ids:
            skipped += 1
            continue
        messages = [strip_to_chat(message) for message in record["messages"]]
        trajs.append(art.Trajectory(messages_and_choices=messages, tools=TOOLS, reward=record["reward"],
                                    metrics={k: v for k, v in m.items() if isinstance(v, (int, float))},
                                    metadata={"question_id": record["question_id"], "teacher": record["model"]}))
    if skipped:
        logger.info("--sft-from %s: %d episode(s) of the questions this run validates on left out of the warm "
                    "start", folder, skipped)
    if episode is not None:
        wanted = tuple(getattr(episode, key) for key in PROMPT_LIMITS)
        other = sorted({limits for limits in played_limits if None not in limits and limits != wanted})
        if other:
            limits_played = "; ".join(", ".join(f"{k} {v}" for k, v in zip(PROMPT_LIMITS, limits)) for limits in other)
            logger.warning("--sft-from %s: the teacher played %s, this run trains with %s: evaluate the teacher "
                           "with the same --max-turns, --max-body-chars and --search-results as `train`, or the "
                           "warm start teaches from prompts and tool replies the agent will not see", folder,
                           limits_played,
                           ", ".join(f"{k} {v}" for k, v in zip(PROMPT_LIMITS, wanted)))
    return trajs


def strip_to_chat(message: dict) -> dict:
    """Keep only what a chat template renders (providers add refusal/annotations/reasoning fields)."""
    keep = {k: message[k] for k in ("role", "content", "tool_calls", "tool_call_id") if message.get(k) is not None}
    if "tool_calls" in keep:
        keep["tool_calls"] = [{"id": c.get("id"), "type": "function",
                               "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                              for c in keep["tool_calls"]]
    if keep["role"] == "assistant" and "content" not in keep:
        keep["content"] = ""
    return keep


def sft_source(source: str, db: EmailDB, questions: list[Question], episode: Episode,
               held_out: list[Question] = ()):
    """`--sft-from` -> an awaitable of trajectories: the expert plays `questions`; a teacher's episodes are
    whatever it played, less the `held_out` questions."""
    if source in EXPERT_NAMES:  # demo-expert searches the question's names first, as the demo's warm start always has
        return expert_trajectories(db, questions, episode, rarest_first=source == "expert")
    if Path(source).expanduser().is_dir():
        async def load():
            return teacher_trajectories(Path(source).expanduser(), db, episode, held_out)
        return load()
    raise UserError(f"--sft-from {source!r}: expected 'expert' or an evaluation folder with results.jsonl")


async def warm_start_episodes(source: str, limit: int, db: EmailDB, train_questions: list[Question],
                              val_questions: list[Question], episode: Episode) -> list[art.Trajectory]:
    """The trajectories the warm start imitates (`--sft-from source`, the first `limit` of them; 0: all): the
    expert's on the train questions, or a teacher's judged-correct ones (none of the validation questions: the
    curve would score what it imitated)."""
    trajectories = await sft_source(source, db, train_questions, episode, held_out=val_questions)
    if limit:
        trajectories = trajectories[:limit]
    if not trajectories:
        raise UserError(f"--sft-from {source}: no successful trajectories to learn from.")
    return trajectories
