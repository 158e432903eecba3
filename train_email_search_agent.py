"""Train an email search agent with reinforcement learning (the ART·E recipe).

    python train_email_search_agent.py build-db --demo          # the bundled demo inbox (offline)
    python train_email_search_agent.py build-db                 # the Enron corpus + ART·E questions from Hugging Face
    python train_email_search_agent.py search --inbox ADDRESS KEYWORD...   # the agent's search tool, for humans
    python train_email_search_agent.py read MESSAGE_ID          # the agent's read tool, for humans

Subcommands stay thin: each parses its flags, calls one function of the `email_agent` package and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

import email_agent  # noqa: F401  (sets offline-friendly environment defaults before litellm/ART load)
from email_agent.data import DataError, EmailDB

DEFAULT_DB = "data/enron_emails.db"
DEMO_DB = "data/demo.db"


# ----------------------------------------------------------------------------------------------
# build-db
# ----------------------------------------------------------------------------------------------

def build_db(args) -> None:
    from email_agent import data, questions

    db_path = args.db or (DEMO_DB if args.demo else DEFAULT_DB)
    total = None
    if args.demo:
        from email_agent import demo

        emails, question_rows = demo.generate(seed=0)
        total, source = len(emails), "demo inbox (email_agent/demo.py, seed 0)"
    else:
        if args.emails:
            emails, source = data.read_emails(args.emails), str(args.emails)
        else:
            emails, source = data.read_hub_emails(), "hf:corbt/enron-emails"
        if args.questions:
            question_rows = questions.read_questions(args.questions)
        elif args.emails:
            print("note: no --questions given; the database will hold emails only (nothing to train on).",
                  file=sys.stderr)
            question_rows = []
        else:
            question_rows = questions.read_hub_questions()
    if total is None and hasattr(emails, "__len__"):
        total = len(emails)
    print(f"building {db_path} from {source}", file=sys.stderr)
    summary = data.build_database(emails, question_rows, db_path, source=source, total=total,
                                  progress=not args.quiet)
    print("\n".join(summary.lines()))


# ----------------------------------------------------------------------------------------------
# search / read: exactly what the agent's tools return
# ----------------------------------------------------------------------------------------------

def search(args) -> None:
    from dataclasses import asdict

    db = EmailDB(args.db)
    try:
        results = db.search(args.inbox, args.keywords, from_address=args.from_address, to_address=args.to_address,
                            sent_after=args.after, sent_before=args.before,
                            visible_until=_visible_until(args.as_of), max_results=args.max_results)
    except ValueError as exc:  # a malformed --after/--before
        raise DataError(f"{exc}; dates are YYYY-MM-DD") from None
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2, ensure_ascii=False))
        return
    if not results:
        print("no matches")
    for i, r in enumerate(results, 1):
        print(f"{i:>2}. {r.date}  {r.from_address}  {r.subject}")
        print(f"    {r.message_id}")
        print(textwrap.indent(textwrap.fill(" ".join(r.snippet.split()), 100), "    "))


def _visible_until(as_of: str | None) -> str | None:
    from email_agent.data import day_after

    if as_of is None:
        return None
    try:
        return day_after(as_of)
    except ValueError:
        raise DataError(f"--as-of must be a date like 2001-05-31, not {as_of!r}") from None


def read(args) -> None:
    from dataclasses import asdict

    db = EmailDB(args.db)
    email = db.read(args.message_id, inbox=args.inbox, visible_until=_visible_until(args.as_of))
    if email is None:
        where = f" in the inbox of {args.inbox}" if args.inbox else ""
        raise DataError(f"No email with message_id {args.message_id!r}{where}.")
    if args.json:
        print(json.dumps(asdict(email), indent=2, ensure_ascii=False))
        return
    print(f"Message-ID: {email.message_id}\nDate: {email.date} UTC\nFrom: {email.from_address}")
    for label, addresses in (("To", email.to_addresses), ("Cc", email.cc_addresses), ("Bcc", email.bcc_addresses)):
        if addresses:
            print(f"{label}: {', '.join(addresses)}")
    print(f"Subject: {email.subject}\n\n{email.body}")


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------

def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("build-db", help="build the search database and question sets",
                       description="Build the SQLite/FTS5 email database (and its questions) atomically. "
                                   "Example: python train_email_search_agent.py build-db --demo")
    p.add_argument("--demo", action="store_true", help="the bundled, offline demo inbox (db: data/demo.db)")
    p.add_argument("--emails", metavar="PATH", help="local corpus: .jsonl(.gz), .parquet, a maildir folder or an mbox file "
                                                   "(default: Hugging Face corbt/enron-emails)")
    p.add_argument("--questions", metavar="PATH", help="local questions: .jsonl(.gz) or .parquet with the ART·E schema "
                                                      "(default: Hugging Face corbt/enron_emails_sample_questions)")
    p.add_argument("--db", metavar="PATH", help=f"output database (default {DEFAULT_DB}; with --demo {DEMO_DB})")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=build_db)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=DEFAULT_DB, metavar="PATH", help=f"database (default {DEFAULT_DB})")
    common.add_argument("--as-of", metavar="DATE", help="hide mail dated after DATE, as the agent does for a question "
                                                       "asked that day")
    common.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("search", parents=[common], help="search an inbox as the agent does",
                       description="Search one inbox with the agent's own search. All keywords must match; best "
                                   "match first. Example: python train_email_search_agent.py search --db data/demo.db "
                                   "--inbox maya.patel@larkspur.example budget review")
    p.add_argument("keywords", nargs="+", metavar="KEYWORD")
    p.add_argument("--inbox", required=True, metavar="ADDRESS", help="whose mail (sent or received) to search")
    p.add_argument("--from", dest="from_address", metavar="ADDRESS", help="only mail sent by ADDRESS")
    p.add_argument("--to", dest="to_address", metavar="ADDRESS", help="only mail sent to ADDRESS (to/cc/bcc)")
    p.add_argument("--after", metavar="DATE", help="only mail sent on or after DATE (YYYY-MM-DD)")
    p.add_argument("--before", metavar="DATE", help="only mail sent before DATE (YYYY-MM-DD)")
    p.add_argument("--max-results", type=int, default=10, metavar="N",
                   help="number of results (default 10, clamped to 1..20)")
    p.set_defaults(func=search)

    p = sub.add_parser("read", parents=[common], help="read one email as the agent does",
                       description="Print one email with its recipients. Example: python train_email_search_agent.py "
                                   "read --db data/demo.db '<demo.000001@larkspur.example>'")
    p.add_argument("message_id", metavar="MESSAGE_ID")
    p.add_argument("--inbox", metavar="ADDRESS", help="only if ADDRESS sent or received it")
    p.set_defaults(func=read)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        args.func(args)
    except DataError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
