"""Warm start: successful trajectories to fine-tune on before RL (supervised, on the assistant turns).

A small model that never emits a valid tool call gives every rollout the same reward, so GRPO has no
advantage to learn from. Supervised fine-tuning on good episodes first fixes that. Sources:

  demo-expert   a scripted expert plays the demo inbox's train questions through the real rollout code:
                its successful episodes, plus abstentions (episodes that end in "I don't know" because
                the search really failed: the expert's own failures, and questions replayed the day
                before their gold email was sent, so the inbox cannot hold the answer)
  <folder>      an evaluation folder from test_email_search_agent.py (e.g. a prompted o4-mini on the
                train split): its judged-correct, correctly-cited episodes

Test-split questions are never used, whatever the source says.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Callable

import art
from openai.types.chat import ChatCompletion

from .data import DataError, EmailDB
from .questions import Question, withheld
from .rollout import RolloutConfig, rollout
from .summary import read_results
from .tools import TOOLS

logger = logging.getLogger(__name__)

STOPWORDS = set("""a about after all am an and any are as at be been before being but by can could did do does
for from had has have how i if in into is it its me my of on or our should so than that the their them then
there these they this to up was we were what when where which who whom why will with would you your
time date day price cost much many number name get got set""".split())  # question words emails rarely contain


def question_keywords(text: str, limit: int = 2) -> list[str]:
    """Distinctive words of a question: capitalised names and codes first, then other content words."""
    words = [w.strip("?.,!:;'\"()") for w in text.split()]
    words = [w[:-2] if w.endswith("'s") else w for w in words]
    content = [w for w in words if len(w) > 2 and w.lower() not in STOPWORDS]
    named = [w for w in content[1:] if w[:1].isupper() or any(c.isdigit() for c in w)]
    ordered = named + [w for w in content if w not in named]
    return list(dict.fromkeys(ordered))[:limit]


class ExpertPolicy:
    """A scripted agent for the demo inbox, played through `rollout` like any model.

    It sees what a good agent sees (the question and the tool results) and knows the gold answer only to
    recognise the email that holds it and to phrase the final answer: search with the question's
    distinctive words (fewer if nothing matches), read results best-first, answer from the first email
    that holds the answer, else say "I don't know" -- at the latest on its last turn, so an episode it
    cannot solve ends in an abstention rather than running out of turns.
    """

    model = "demo-expert"

    def __init__(self, questions: list[Question], max_turns: int | None = None):
        self.answers = {q.question: q.answer for q in questions}
        self.max_turns = max_turns

    async def complete(self, messages: list[dict]) -> tuple[ChatCompletion, float]:
        return self._reply(messages), 0.0  # no model: no time spent

    def _reply(self, messages: list[dict]) -> ChatCompletion:
        question = next(m["content"] for m in messages if m["role"] == "user")
        answer = self.answers[question]
        last_turn = self.max_turns is not None and sum(m["role"] == "assistant" for m in messages) >= self.max_turns - 1
        keywords = question_keywords(question)
        searches = [json.loads(c["function"]["arguments"]) for m in messages if m["role"] == "assistant"
                    for c in m.get("tool_calls") or [] if c["function"]["name"] == "search_inbox"]
        tool_results = [m["content"] for m in messages if m["role"] == "tool"]
        last = tool_results[-1] if tool_results else None
        if last is not None and last.startswith("{"):  # an email was just read
            email = json.loads(last)
            if answer in email["body"]:
                return self._call("return_final_answer", {"answer": answer, "sources": [email["message_id"]]})
        if last_turn:
            return self._call("return_final_answer", {"answer": "I don't know", "sources": []})
        results = next((json.loads(r) for r in reversed(tool_results) if r.startswith("[")), None)
        if results is None:
            if searches and len(searches[-1]["keywords"]) == 1:
                return self._call("return_final_answer", {"answer": "I don't know", "sources": []})
            size = len(searches[-1]["keywords"]) - 1 if searches else len(keywords)
            return self._call("search_inbox", {"keywords": keywords[:size]})
        read = {json.loads(r)["message_id"] for r in tool_results if r.startswith("{")}
        unread = [r["message_id"] for r in results[:5] if r["message_id"] not in read]
        if unread:
            return self._call("read_email", {"message_id": unread[0]})
        return self._call("return_final_answer", {"answer": "I don't know", "sources": []})

    @staticmethod
    def _call(name: str, arguments: dict) -> ChatCompletion:
        return ChatCompletion.model_validate({
            "id": "expert", "object": "chat.completion", "created": 0, "model": "demo-expert",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
                "role": "assistant", "content": None,
                "tool_calls": [{"id": f"call_{name}", "type": "function",
                                "function": {"name": name, "arguments": json.dumps(arguments)}}]}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})


def successful(traj: art.Trajectory) -> bool:
    m = traj.metrics
    return bool(m["answer_correct"] and m["sources_correct"] and not m["api_errors"])


def abstained(traj: art.Trajectory) -> bool:
    """Ended in "I don't know" without having seen the gold email: the search really failed."""
    m = traj.metrics
    return bool(m["returned_i_dont_know"] and not m["ever_found_right_email"] and not m["api_errors"]
                and not (m["bad_tool_args"] or m["bad_tool_name"] or m["parse_errors"]))


async def expert_trajectories(db: EmailDB, questions: list[Question], config: RolloutConfig,
                              abstain_share: float = 0.25, seed: int = 0) -> list[art.Trajectory]:
    """The expert's episodes on `questions` (train split only), shuffled so that any prefix keeps the mix.

    Successful episodes, plus abstentions making up about `abstain_share` of the result: the expert's own
    "I don't know"s where its search failed, topped up with withheld-gold replays of other questions.
    An agent that only ever saw answers learns to invent one when the search fails.
    """
    questions = [q for q in questions if q.split != "test"]
    policy = ExpertPolicy(questions, max_turns=config.max_turns)
    trajs = [await rollout(policy, q, db, config) for q in questions]
    solved = [t for t in trajs if successful(t)]
    abstentions = [t for t in trajs if abstained(t)]
    wanted = round(abstain_share / (1 - abstain_share) * len(solved))  # abstentions / (solved + abstentions) = share
    solved_ids = {t.metadata["question_id"] for t in solved}
    for q in questions:  # only solvable questions are replayed: their gold email is known to be findable otherwise
        if len(abstentions) >= wanted:
            break
        replay = withheld(q, db) if q.id in solved_ids else None
        if replay is not None:
            traj = await rollout(policy, replay, db, config)
            if abstained(traj):
                traj.metadata["withheld_gold"] = True
                abstentions.append(traj)
    mixed = solved + abstentions[:wanted]
    random.Random(seed).shuffle(mixed)
    return mixed


SHAPE_KEYS = ("max_turns", "max_body_chars", "search_results")  # what changes the prompt and the tool replies


def teacher_trajectories(folder: str | Path, db: EmailDB, config: RolloutConfig | None = None,
                         held_out: list[Question] = ()) -> list[art.Trajectory]:
    """Judged-correct, correctly cited episodes from an evaluation folder's results.jsonl, never of the test
    split nor of the `held_out` questions (those training validates on).

    With `config`, warns when the teacher played another episode shape than the one being trained: its system
    prompt names another number of turns and its tool replies are longer or shorter than the student's will be.
    """
    path = Path(folder) / "results.jsonl"
    if not path.is_file():
        raise DataError(f"--sft-from {folder}: no results.jsonl there (an output folder of test_email_search_agent.py)")
    test_ids = {row[0] for row in db.conn.execute("SELECT id FROM questions WHERE split = 'test'")}
    records, unreadable = read_results(path, keys=("model", "question_id", "messages", "metrics", "reward"))
    if unreadable:
        logger.warning("--sft-from %s: %d unreadable line(s) in results.jsonl skipped", folder, unreadable)
    if not records:
        raise DataError(f"--sft-from {folder}: results.jsonl holds no episodes (is it an evaluation's results?)")
    held_out_ids = {q.id for q in held_out}
    trajs, shapes, skipped = [], set(), 0
    for record in records:
        episode = record.get("episode") or {}
        shapes.add(tuple(episode.get(key) for key in SHAPE_KEYS))
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
    if config is not None:
        wanted = tuple(getattr(config, key) for key in SHAPE_KEYS)
        other = sorted({shape for shape in shapes if None not in shape and shape != wanted})
        if other:
            played = "; ".join(", ".join(f"{k} {v}" for k, v in zip(SHAPE_KEYS, shape)) for shape in other)
            logger.warning("--sft-from %s: the teacher played %s, this run trains with %s: evaluate the teacher "
                           "with the same --max-turns, --max-body-chars and --search-results as `train`, or the "
                           "warm start teaches from prompts and tool replies the agent will not see", folder, played,
                           ", ".join(f"{k} {v}" for k, v in zip(SHAPE_KEYS, wanted)))
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


def sft_source(source: str, db: EmailDB, questions: list[Question], config: RolloutConfig,
               held_out: list[Question] = ()):
    """`--sft-from` -> an awaitable of trajectories: the demo expert plays `questions`; a teacher's episodes
    are whatever it played, less the `held_out` questions."""
    if source == "demo-expert":
        return expert_trajectories(db, questions, config)
    if Path(source).expanduser().is_dir():
        async def load():
            return teacher_trajectories(Path(source).expanduser(), db, config, held_out)
        return load()
    raise DataError(f"--sft-from {source!r}: expected 'demo-expert' or an evaluation folder with results.jsonl")


async def warm_start_episodes(cfg, db, train_questions, val_questions, rollout_config) -> list:
    """The trajectories the warm start imitates: the demo expert's on the train questions, or a teacher's
    judged-correct ones (none of the validation questions: the curve would score what it imitated)."""
    trajectories = await sft_source(cfg.sft_from, db, train_questions, rollout_config, held_out=val_questions)
    if cfg.sft_limit:
        trajectories = trajectories[:cfg.sft_limit]
    if not trajectories:
        raise DataError(f"--sft-from {cfg.sft_from}: no successful trajectories to learn from.")
    return trajectories


async def warm_start(cfg, model, trajectories: list, say: Callable[[str], None] = logger.info) -> None:
    """Supervised fine-tuning on successful (and abstaining) trajectories: ART's train_sft, one checkpoint per epoch
(`cfg`: the run's TrainConfig).

    `say` gets a line per epoch (step, epoch, seconds). Resumable: the step the warm start began at is saved in the run state before the first epoch, so after an
    interruption (even kill -9) the epochs already checkpointed are skipped, not re-run on top of themselves.
    """
    from art.utils.sft import create_lr_schedule

    state = model.read_state() or {}
    if "sft_start_step" not in state:
        state = model.merge_state({"sft_start_step": await model.get_step()})
    done = await model.get_step() - state["sft_start_step"]  # epochs already checkpointed
    abstentions = sum(1 for t in trajectories if t.metrics.get("returned_i_dont_know"))
    logger.info("warm start: %d trajectories from %s (%d end in \"I don't know\")%s", len(trajectories), cfg.sft_from,
                abstentions, f"; resuming after epoch {done}" if done else "")
    # One schedule over all epochs (ART's create_lr_schedule), so a resumed warm start picks up its own slice.
    batches = -(-len(trajectories) // cfg.sft_batch_size)
    rates = create_lr_schedule(batches * cfg.sft_epochs, cfg.sft_learning_rate, method=cfg.sft_schedule,
                               warmup_steps=0 if cfg.sft_schedule == "constant" else batches * cfg.sft_epochs // 10)
    for epoch in range(done, cfg.sft_epochs):
        started = time.perf_counter()
        await model.train_sft(trajectories, art.types.TrainSFTConfig(
            learning_rate=rates[epoch * batches:(epoch + 1) * batches], batch_size=cfg.sft_batch_size))
        step = await model.get_step()
        await model.log(metrics={"sft_epoch": epoch + 1}, split="train", step=step)  # marks the step in the curve
        say(f"sft  {step:>4}  epoch {epoch + 1}/{cfg.sft_epochs}  {time.perf_counter() - started:.0f}s")
