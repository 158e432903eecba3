"""The scripted expert: an agent for any question set whose questions cite their emails, played through the real
`rollout` like any model. Its episodes are the warm start's (`--sft-from expert`), and what it solves is the
ceiling of an episode's limits: what a good agent could do in that many turns, results and characters.

It sees what a good agent sees (the question, the tool results, and which correspondents the inbox has mail
from, and how many of its emails each word of the question matches) and uses the gold answer only to recognise
the email that holds it and to phrase its final answer. It searches with two of the question's words, its rarest
in the inbox (`demo-expert`: its names first), with `from_address` when the question names a sender the inbox
has mail from and a date window when it says when the mail came, backing off to fewer words; reads the
results best first; answers from the first email that holds the answer (by its words, not verbatim: real
answers are paraphrases of quoted, signed, reformatted mail); and says "I don't know" when its searches run
out, and at the latest on its last turn, so an episode it cannot solve ends in an abstention.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import date, timedelta

import art
from openai.types.chat import ChatCompletion

from email_agent.data.email_db import MAX_SEARCH_RESULTS, EmailDB, day_after
from email_agent.data.questions import Question
from email_agent.agent.matcher import normalize_answer
from email_agent.agent.episode import Episode
from email_agent.agent.rollout import rollout

STOPWORDS = set("""a about after all am an and any are as at be been before being but by can could did do does
for from had has have how i if in into is it its me my of on or our should so than that the their them then
there these they this to up was we were what when where which who whom why will with would you your
time date day price cost much many number name get got set""".split())  # question words emails rarely contain

FIRST_KEYWORDS = 2  # the first search's words; fewer match more mail, more pick the email out
READS_PER_SEARCH = 5  # results read from one search before the next search of the plan
ENOUGH_OF_THE_ANSWER = 0.75  # share of a multi-word answer's words an email must hold (every number, always)

# "did Ross", "from Ross", "Ross asked", "Ross's email": a capitalised name the question says the mail came from
SENDER_VERBS = ("say|said|send|sent|ask|asked|tell|told|write|wrote|email|emailed|mention|mentioned|give|gave|"
                "forward|forwarded|want|wanted|request|requested|propose|proposed|suggest|suggested|recommend|"
                "recommended|report|reported|share|shared|announce|announced|confirm|confirmed|need|needed|invite|"
                "invited|note|noted|offer|offered|provide|provided|update|updated")
NAME = r"((?:[A-Z][a-z]+)(?: [A-Z][a-z]+)?)"
SENDER_PATTERNS = [re.compile(rf"\b(?:did|from|has|had|does|will|per|according to) {NAME}\b"),
                   re.compile(rf"\b{NAME}(?:'s)? (?:{SENDER_VERBS})\b"),
                   re.compile(rf"\b{NAME}'s (?:email|message|note|memo|request|question|reply|update)\b")]
# How a question is put, rarely what its email says: not searched for as its rarest words
FRAMING = set("according per former three two four five first last lose lost begin start".split()
              + SENDER_VERBS.split("|"))
MONTHS = {name: i + 1 for i, name in enumerate("january february march april may june july august september "
                                               "october november december".split())}


def question_keywords(text: str, limit: int = FIRST_KEYWORDS) -> list[str]:
    """Distinctive words of a question: capitalised names and codes first, then other content words."""
    words = [w.strip("?.,!:;'\"()") for w in text.split()]
    words = [w[:-2] if w.endswith("'s") else w for w in words]
    content = [w for w in words if len(w) > 2 and w.lower() not in STOPWORDS]
    named = [w for w in content[1:] if w[:1].isupper() or any(c.isdigit() for c in w)]
    ordered = named + [w for w in content if w not in named]
    return list(dict.fromkeys(ordered))[:limit]


def rare_keywords(question: str, inbox: str, today: str, db: EmailDB, limit: int = 3) -> list[str]:
    """The question's words that pick out fewest of the inbox's emails (that it holds at all), rarest first: what a
    searcher who knows the inbox would type."""
    counts = {}
    for word in question_keywords(question, limit=99):
        if word.lower() in FRAMING:
            continue
        hits = len(db.search(inbox, [word], visible_until=day_after(today), max_results=MAX_SEARCH_RESULTS))
        if hits:
            counts[word] = hits
    return sorted(counts, key=counts.get)[:limit]


def answer_words(text: str) -> list[str]:
    """The words that carry an answer: normalised (see `matcher.normalize_answer`), numbers split from their
    units ("$150mm" -> 150 mm), without the common words and initials."""
    spaced = re.sub(r"(?<=\d)(?=[a-z])|(?<=[a-z])(?=\d)", " ", normalize_answer(text))
    return [w for w in spaced.split() if w not in STOPWORDS and (len(w) > 1 or w.isdigit())]  # not initials


def holds_answer(text: str, answer: str) -> bool:
    """Does `text` (an email as the agent read it) hold `answer`? As written, or by its words: every number of
    the answer and most of its other words (all of them for an answer of one or two words)."""
    if f" {normalize_answer(answer)} " in f" {normalize_answer(text)} ":
        return True
    wanted, seen = answer_words(answer), set(answer_words(text))
    if not wanted or any(w.isdigit() and w not in seen for w in wanted):
        return False
    found = sum(w in seen for w in wanted)
    return found == len(wanted) if len(wanted) <= 2 else found >= ENOUGH_OF_THE_ANSWER * len(wanted)


def sent_window(question: str, today: str) -> dict:
    """sent_after/sent_before for a question that says when its mail came: "yesterday", "last week", "last
    month", "in May" (the latest May up to `today`); {} otherwise (a date named in the question is usually
    the date of what the mail is about, not of the mail)."""
    text, day = question.lower(), date.fromisoformat(today)
    back = next((days for phrase, days in (("yesterday", 1), ("last week", 8), ("this week", 7), ("past week", 8),
                                           ("last month", 35), ("past month", 35)) if phrase in text), None)
    if back is not None:
        return {"sent_after": str(day - timedelta(days=back)), "sent_before": str(day + timedelta(days=1))}
    said = re.search(r"\b(?:sent|received|emailed|wrote|email|mail|message|note)\b.* in (" + "|".join(MONTHS)
                     + r")\b(?: (\d{4}))?", text)
    if said is None:
        return {}
    month = MONTHS[said.group(1)]
    year = int(said.group(2)) if said.group(2) else day.year - (month > day.month)
    first = date(year, month, 1)
    return {"sent_after": str(first), "sent_before": str(date(year + (month == 12), month % 12 + 1, 1))}


def sender_address(question: str, inbox: str, today: str, db: EmailDB) -> tuple[str, set[str]] | None:
    """The address of the correspondent the question says the mail came from ("What did Stephanie Miller
    say...", "from Ross") when the inbox has mail from an address holding that name (stephanie.miller@,
    smiller@, ross@; the one with the most mail if several do), and the name's words; else None."""
    for pattern in SENDER_PATTERNS:
        for match in pattern.finditer(question):
            words = match.group(1).lower().split()
            if any(w in STOPWORDS for w in words):
                continue
            senders = db.conn.execute(
                "SELECT e.from_address, COUNT(*) AS n FROM emails e JOIN mailbox m ON m.email_id = e.id "
                "WHERE m.address = ? AND e.date < ? AND e.from_address != ? GROUP BY e.from_address ORDER BY n DESC",
                (inbox, day_after(today), inbox)).fetchall()
            for address, _ in senders:
                if names_address(words, address):
                    return address, set(words)
    return None


def names_address(words: list[str], address: str) -> bool:
    """Does an address's local part name this person? stephanie.miller, miller.stephanie, smiller, steph.miller
    for "Stephanie Miller"; ross, ross.m for "Ross"."""
    parts = [p for p in re.split(r"[._\-+]", address.split("@")[0]) if p]
    if len(words) == 1:
        return words[0] in parts
    first, last = words[0], words[-1]
    return last in parts and any(p.startswith(first[:3]) for p in parts if p != last) or \
        first[0] + last in parts


@dataclass
class Ceiling:
    """What the expert did with a set of questions: how much of it an agent could solve within those episode limits."""

    questions: int
    solved: int  # right answer, citing the gold email
    other_source: int  # right answer, from an email that holds it but is not the one the question cites
    abstained: int  # "I don't know": its searches never showed an email holding the answer
    out_of_turns: int

    @classmethod
    def of(cls, trajectories: list[art.Trajectory]) -> "Ceiling":
        metrics = [t.metrics for t in trajectories]
        return cls(len(metrics), sum(bool(m["answer_correct"] and m["sources_correct"]) for m in metrics),
                   sum(bool(m["answer_correct"] and not m["sources_correct"]) for m in metrics),
                   sum(m["returned_i_dont_know"] for m in metrics), sum(m["ran_out_of_turns"] for m in metrics))

    def describe(self) -> str:
        share = f" ({self.solved / self.questions:.0%})" if self.questions else ""
        return (f"solved {self.solved} of {self.questions}{share}; answered from another email {self.other_source}; "
                f"said \"I don't know\" {self.abstained}; ran out of turns {self.out_of_turns}")


class ExpertPolicy:
    """The scripted expert as a policy: `complete` answers each turn from the messages so far (module docstring)."""

    model = "expert"

    def __init__(self, questions: list[Question], db: EmailDB, max_turns: int | None = None, rarest_first: bool = True):
        # By the question's words alone, as the demo's expert always did: where two inboxes ask the same words,
        # the later question's answer is looked for in both (3 of the demo's 202 warm-start questions; keying by
        # inbox too would solve them, and change the demo's warm start).
        self.answers = {q.question: q.answer for q in questions}
        self.db = db
        self.max_turns = max_turns
        self.rarest_first = rarest_first

    async def complete(self, messages: list[dict], max_tokens: int) -> tuple[ChatCompletion, float]:
        return self._reply(messages), 0.0  # no model: no time spent

    def search_plan(self, question: str, inbox: str, today: str) -> list[dict]:
        """The searches to try, in order: two of the question's words (its rarest in the inbox, or its names
        first with `rarest_first` off), then one; then the same in the other order; all from the sender the
        question names first (if any), all within the time it names (if any)."""
        window = sent_window(question, today)
        rare, named = rare_keywords(question, inbox, today, self.db), question_keywords(question, limit=99)
        first, then = (rare, named) if self.rarest_first else (named, rare)
        plan = []
        sender = sender_address(question, inbox, today, self.db)
        if sender is not None:
            address, name = sender
            topic = [w for w in first if w.lower() not in name][:FIRST_KEYWORDS]
            plan += [{"keywords": topic[:n], "from_address": address} for n in range(len(topic), 0, -1)]
        for words in (first, then):
            plan += [{"keywords": words[:n]} for n in range(min(len(words), FIRST_KEYWORDS), 0, -1)]
        plan = [{**search, **window} for search in plan]
        return [search for i, search in enumerate(plan) if search not in plan[:i]]

    def _reply(self, messages: list[dict]) -> ChatCompletion:
        system = messages[0]["content"]
        inbox = re.search(r"The user's email address is (\S+)\.", system).group(1)
        today = re.search(r"Today's date is (\d{4}-\d{2}-\d{2})", system).group(1)
        question = next(m["content"] for m in messages if m["role"] == "user")
        answer = self.answers[question]
        turn = sum(m["role"] == "assistant" for m in messages) + 1
        last_turn = self.max_turns is not None and turn >= self.max_turns
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for m in messages
                 if m["role"] == "assistant" for c in m.get("tool_calls") or []]
        replies = [m["content"] for m in messages if m["role"] == "tool"]
        if replies and replies[-1].startswith("{"):  # an email was just read
            email = json.loads(replies[-1])
            if holds_answer(f"{email['subject']}\n{email['body']}", answer):
                return self._call("return_final_answer", {"answer": answer, "sources": [email["message_id"]]})
        if last_turn:
            return self._call("return_final_answer", {"answer": "I don't know", "sources": []})
        searches = [(args, reply) for (name, args), reply in zip(calls, replies) if name == "search_inbox"]
        if searches and searches[-1][1].startswith("["):  # the latest search listed emails: read the next one
            read = {json.loads(r)["message_id"] for r in replies if r.startswith("{")}
            unread = [r["message_id"] for r in json.loads(searches[-1][1])[:READS_PER_SEARCH]
                      if r["message_id"] not in read]
            if unread:
                return self._call("read_email", {"message_id": unread[0]})
        tried = [args for args, _ in searches]
        following = [s for s in self.search_plan(question, inbox, today) if s not in tried]
        if following and (self.max_turns is None or turn <= self.max_turns - 2):  # a turn to read, one to answer
            return self._call("search_inbox", following[0])
        return self._call("return_final_answer", {"answer": "I don't know", "sources": []})

    @staticmethod
    def _call(name: str, arguments: dict) -> ChatCompletion:
        return ChatCompletion.model_validate({
            "id": "expert", "object": "chat.completion", "created": 0, "model": ExpertPolicy.model,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
                "role": "assistant", "content": None,
                "tool_calls": [{"id": f"call_{name}", "type": "function",
                                "function": {"name": name, "arguments": json.dumps(arguments)}}]}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}})


async def expert_episodes(db: EmailDB, questions: list[Question], config: Episode,
                          rarest_first: bool = True) -> list[art.Trajectory]:
    """The expert's episode on each question, in order."""
    policy = ExpertPolicy(questions, db, max_turns=config.max_turns, rarest_first=rarest_first)
    return [await rollout(policy, q, db, config) for q in questions]
