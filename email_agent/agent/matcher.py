"""The offline grader: is an answer right, judged from the gold answer and the question's text alone?

Owns `offline_verdict(answer, gold, question)` and what it reads an answer with. Real-mail gold answers carry
context a right answer may leave out ("approximately 400 MW" for "400 MW", "Linda Wicker, (281) 374-9557" for
"Linda Wicker", "room EB 552" for "EB 552", "Jan. 23, 2002" for "JAN. 23"), and right answers reword them. So the
gold answer is read as a core (what the question asks for) and its context, and each is read as facts:

- numbers (amounts with their scale: "$3.0 MM" = "$3 million" = 3000000), dates ("11/1/2001" = "Nov. 1st"),
  times ("7:00pm" = "7 pm"), phone numbers (their last seven digits) and codes ("E-20T" = "E20T");
- names: words written with a capital in the gold answer (their initials stand for them: "JEA");
- other words, compared by stem ("submitting" ~ "submit") and one typo apart in long words ("Grisby").

The core is the gold answer less its parentheses, less a trailing clause after a comma ("..., which is 100% owned
by Enron"; not in a list: "Duke Energy, Gulf Energy, and Tejas" needs all three; not when the question asks two
things: "when and where", "the dial-in and passcode"), less where a person is from when the question asks who
("Rick Miles of FERC's ADR group"), less a phone number unless the question asks for one, less the question's own
words ("21 FTEs" for "How many FTEs ...?") and hedges ("approximately"). An answer is right when it holds every
number, date, time and phone of the core (a year may be left out), at least three quarters of its names and half of
its other words, names nothing the gold answer lacks where numbers matter ("Boardroom 3 or 7"), and is not a pasted
email (its length is capped). How each rule and
threshold was chosen, and what it agrees with: data/grader-labels/README.md and bench/bench_grader.py.

`strict_verdict` is the grader this project shipped before (every word of the gold answer), kept for comparing
figures made with it; `GRADER` and `STRICT_GRADER` are the names a report prints for them.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

GRADER = "offline matcher v2 (core and context)"
STRICT_GRADER = "offline matcher v1 (every word of the gold answer)"


@dataclass
class Verdict:
    correct: bool
    judge: str  # "offline" or the judge model's name
    reasoning: str = ""
    error: str | None = None  # set when the judge failed and the offline matcher decided
    transient: bool = False  # ... and the failure may pass (a timeout, 429, 5xx, a refused connection)


def normalize_answer(text: str) -> str:
    """Lower-case; accents, punctuation and symbols dropped (digit groups like 4,000 or 2.4 joined); no articles."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    text = re.sub(r"(?<=\d)[.,](?=\d)", "", text)  # 4,000 -> 4000 ; 2.4 -> 24 on both sides alike
    text = re.sub(r"[^a-z0-9]+", " ", text)  # "$2.4 million" and "2.4 million" normalise alike
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def is_i_dont_know(answer: str) -> bool:
    return normalize_answer(answer) in ("i don t know", "i dont know", "i do not know")


# ----------------------------------------------------------------------------------------------
# Reading a text as facts
# ----------------------------------------------------------------------------------------------

MONTHS = {m: i for i, names in enumerate(["jan january", "feb february", "mar march", "apr april", "may",
                                          "jun june", "jul july", "aug august", "sep sept september",
                                          "oct october", "nov november", "dec december"], 1) for m in names.split()}
WEEKDAYS = {short: day for day in "monday tuesday wednesday thursday friday saturday sunday".split()
            for short in (day, day[:3], day[:4], day[:5])}
NUMBER_WORDS = {word: float(n) for n, words in enumerate([
    "", "one first", "two second", "three third", "four fourth", "five fifth", "six sixth", "seven seventh",
    "eight eighth", "nine ninth", "ten tenth", "eleven eleventh", "twelve twelfth"]) for word in words.split()}
SCALES = {"k": 1e3, "thousand": 1e3, "m": 1e6, "mm": 1e6, "mln": 1e6, "mil": 1e6, "million": 1e6, "millions": 1e6,
          "b": 1e9, "bn": 1e9, "billion": 1e9}
# Words that carry no fact of their own: grammar, hedges ("approximately 400 MW") and the units and nouns that
# frame a value ("room EB 552", "$4,800 per month").
STOPWORDS = frozenset("""a an the and or of to in on at for by with from as is are was were be been being it its
this that these those he she his her him they them their we our us you your i my me who what when where which how
whose whom why did does do has have had will would should could can may might shall there here than then so also
just only per each all any both either via about approximately approx around roughly nearly almost some
estimated est over under up more less least most total usd dollars dollar plus room rooms conference floor
suite bldg building number ext extension com net org www
""".split())
HEDGE = re.compile(r"\b(?:or|either|maybe|possibly|perhaps|probably|might)\b", re.I)
WEEKDAY_RE = (r"(?:mon(?:day)?|tue(?:s(?:day)?)?|wed(?:nesday)?|thu(?:r(?:s(?:day)?)?)?|fri(?:day)?|sat(?:urday)?|"
              r"sun(?:day)?)\.?")
MONTH_RE = r"(?:jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec)[a-z]*\.?"
DATE_PATTERNS = [  # (regex, month group, day group, year group)
    (re.compile(rf"\b({MONTH_RE})\s+(\d{{1,2}})(?:st|nd|rd|th)?\b(?:,?\s+(\d{{4}}))?", re.I), 1, 2, 3),
    (re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({MONTH_RE})(?:,?\s+(\d{{4}}))?", re.I), 2, 1, 3),
    (re.compile(r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b"), 2, 3, 1),
    (re.compile(r"\b(\d{1,2})[/-](\d{1,2})(?:[/-](\d{2}(?:\d{2})?))?\b"), 1, 2, 3),
]
TIME_RE = re.compile(r"\b(\d{1,2})(?::(\d{2}))?\s*(a\.?m\.?|p\.?m\.?|noon)(?![a-z])|\b(\d{1,2}):(\d{2})\b", re.I)
PHONE_RE = re.compile(r"(?:\(?\b\d{3}\)?[\s.-]*)?\b\d{3}[\s.-]\d{4}\b")
NUMBER_RE = re.compile(r"(?<![\w.])\$?((?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?)\s*(k|thousand|mm|mln|mil|million|"
                       r"millions|bn|billion|m|b)?(?![\w])", re.I)


@dataclass
class Facts:
    """What a text says, as comparable pieces."""

    numbers: set = field(default_factory=set)  # floats, and "date:MM-DD", "time:H:MM", "phone:NNNNNNN", codes
    years: set = field(default_factory=set)
    names: list = field(default_factory=list)  # stems of capitalised words, in order
    words: list = field(default_factory=list)  # stems of the other content words
    spelled: set = field(default_factory=set)  # numbers written as words ("six", "third")
    hedged: bool = False  # offers alternatives or doubts ("3 or 7", "maybe")
    count: int = 0  # numbers, dates, times, phones and codes read, repeats counted

    def stems(self) -> set:
        return set(self.names) | set(self.words)

    def add(self, value) -> None:
        self.numbers.add(value)
        self.count += 1

    def size(self) -> int:
        """How many facts and words the text says, repeats counted."""
        return self.count + len(self.names) + len(self.words)


def read_facts(text: str) -> Facts:
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    facts = Facts(hedged=bool(HEDGE.search(text)))
    text = _take(PHONE_RE, text, lambda m: facts.add("phone:" + re.sub(r"\D", "", m.group(0))[-7:]))
    text = _take(TIME_RE, text, lambda m: facts.add(_time(m)))
    for pattern, month, day, year in DATE_PATTERNS:
        text = _take(pattern, text, lambda m, mo=month, d=day, y=year: _date(m, mo, d, y, facts))
    text = re.sub(r"(?<=[A-Za-z])-(?=\d)|(?<=\d)-(?=[A-Za-z])", "", text)  # codes: "E-20T" = "E20T"
    text = re.sub(r"(?<=[A-Za-z])-(?=[A-Za-z])", "", text)  # "re-design" = "redesign"
    text = re.sub(r"(?<![\d])\.(?=\d)", "0.", text)  # "$.025" = "$0.025"
    text = re.sub(r"(?<!\d)[.,]|[.,](?!\d)", " ", text)  # "Kristin.Gandy", "Jones,Tana": two words; 4,800 one
    for word in re.findall(r"[A-Za-z0-9#&$.,%']+", text):
        _add_word(word, facts)
    return facts


def _take(pattern: re.Pattern, text: str, add) -> str:
    """Each match of `pattern` handed to `add` and blanked out, so its digits are not read again as numbers."""
    def blank(match):
        add(match)
        return " ; "
    return pattern.sub(blank, text)


def _time(match: re.Match) -> str:
    if match.group(4):
        hour, minute = int(match.group(4)), match.group(5)
    else:
        hour, minute = int(match.group(1)), match.group(2) or "00"
        if (match.group(3) or "").lower().startswith("noon"):
            hour = 12
    return f"time:{hour % 12 or 12}:{minute}"


def _date(match: re.Match, month: int, day: int, year: int, facts: Facts) -> None:
    raw_month = match.group(month)
    number = MONTHS.get(raw_month.lower().rstrip(".")[:3] if not raw_month.isdigit() else "", None)
    number = number or (int(raw_month) if raw_month.isdigit() else None)
    day_number = int(match.group(day))
    if not number or not 1 <= number <= 12 or not 1 <= day_number <= 31:
        for part in match.groups():  # not a date after all ("13/14"): its numbers stand as numbers
            if part and part.isdigit():
                facts.add(float(part))
        return
    facts.add(f"date:{number:02d}-{day_number:02d}")
    if match.group(year):
        y = int(match.group(year))
        facts.years.add(y + 2000 if y < 50 else y + 1900 if y < 100 else y)
        facts.count += 1


def _add_word(word: str, facts: Facts) -> None:
    token = word.strip(".,'")
    for match in NUMBER_RE.finditer(token if any(c.isdigit() for c in token) else ""):
        if match.group(1) and re.fullmatch(r"\$?[\d,.]+(?:k|thousand|mm|mln|mil|million|millions|bn|billion|m|b)?%?",
                                           token, re.I):
            value = float(match.group(1).replace(",", "")) * SCALES.get((match.group(2) or "").lower(), 1)
            if 1900 <= value <= 2030 and value == int(value) and "$" not in token and "," not in token:
                facts.years.add(int(value))
                facts.count += 1
            else:
                facts.add(round(value, 6))
            return
    lower = re.sub(r"[^a-z0-9&]", "", token.lower())
    if not lower:
        return
    ordinal = re.fullmatch(r"(\d+)(?:st|nd|rd|th)", lower)
    if ordinal or lower in NUMBER_WORDS:  # "3rd" = "third" = 3; "six people" = "6 people"
        if ordinal:
            facts.add(float(ordinal.group(1)))
        else:  # a number only where one is wanted: "one of them" names no number an answer could get wrong
            facts.spelled.add(NUMBER_WORDS[lower])
        return
    if any(c.isdigit() for c in lower):  # a code: "2FXQ7R", "K#36621" -> "k36621"
        facts.add(lower)
        return
    if lower in WEEKDAYS:  # a fact of its own: "Tuesday" does not answer "Monday"
        facts.add("day:" + WEEKDAYS[lower])
        return
    if lower in MONTHS:
        facts.words.append(f"month:{MONTHS[lower]}")
        return
    if lower in SCALES and facts.numbers:  # "$3.0 MM" read apart: the scale word joins the number before it
        last = max((n for n in facts.numbers if isinstance(n, float)), default=None)
        if last is not None and last < 1e5:
            facts.numbers.discard(last)
            facts.numbers.add(round(last * SCALES[lower], 6))
        return
    if lower in STOPWORDS:
        return
    (facts.names if token[:1].isupper() else facts.words).append(stem(lower))


def stem(word: str) -> str:
    """A light stemmer: plural and verb endings ("caverns", "submitting", "approved" -> "cavern", "submit",
    "approv"). A full stemmer (Porter's) reads "gas" as "ga"; names and codes must stay as written."""
    for suffix in ("ings", "ing", "ies", "ied", "es", "ed", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
            word = word[: -len(suffix)]
            break
    if len(word) > 3 and word[-1] == word[-2] and word[-1] not in "aeiouls":  # "submitt" -> "submit"
        word = word[:-1]
    return word


# ----------------------------------------------------------------------------------------------
# The gold answer's core
# ----------------------------------------------------------------------------------------------

TWO_THINGS = re.compile(r"\b(?:when|where|who|what|which|how|why)\b[^?]*\band\s+(?:for\s+|at\s+|on\s+|in\s+)?"
                        r"(?:when|where|who|whom|what|which|how|why)\b", re.I)
AND_THING = re.compile(r"\b(?:the\s+)?[\w-]+\s+and\s+(?:the\s+|its\s+|their\s+|his\s+|her\s+)?([a-z][\w-]*)\b"
                       r"(?=[^?]*\?)", re.I)  # "the dial-in and passcode"
COUNTED = re.compile(r"\b(?:two|three|four|five|six|seven|eight|nine|ten|both|all|each|every|list)\b", re.I)
CLAUSE_START = re.compile(r"^\s*(?:which|who|whose|due|because|from|effective|for|with|per|meet|extended|as|"
                          r"since|after|before|until|through|via|including|plus|but|not|at|in|on|to|each|a|an|the)"
                          r"\b", re.I)


def gold_core(gold: str, question: str) -> str:
    """The part of the gold answer that the question asks for (see the module's docstring)."""
    core = re.sub(r"\([^()]*\)", " ", gold) if re.sub(r"\([^()]*\)", "", gold).strip() else gold
    if not re.search(r"\b(?:phone|number|call|fax|cell|reach|dial|extension)\b", question, re.I):
        stripped = PHONE_RE.sub(" ", re.sub(rf"\s+(?:at|on)\s+(?={PHONE_RE.pattern})", " ", core)).strip(" ,;")
        core = stripped or core  # "Dana Eales at (330) 315-7429" answers "who?" as "Dana Eales"
    if name := _who_of(gold, question):  # "Rick Miles of FERC's ADR group" answers "who?" as "Rick Miles"
        return name
    parts = _top_level_commas(core)
    if len(parts) < 2 or TWO_THINGS.search(question) or COUNTED.search(question) or _is_list(parts) or \
            _names_a_second_thing_asked(parts[1:], question):
        return core
    if len(parts) == 2:  # "Linda Wicker, (281) 374-9557", "Constellation, for a ... position", "Portland, Colorado"
        return core if TIME_RE.search(parts[1]) else parts[0]  # "Saturday, Sept 15th, 8:00 AM to 5:00 PM": one when
    keep = [parts[0]]  # "Thursday, June 14, 2001, 10:00 AM - 11:00 AM, meet in the PLAZA ...": up to the clause
    for part in parts[1:]:
        if CLAUSE_START.match(part) or _is_phone_or_title(part):
            break
        keep.append(part)
    return ", ".join(keep)


def _asks_two(question: str) -> bool:
    """The question asks two things: "when and where", "the dial-in and passcode"."""
    return bool(TWO_THINGS.search(question)) or bool(AND_THING.search(question))


def _names_a_second_thing_asked(rest: list[str], question: str) -> bool:
    """A comma part of the gold answer named by what the question asks for after "and" ("What's the dial-in and
    passcode ...?" - "1-877-795-3687, passcode 824390"): asked, so not context."""
    asked = {stem(m.group(1).lower()) for m in AND_THING.finditer(question)}
    return any(asked & {stem(w.lower()) for w in re.findall(r"[A-Za-z][\w-]*", part)} for part in rest)


def _who_of(gold: str, question: str) -> str | None:
    """For "who?", a person's name and then where they are from ("Rick Miles of FERC's ADR group"): the name."""
    if not re.search(r"\bwho\b", question, re.I):
        return None
    name = r"[A-Z][a-z]+\.?\s+(?:[A-Z]\.\s+)?[A-Z][a-z]+(?:-[A-Z][a-z]+)?"  # "Rick Miles", "Mark E. Haedicke"
    match = re.match(rf"^\s*({name})\s+(?:of|from|at|with)\s+\S", gold)
    return match.group(1) if match else None


def list_items(core: str, question: str) -> list[str]:
    """The items of a gold answer that lists what the question asks for ("A, B and C", "A and B" when the
    question counts them or says both), else []."""
    parts = _top_level_commas(core)
    listed = (len(parts) >= 2 and _is_list(parts)) or bool(COUNTED.search(question))
    if not listed:
        return []
    items = [item for part in parts for item in re.split(r"\s+(?:and|&|or)\s+|^(?:and|&|or)\s+", part)]
    items = [item.strip() for item in items if item and item.strip()]
    return items if len(items) >= 2 else []


def _top_level_commas(text: str) -> list[str]:
    """Split at commas and semicolons that separate phrases, not inside a number ("4,800") or a date's year
    ("June 14, 2001")."""
    text = re.sub(rf"\b({WEEKDAY_RE}),", r"\1", text, flags=re.I)  # "Monday, May 27" is one date
    parts = re.split(r";|,(?!\s*\d{4}\b)(?!\d)", text)
    return [p.strip() for p in parts if p.strip()]


def _is_list(parts: list[str]) -> bool:
    """ "A, B and C", "A, B, & C", "a.com, b.com, c.com": every item is asked for."""
    last = re.split(r"\s+(?:and|&)\s+", parts[-1])  # "Brian L. Redmond and Jean M. Mrha": two items
    return bool(re.match(r"^(?:and|or|&)\b", parts[-1].strip(), re.I)) or \
        (len(last) >= 2 and all(len(p.split()) <= 4 for p in parts[:-1] + last)) or \
        (len(parts) >= 3 and all(len(p.split()) == 1 for p in parts))


def _is_phone_or_title(part: str) -> bool:
    return bool(PHONE_RE.search(part)) or bool(re.search(r"\b(?:chief|president|director|manager|officer|vp|vice|"
                                                          r"counsel|analyst|attorney|ext)\b", part, re.I))


# ----------------------------------------------------------------------------------------------
# The verdict
# ----------------------------------------------------------------------------------------------

NAMES_NEEDED = 0.75  # share of the core's names an answer must hold
PARTS_OF_DAY = {"morning", "afternoon", "evening", "night", "noon", "midnight", "lunch"}
WORDS_NEEDED = 0.5  # share of the core's other words
LONGEST = 3  # an answer of more than 3x the gold answer's facts (and 12 more) is a paste, not an answer


def offline_verdict(answer: str, gold: str, question: str = "") -> Verdict:
    """Is `answer` right, given the gold answer and the question? (See the module's docstring.)"""
    if not normalize_answer(gold):
        return Verdict(False, "offline", "empty gold answer")
    if is_i_dont_know(answer):
        return Verdict(False, "offline", "answered I don't know")
    asked, full, got = read_facts(question), read_facts(gold), read_facts(answer)
    core_text = gold_core(gold, question)
    wanted = _less_the_question(read_facts(core_text), asked, question)
    if got.size() > LONGEST * full.size() + 12:
        return Verdict(False, "offline", "gold answer buried in an over-long answer")
    items = list_items(core_text, question)
    problem = _numbers_problem(wanted, full, got, asked) or \
        _words_problem(wanted, full, got, both_asked=_asks_two(question)) or \
        _items_problem(items, got, asked) or (None if items else _other_names_problem(answer, wanted, full, asked))
    if problem:
        return Verdict(False, "offline", problem)
    if not (wanted.names or wanted.words or wanted.numbers or wanted.years):
        return Verdict(False, "offline", "nothing of the gold answer's core to find")
    return Verdict(True, "offline", "holds the gold answer's core" + (f" ({core_text!r})" if core_text != gold else ""))


def _numbers_problem(wanted: Facts, full: Facts, got: Facts, asked: Facts) -> str | None:
    """Every number, date, time, weekday, phone and code of the core in the answer (a weekday may give way to a
    date), no other year, and no number the gold answer lacks where it names numbers."""
    given = got.numbers | got.spelled
    dated = any(str(g).startswith("date:") for g in got.numbers)
    missing = [n for n in wanted.numbers if not _has_number(n, given) and not (str(n).startswith("day:") and dated)]
    if missing:
        return f"missing {_show(missing[0])}"
    if wanted.years and not wanted.years & got.years:
        if got.years:
            return f"another year ({_show(min(got.years))})"
        if not any(str(n).startswith("date:") for n in wanted.numbers):  # "Jan. 23" answers "Jan. 23, 2002"
            return f"missing {min(wanted.years)}"
    known = full.numbers | full.spelled | asked.numbers | asked.spelled
    foreign = [n for n in got.numbers if not _has_number(n, known) and str(n).split(":")[0] in ("date", "time")
               or isinstance(n, float) and not _has_number(n, known)]
    if foreign and got.hedged:  # extra detail is fine ("$600,000 and 4 FTEs"); a choice of answers is not
        return f"hedges between the gold answer and another ({_show(foreign[0])})"
    return None


def _words_problem(wanted: Facts, full: Facts, got: Facts, both_asked: bool = False) -> str | None:
    """Enough of the core's names (initials standing for them) and of its other words. Beside numbers the answer
    holds, names are units and labels ("1.5x" answers "1.5x NYMEX margin"), unless the question asks two things
    ("where and when": "Chicago, on December 4" needs Chicago); beside a date or time it holds, other words frame
    it ("Dec 15th" answers "weekend of Dec 15th") unless the answer names another part of the day."""
    names, gold_words = sorted(set(wanted.names)), full.stems()
    held = [n for n in names if _has_word(n, got, _initials(full.names), gold_words)]
    if names and (both_asked or not wanted.numbers) and len(held) < NAMES_NEEDED * len(names):
        return f"missing {', '.join(n for n in names if n not in held)}"
    words = sorted(set(wanted.words) - set(names))
    found = [w for w in words if _has_word(w, got, None, gold_words, name=False)]
    if any(str(n).split(":")[0] in ("date", "time", "day") for n in wanted.numbers):
        parts = {stem(w) for w in PARTS_OF_DAY}
        said, asked_for = set(got.words) & parts, set(words) & parts
        return f"another part of the day ({', '.join(sorted(said))})" if said and asked_for and not \
            said & asked_for else None
    if words and len(found) < WORDS_NEEDED * len(words):
        return f"missing {', '.join(w for w in words if w not in found)}"
    return None


def _items_problem(items: list[str], got: Facts, asked: Facts) -> str | None:
    """Each item of a list the question asks for ("Duke Energy, Gulf Energy, and Tejas") named by the answer:
    at least one of the words or numbers that set it apart from the other items ("Duke", "Gulf", "Tejas")."""
    read = [read_facts(item) for item in items]
    gold_words = set().union(*(f.stems() for f in read))
    for i, facts in enumerate(read):
        others = [f for j, f in enumerate(read) if j != i]
        own = [w for w in facts.stems() if w not in asked.stems() and all(w not in f.stems() for f in others)]
        own_numbers = [n for n in facts.numbers if all(not _has_number(n, f.numbers) for f in others)]
        if (own or own_numbers) and not (any(_has_word(w, got, _initials(facts.names), gold_words, w in facts.names)
                                             for w in own) or
                                         any(_has_number(n, got.numbers | got.spelled) for n in own_numbers)):
            return f"missing {items[i].strip()!r} of the items asked for"
    return None


def _other_names_problem(answer: str, wanted: Facts, full: Facts, asked: Facts) -> str | None:
    """A gold answer that names one thing, answered by it and another beside it ("Dan Hvyl and Charlie Otto" for
    "Charlie Otto"): a second candidate, not extra detail. Another item is all names, none of them the gold's or
    the question's."""
    if not wanted.names or wanted.numbers:
        return None
    known, initials = full.stems() | asked.stems(), _initials(full.names)
    for item in re.split(r"\s+(?:and|or|&)\s+|\s*[,;/]\s*", answer.strip()):
        facts = read_facts(item)
        if facts.names and not facts.words and not facts.numbers and not set(facts.names) & known and \
                not any(name in initials for name in facts.names):  # "NNG" is "Northern Natural Gas"
            return f"names another beside the gold answer ({item.strip()!r})"
    return None


def _less_the_question(core: Facts, asked: Facts, question: str) -> Facts:
    """The core less what the question already says; all of it when that would leave nothing, or when the
    question offers a choice ("the morning or the afternoon?": the restated word is the answer)."""
    core = Facts(numbers=core.numbers | core.spelled, years=set(core.years), names=core.names, words=core.words)
    if re.search(r"\bor\b", question, re.I):
        return core
    said = asked.stems()
    less = Facts(numbers={n for n in core.numbers if not _has_number(n, asked.numbers | asked.spelled)},
                 years=set(core.years), names=[n for n in core.names if n not in said],
                 words=[w for w in core.words if w not in said])
    return less if (less.numbers or less.names or less.words) else core


def _has_number(value, numbers: set) -> bool:
    if isinstance(value, float):
        return any(isinstance(n, float) and abs(n - value) <= 1e-6 * max(1.0, abs(value)) for n in numbers)
    return value in numbers


def _has_word(word: str, got: Facts, initials: dict | None = None, gold_words: set = frozenset(),
              name: bool = True) -> bool:
    """`word` in the answer: as written (by stem), by initials, and for a name by prefix ("Ken" ~ "Kenneth") or
    one typo apart in a long name ("Grisby" ~ "Grigsby"), but never through an answer word that is itself another
    word of the gold answer. Other words must match: "tlfcampbell" is not the user name "lfcampbell"."""
    stems = got.stems()
    if word in stems:
        return True
    if initials and any(s in initials and word in initials[s] for s in stems):
        return True
    if not name:
        return False
    loose = [s for s in stems if s not in gold_words]
    return len(word) >= 5 and any(len(s) >= 5 and _one_edit(word, s) for s in loose) or \
        len(word) >= 3 and any(len(s) >= 3 and (s.startswith(word) or word.startswith(s)) and
                               min(len(s), len(word)) >= 0.6 * max(len(s), len(word)) for s in loose)


def _initials(names: list[str]) -> dict:
    """Acronyms of runs of two to four names ("jacksonville electric authority" -> "jea": its three names)."""
    out = {}
    for size in (2, 3, 4):
        for i in range(len(names) - size + 1):
            run = names[i:i + size]
            out.setdefault("".join(n[0] for n in run), set()).update(run)
    return out


def _one_edit(a: str, b: str) -> bool:
    if abs(len(a) - len(b)) > 1 or a == b:
        return a == b
    if len(a) == len(b):
        diffs = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diffs) == 1 or (len(diffs) == 2 and diffs[1] == diffs[0] + 1 and
                                   a[diffs[0]] == b[diffs[1]] and a[diffs[1]] == b[diffs[0]])
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:g}" if value < 1e6 else f"{value:,.0f}"
    return str(value).split(":", 1)[-1]


def strict_verdict(answer: str, gold: str, question: str = "") -> Verdict:
    """The grader this project shipped before v2: the normalised gold answer, whole, as words of a reasonably
    short answer (closing words that restate the question may be left out), or every word of it in another
    order. It misses right answers that leave the gold answer's context out; kept to compare figures."""
    got, want = normalize_answer(answer), normalize_answer(gold)
    if not want or is_i_dont_know(answer):
        return Verdict(False, "offline", "empty gold answer" if not want else "answered I don't know")
    asked, words = normalize_answer(question).split(), want.split()
    core = words
    if "or" not in asked:
        while core and core[-1] in asked:
            core = core[:-1]
    forms = [want] + ([" ".join(core)] if core and len(core) < len(words) else [])
    found = next((form for form in forms if f" {form} " in f" {got} "), None)
    wanted, given = want.split(), got.split()
    numbers = {w for w in wanted if any(c.isdigit() for c in w)}
    reordered = len(wanted) >= 2 and set(wanted) <= set(given) and \
        all(w in numbers for w in given if any(c.isdigit() for c in w))
    if found is None and not reordered:
        return Verdict(False, "offline", "gold answer not in the answer")
    if len(got) > max(3 * len(found or want), len(found or want) + 60):
        return Verdict(False, "offline", "gold answer buried in an over-long answer")
    return Verdict(True, "offline", "gold answer found in the answer")
