"""Writing a question set for any inbox with an LLM, as ART·E made its own (art.md A6).

Owns: batching one inbox's emails, the prompt, calling the model (any litellm name, or any OpenAI-compatible
endpoint with `base_url`; retried as `model_api` retries every model call), its reply cache, the estimate of what a
run will send and cost (told before anything is sent, to a `confirm` that may stop it), and writing the accepted
questions into the database's `questions` table in one transaction. Whether a candidate may be stored, and its
split, is `question_checks`'. It sits beside `build`, with SQL of its own (`EmailDB` is read-only); the CLI's
`generate-questions` is a thin layer over `generate_questions`.

What is guaranteed:
- Nothing fabricated is stored: a candidate must cite emails that exist, belong to the inbox and were in the
  batch the model saw; its query_date is on or after every cited email; no field is empty; near-duplicates
  of a stored or accepted question are dropped. Every rejection is counted by reason.
- No email is cited by both a train and a test question (the split is by connected groups of emails).
- A killed run stores no question: they are written in one transaction at the end. The model's replies are
  cached per batch beside the database, so a re-run pays only for batches it has not seen and adds only
  questions not already stored. `replace=True` deletes every stored question and the cache first.
Left out: judging whether an answer is *true* to its emails (a second LLM pass would be needed), and
spreading questions over inboxes by the inbox split ART·E used (we split by emails instead).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import re
import sqlite3
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from email_agent import model_api
from email_agent.data.email_db import no_database
from email_agent.data.question_checks import Reject, assign_splits, check_candidate, is_near_duplicate, words
from email_agent.errors import UserError
from email_agent.redact import redact

log = logging.getLogger(__name__)

PROMPT_VERSION = 1  # part of the cache key: a changed prompt must not reuse old replies
BODY_CHARS = 1500  # per email in the prompt; 20 emails stay well inside a 32k-token context

# ---- ALGO LOGIC: the generation prompt (a place to tune) ----------------------------------------------
SYSTEM_PROMPT = """You write questions that the owner of an email inbox might realistically ask a search assistant
about their own mail, each answered by the emails you are shown.
Rules:
- Each question must be answerable from the cited emails alone, with a short, specific answer (a name, number,
  date, place, decision). Do not ask about anything the emails do not state.
- Phrase questions as the inbox owner would, without copying whole sentences from the email.
- Cite the email(s) holding the answer by copying their id exactly from <email id="...">.
- how_realistic: from 0 to 1, how likely a real person is to ask this question of their inbox.
- Write up to {n} questions; fewer, or none, if the emails hold nothing worth asking (newsletters, spam).
Reply with JSON only, no prose:
{{"questions": [{{"question": "...", "answer": "...", "message_ids": ["..."], "how_realistic": 0.8}}]}}"""
# ------------------------------------------------------------------------------------------------------


@dataclass
class GenerateConfig:
    model: str  # any litellm name: openai/gpt-4.1, anthropic/..., hosted_vllm/<served name> with base_url
    base_url: str | None = None  # an OpenAI-compatible endpoint (a litellm proxy, vLLM)
    api_key: str | None = field(default=None, repr=False)  # from the environment; never logged or shown
    inboxes: list[str] = field(default_factory=list)  # empty: the largest inbox
    max_questions: int = 0  # stop once this many new questions are accepted (0: every batch)
    batch_size: int = 20  # emails the model sees at once (ART·E: 20)
    questions_per_batch: int = 5  # asked for in the prompt
    test_fraction: float = 0.2
    min_realistic: float = 0.0  # reject candidates the model itself rates less realistic than this
    seed: int = 0  # batch order, query dates, split
    replace: bool = False  # delete every stored question (and the reply cache) first
    temperature: float = 0.5  # ART·E's
    max_tokens: int = 4000
    retries: int = 3  # tries per batch for API errors and replies that are not JSON in the schema
    concurrency: int = 4  # batches in flight
    timeout: float = 120.0


@dataclass
class GenerateSummary:
    inboxes: list[str]
    batches: int = 0  # batches used (asked or from the cache)
    cached: int = 0  # of which answered from the cache
    candidates: int = 0
    beyond_limit: int = 0  # valid, but past --max-questions (their replies stay cached for a later run)
    added: dict[str, int] = field(default_factory=dict)  # split -> new questions stored
    rejected: Counter = field(default_factory=Counter)  # reason -> candidates
    examples: dict[str, str] = field(default_factory=dict)  # reason -> the first rejected question
    failed_batches: Counter = field(default_factory=Counter)  # reason -> batches with no usable reply
    cost_usd: float | None = 0.0  # of this run's requests; None: litellm knows no price for this model
    total: dict[str, int] = field(default_factory=dict)  # split -> questions in the database afterwards

    def lines(self) -> list[str]:
        added = ", ".join(f"{n} {s}" for s, n in sorted(self.added.items())) or "none"
        total = ", ".join(f"{n} {s}" for s, n in sorted(self.total.items())) or "none"
        cost = "unknown (litellm has no price for this model)" if self.cost_usd is None else f"${self.cost_usd:.4f}"
        out = [f"inboxes     {', '.join(self.inboxes)}",
               f"batches     {self.batches} ({self.cached} from the cache)",
               f"candidates  {self.candidates}: added {added}; rejected {sum(self.rejected.values())}"
               + (f"; {self.beyond_limit} left over past --max-questions" if self.beyond_limit else ""),
               *(f"  rejected {n:>4}  {reason}  (e.g. {self.examples[reason]!r})"
                 for reason, n in self.rejected.most_common()),
               *(f"  failed batches {n:>3}  {reason}" for reason, n in self.failed_batches.most_common()),
               f"cost        {cost}",
               f"questions   {total} in the database"]
        return out


# What an estimate takes a reply to be: a question, its answer, a cited id and a score as JSON are about 60-100 tokens
OUTPUT_TOKENS_PER_QUESTION = 100
TOKEN_SAMPLE = 20  # batches whose prompts are tokenized; the rest are estimated from their length in characters


@dataclass
class Estimate:
    """What a run is about to send, told before it sends anything."""
    model: str
    batches: int  # batches to ask (those answered from the cache cost nothing)
    cached: int
    emails: int  # emails in the batches to ask
    input_tokens: int
    output_tokens: int  # questions_per_batch x OUTPUT_TOKENS_PER_QUESTION a reply
    max_tokens: int  # a reply's limit
    cost_usd: float | None  # None: litellm has no price for the model
    cost_usd_max: float | None
    stops_after: int = 0  # with --max-questions: the fewest batches that can reach it (0: no limit)

    def lines(self) -> list[str]:
        cached = f" ({plural(self.cached, 'batch')} more answered from the cache)" if self.cached else ""
        limit = (f"; --max-questions may stop it after {plural(self.stops_after, 'batch')}"
                 if 0 < self.stops_after < self.batches else "")
        tokens = (f"~{self.input_tokens:,} input and ~{self.output_tokens:,} output tokens (replies of "
                  f"~{OUTPUT_TOKENS_PER_QUESTION} tokens a question)")
        cost = (f"the cost is unknown (litellm has no price for {self.model})" if self.cost_usd is None else
                f"about ${self.cost_usd:.2f} at litellm's prices, at most ${self.cost_usd_max:.2f} if every reply "
                f"ran to its {self.max_tokens:,} tokens")
        return [f"to send     {plural(self.emails, 'email')} in {plural(self.batches, 'batch')} to {self.model}"
                f"{cached}{limit}",
                f"estimate    {tokens}: {cost}"]


def plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "es" if noun.endswith("ch") else "s")


def estimate(to_send: list["Batch"], cached: int, cfg: GenerateConfig) -> Estimate:
    """The tokens and price of asking for `to_send`: the prompts' tokens counted by litellm for the model (on a
    sample of TOKEN_SAMPLE batches, scaled by length), the replies' guessed, the price from litellm's price map."""
    # here, not at the top: litellm takes ~1.5 s to import (openai, pydantic), and this module loads for --help
    import litellm

    prompts = [batch_prompt(batch, cfg) for batch in to_send]
    chars = [sum(len(m["content"]) for m in prompt) for prompt in prompts]
    sample = range(0, len(prompts), max(1, len(prompts) // TOKEN_SAMPLE))
    try:
        sampled = sum(litellm.token_counter(model=cfg.model, messages=prompts[i]) for i in sample)
    except Exception:  # a tokenizer litellm cannot load here (it fetches some from Hugging Face): OpenAI's
        sampled = sum(litellm.token_counter(messages=prompts[i]) for i in sample)
    input_tokens = round(sampled * sum(chars) / max(1, sum(chars[i] for i in sample)))
    n = len(to_send)
    output_tokens = n * cfg.questions_per_batch * OUTPUT_TOKENS_PER_QUESTION

    def price(completion_tokens: int) -> float | None:
        try:  # per request, as providers bill it (some price long prompts higher)
            return n * sum(litellm.cost_per_token(model=cfg.model, prompt_tokens=input_tokens // max(n, 1),
                                                  completion_tokens=completion_tokens // max(n, 1)))
        except Exception:  # litellm raises for a model it has no price for
            return None

    stops_after = math.ceil(cfg.max_questions / cfg.questions_per_batch) if cfg.max_questions else 0
    return Estimate(cfg.model, n, cached, sum(len(batch.emails) for batch in to_send), input_tokens, output_tokens,
                    cfg.max_tokens, price(output_tokens), price(n * cfg.max_tokens), stops_after)


@dataclass
class Batch:
    inbox: str
    emails: list[dict]  # message_id, date, subject, from_address, to, body

    def key(self, cfg: GenerateConfig) -> str:
        ids = [e["message_id"] for e in self.emails]
        raw = json.dumps([PROMPT_VERSION, cfg.model, cfg.temperature, cfg.questions_per_batch, self.inbox, ids])
        return hashlib.sha256(raw.encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------------------------
# The database side: inboxes, batches, stored questions, the final write
# ----------------------------------------------------------------------------------------------

def open_for_writing(db_path: str | Path) -> sqlite3.Connection:
    """A read-write connection (EmailDB is read-only). Readers (a training run) keep reading meanwhile:
    the rollback journal lets them in until the single short commit at the end, which waits for them."""
    path = Path(db_path)
    if not path.is_file():
        raise UserError(no_database(path, "build-db --emails ... --db " + str(path)))
    conn = sqlite3.connect(path, timeout=60, isolation_level=None)
    try:
        for table in ("emails", "mailbox", "recipients", "questions"):  # one at a time: a join of them is a scan
            conn.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchall()
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise UserError(f"{path} is not an email database built by this tool ({exc}); "
                        "rebuild it with build-db.") from None
    return conn


def pick_inboxes(conn, wanted: list[str]) -> list[str]:
    largest = [a for a, in conn.execute("SELECT address FROM mailbox GROUP BY address ORDER BY COUNT(*) DESC, "
                                        "address LIMIT 5")]
    if not wanted:
        return largest[:1]
    inboxes = []
    for address in wanted:
        address = address.strip().lower()
        if conn.execute("SELECT 1 FROM mailbox WHERE address = ? LIMIT 1", (address,)).fetchone() is None:
            raise UserError(f"No mail sent or received by {address} in this database; the largest inboxes are "
                            f"{', '.join(largest)}.")
        inboxes.append(address)
    return inboxes


def make_batches(conn, inboxes: list[str], batch_size: int, seed: int) -> list[Batch]:
    """Each inbox's emails in date order, cut into batches (neighbours in time make coherent questions);
    the batches then shuffled with `seed`, so --max-questions samples the whole span of every inbox."""
    batches = []
    for inbox in inboxes:
        rows = conn.execute(
            "SELECT e.id, e.message_id, e.date, e.subject, e.from_address, e.body FROM emails e "
            "JOIN mailbox m ON m.email_id = e.id WHERE m.address = ? AND trim(e.body) != '' "
            "ORDER BY e.date, e.message_id", (inbox,)).fetchall()
        emails = []
        for email_id, message_id, when, subject, sender, body in rows:
            to = [a for a, in conn.execute("SELECT address FROM recipients WHERE email_id = ? ORDER BY rowid LIMIT 6",
                                           (email_id,))]
            emails.append({"message_id": message_id, "date": when, "subject": subject, "from_address": sender,
                           "to": to, "body": body})
        batches += [Batch(inbox, emails[i:i + batch_size]) for i in range(0, len(emails), batch_size)]
    random.Random(seed).shuffle(batches)
    return batches


def stored_questions(conn) -> list[dict]:
    rows = conn.execute("SELECT id, question, message_ids, inbox_address, split FROM questions")
    return [{"id": i, "question": q, "message_ids": json.loads(m), "inbox": a, "split": s} for i, q, m, a, s in rows]


def write_questions(conn, accepted: list[dict], cfg: GenerateConfig) -> None:
    """All new questions in one transaction: a crash or kill before COMMIT leaves the table as it was."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(questions)")}
        for column, kind in (("model", "TEXT"), ("temperature", "REAL")):  # databases built before these existed
            if column not in columns:
                conn.execute(f"ALTER TABLE questions ADD COLUMN {column} {kind}")
        if cfg.replace:
            conn.execute("DELETE FROM questions")
        next_id = (conn.execute("SELECT MAX(id) FROM questions WHERE typeof(id) = 'integer'").fetchone()[0] or 0) + 1
        for offset, q in enumerate(accepted):
            conn.execute("INSERT INTO questions (id, question, answer, message_ids, how_realistic, inbox_address, "
                         "query_date, split, gold_in_db, model, temperature) VALUES (?,?,?,?,?,?,?,?,1,?,?)",
                         (next_id + offset, q["question"], q["answer"], json.dumps(q["message_ids"]),
                          q["how_realistic"], q["inbox"], q["query_date"], q["split"], cfg.model, cfg.temperature))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


# ----------------------------------------------------------------------------------------------
# The model side: prompt, reply parsing, the cached call
# ----------------------------------------------------------------------------------------------

def cut_body(body: str, limit: int = BODY_CHARS) -> str:
    """The start of a body, cut at a word boundary; quoted replies and long signatures are what gets lost."""
    body = re.sub(r"\n{3,}", "\n\n", body.strip())
    if len(body) <= limit:
        return body
    cut = body[:limit]
    return cut[:cut.rfind(" ")] if " " in cut[limit // 2:] else cut + " [...]"


def batch_prompt(batch: Batch, cfg: GenerateConfig) -> list[dict]:
    parts = [f"The inbox belongs to {batch.inbox}. Its emails ({len(batch.emails)}, oldest first):"]
    for e in batch.emails:
        to = ", ".join(e["to"]) or "(none)"
        parts.append(f'<email id="{e["message_id"]}">\nDate: {e["date"]} UTC\nFrom: {e["from_address"]}\nTo: {to}\n'
                     f'Subject: {e["subject"]}\n\n{cut_body(e["body"])}\n</email>')
    return [{"role": "system", "content": SYSTEM_PROMPT.format(n=cfg.questions_per_batch)},
            {"role": "user", "content": "\n\n".join(parts)}]


def parse_reply(text: str) -> list:
    """The model's reply -> its list of candidates; ValueError if it is not JSON of the asked shape (retried)."""
    text = re.sub(r"^```(?:json)?\s*|\s*```$", "", (text or "").strip())  # models like to fence JSON
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("reply is not JSON")
    try:
        reply = json.loads(text[start:end + 1])
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested deeper than Python's stack
        raise ValueError("reply is not JSON") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("questions"), list):
        raise ValueError('reply has no "questions" list')
    return reply["questions"]


class ReplyCache:
    """Model replies by batch key, one JSON line each, appended as they arrive (a torn last line is ignored)."""

    def __init__(self, path: Path, fresh: bool):
        self.path = path
        self.replies: dict[str, dict] = {}
        if fresh:
            path.unlink(missing_ok=True)
        elif path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    self.replies[row["key"]] = row
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue

    def add(self, row: dict) -> None:
        self.replies[row["key"]] = row
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def cache_path(db_path: str | Path) -> Path:
    return Path(str(db_path) + ".questions-cache.jsonl")


class CallFailed(Exception):
    """The model API call raised (network, auth, rate limit); the message, "API error: <its type>", is what a failed
    batch is counted under (the error's own text may quote the key)."""


class Malformed(Exception):
    """The reply is not JSON of the asked shape; the message says how."""


async def ask_model(batch: Batch, cfg: GenerateConfig, cache: ReplyCache) -> dict:
    """{"questions": [...], "cost": float | None, "cached": bool} or {"error": reason} after cfg.retries tries."""
    key = batch.key(cfg)
    if key in cache.replies:
        return {**cache.replies[key], "cached": True}
    litellm = model_api.import_litellm()
    # a failed call is asked again after a wait (1 s, doubling), a malformed reply at once; anything else raises
    retrying = model_api.retrying(cfg.retries, first_wait=1.0,
                                  retry_if=lambda error: isinstance(error, (CallFailed, Malformed)),
                                  wait_if=lambda error: isinstance(error, CallFailed))
    try:
        async for attempt in retrying:
            with attempt:
                try:
                    response = await litellm.acompletion(model=cfg.model, messages=batch_prompt(batch, cfg),
                                                         temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                                         **model_api.endpoint_params(cfg.base_url, cfg.api_key,
                                                                                     cfg.timeout))
                except Exception as exc:  # network, auth, rate limit: retried, then counted (never with the key)
                    error = f"API error: {type(exc).__name__}"
                    log.warning("batch %s: %s: %s", key[:8], error, redact(str(exc)[:300], cfg.api_key))
                    raise CallFailed(error) from exc
                try:
                    if not response.choices:  # an OpenAI-compatible server may answer 200 with no choice at all
                        raise ValueError("reply has no choices")
                    questions = parse_reply(response.choices[0].message.content)
                except ValueError as exc:
                    log.info("batch %s try %d: %s", key[:8], attempt.retry_state.attempt_number, exc)
                    raise Malformed(str(exc)) from exc
    except (CallFailed, Malformed) as exc:  # after cfg.retries tries: counted by its message
        return {"error": str(exc)}
    try:
        with warnings.catch_warnings():  # litellm's own pydantic serializer warnings are noise to the user
            warnings.simplefilter("ignore")
            cost = float(litellm.completion_cost(completion_response=response))
    except Exception:  # litellm raises for models it has no price for
        cost = None
    row = {"key": key, "questions": questions, "cost": cost}
    cache.add(row)
    return {**row, "cached": False}


# ----------------------------------------------------------------------------------------------
# The whole run
# ----------------------------------------------------------------------------------------------

def generate_questions(db_path: str | Path, cfg: GenerateConfig, *, progress: bool = True,
                       confirm: Callable[[Estimate], bool] | None = None) -> GenerateSummary | None:
    """Generate, validate, split and store questions for cfg.inboxes; see the module docstring for guarantees.
    `confirm` is shown what will be sent before anything is, and may stop the run there (None returned)."""
    if not 0 <= cfg.test_fraction < 1:
        raise UserError(f"--test-fraction must be in [0, 1), not {cfg.test_fraction}")
    if cfg.batch_size < 1 or cfg.concurrency < 1 or cfg.max_questions < 0:
        raise UserError("--batch-size and --concurrency must be at least 1, and --max-questions at least 0")
    if not 0 <= cfg.min_realistic <= 1:
        raise UserError(f"--min-realistic must be in [0, 1], not {cfg.min_realistic}")
    if not 0 < cfg.timeout < math.inf:
        raise UserError(f"--timeout must be above 0 seconds, not {cfg.timeout}")
    conn = open_for_writing(db_path)
    try:
        summary = GenerateSummary(inboxes=pick_inboxes(conn, cfg.inboxes))
        batches = make_batches(conn, summary.inboxes, cfg.batch_size, cfg.seed)
        if not batches:
            raise UserError(f"No emails with a body in the inbox of {', '.join(summary.inboxes)}.")
        stored = [] if cfg.replace else stored_questions(conn)
        cache = ReplyCache(cache_path(db_path), fresh=False)
        to_send = [batch for batch in batches if cfg.replace or batch.key(cfg) not in cache.replies]
        if to_send:  # a rerun read from the cache needs no key and costs nothing
            check_key(cfg)
            if confirm is not None and not confirm(estimate(to_send, len(batches) - len(to_send), cfg)):
                return None
        if cfg.replace:  # only now: the replies it deletes were paid for
            cache = ReplyCache(cache_path(db_path), fresh=True)
        accepted = asyncio.run(_run(batches, conn, cfg, cache, stored, summary, progress))
        if cfg.max_questions:
            summary.beyond_limit = max(0, len(accepted) - cfg.max_questions)
            accepted = accepted[:cfg.max_questions]
        placed = [q for q in assign_splits(accepted, stored, cfg.test_fraction, cfg.seed) if q["split"]]
        for q in accepted:
            if q["split"] is None:
                _reject(summary, "cites emails of both a stored train and a stored test question", q["question"])
        write_questions(conn, placed, cfg)
        summary.added = dict(Counter(q["split"] for q in placed))
        summary.total = dict(conn.execute("SELECT split, COUNT(*) FROM questions GROUP BY split").fetchall())
        return summary
    finally:
        conn.close()


def check_key(cfg: GenerateConfig) -> None:
    """A provider key missing from the environment is one error up front, not three failed tries per batch."""
    if cfg.api_key or cfg.base_url:
        return
    # here, not at the top: litellm takes ~1.5 s to import (openai, pydantic), and this module loads for --help
    import litellm

    missing = litellm.validate_environment(cfg.model).get("missing_keys")
    if missing:
        raise UserError(f"{cfg.model} needs {' or '.join(missing)} in the environment (or QUESTIONS_API_KEY); "
                        "nothing was asked")


def no_usable_reply(cfg: GenerateConfig, summary: GenerateSummary) -> str:
    reason = summary.failed_batches.most_common(1)[0][0]
    asked = f"any of the first {summary.batches} batches" if summary.batches > 1 else "the first batch"
    return (f"{cfg.model} gave no usable reply for {asked} ({reason}); check the "
            f"model name, --base-url and the API key in the environment (the log above has the provider's words).")


def _reject(summary: GenerateSummary, reason: str, question) -> None:
    summary.rejected[reason] += 1
    summary.examples.setdefault(reason, str(question)[:80])


async def _run(batches, conn, cfg, cache, stored, summary, progress) -> list[dict]:
    """Ask for batches `concurrency` at a time and validate their replies in batch order (so a run is
    reproducible whatever order replies arrive in), until every batch is used or enough are accepted."""
    seen: dict[str, list] = {}  # inbox -> word sets of stored and accepted questions
    exact = {(q["inbox"], " ".join(sorted(words(q["question"])))) for q in stored}
    for q in stored:
        seen.setdefault(q["inbox"], []).append(words(q["question"]))
    accepted: list[dict] = []
    costs: list[float | None] = []
    bar = tqdm(total=len(batches), unit=" batch", desc="generating", disable=not progress)
    try:
        for start in range(0, len(batches), cfg.concurrency):
            if cfg.max_questions and len(accepted) >= cfg.max_questions:
                break
            window = batches[start:start + cfg.concurrency]
            replies = await asyncio.gather(*(ask_model(b, cfg, cache) for b in window))
            for batch, reply in zip(window, replies):
                summary.batches += 1
                bar.update()
                if "error" in reply:
                    summary.failed_batches[reply["error"]] += 1
                    continue
                summary.cached += reply["cached"]
                if not reply["cached"]:
                    costs.append(reply["cost"])
                rng = random.Random(f"{cfg.seed}:{reply['key']}")  # the same dates when a cached batch is re-read
                for item in reply["questions"]:
                    summary.candidates += 1
                    text = item.get("question") if isinstance(item, dict) else item
                    try:
                        q = check_candidate(item, batch.inbox, batch.emails, conn, cfg.min_realistic, rng)
                        ws = words(q["question"])
                        if (q["inbox"], " ".join(sorted(ws))) in exact:
                            raise Reject("already in the database")
                        if any(is_near_duplicate(ws, other) for other in seen.get(q["inbox"], [])):
                            raise Reject("near-duplicate of another question")
                    except Reject as exc:
                        _reject(summary, str(exc), text)
                        continue
                    seen.setdefault(q["inbox"], []).append(ws)
                    accepted.append(q)
            if sum(summary.failed_batches.values()) == summary.batches:  # the whole first window failed
                raise UserError(no_usable_reply(cfg, summary))
            known = [c for c in costs if c is not None]
            summary.cost_usd = sum(known) if known or not costs else None  # nothing asked: nothing spent
            bar.set_postfix_str(f"accepted={len(accepted)} rejected={sum(summary.rejected.values())}"
                                + (f" cost=${summary.cost_usd:.4f}" if summary.cost_usd is not None else ""))
    finally:
        bar.close()
    return accepted


def add_arguments(p) -> None:
    """The generate-questions subcommand's flags (GenerateConfig's fields, as a person types them), but --db."""
    p.add_argument("--model", required=True, metavar="SPEC", help="any litellm model name (openai/gpt-4.1, "
                                                                 "anthropic/..., hosted_vllm/NAME with --base-url)")
    p.add_argument("--base-url", metavar="URL", help="an OpenAI-compatible endpoint (a litellm proxy, vLLM)")
    p.add_argument("--inbox", action="append", metavar="ADDRESS", help="whose mail to ask about (repeat for several; "
                                                                       "default: the largest inbox)")
    p.add_argument("--max-questions", type=int, default=0, metavar="N", help="stop after N new questions (default: "
                                                                             "use every batch)")
    p.add_argument("--batch-size", type=int, default=20, metavar="N", help="emails per request (default 20)")
    p.add_argument("--test-fraction", type=float, default=0.2, metavar="F", help="share of new questions held out "
                                                                                 "for testing (default 0.2)")
    p.add_argument("--min-realistic", type=float, default=0.0, metavar="X",
                   help="reject questions the model rates less realistic than X (0..1, default 0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="batch order, query dates and split (default 0)")
    p.add_argument("--replace", action="store_true", help="delete every stored question and cached reply first")
    p.add_argument("--yes", action="store_true", help="send without asking (the estimate of what is sent and its cost "
                                                     "is printed first; without a terminal it never asks)")
    p.add_argument("--temperature", type=float, default=0.5, help="sampling temperature (default 0.5, as ART·E)")
    p.add_argument("--concurrency", type=int, default=4, metavar="N", help="requests in flight (default 4)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds a request may take before it is tried again (default 120; 3 tries)")
