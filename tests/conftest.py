"""Shared fixtures: the demo database and, when ../shared/data/enron exists beside the checkout, the real
Enron sample (29,997 emails). Databases are built once per test session into a temporary folder."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import email_agent  # noqa: E402,F401  (offline environment defaults)
from email_agent import build, data, demo, questions  # noqa: E402

ENRON = ROOT.parent / "shared" / "data" / "enron"
ENRON_EMAILS = ENRON / "emails.jsonl.gz"
ENRON_QUESTIONS = ENRON / "questions.jsonl.gz"
needs_enron = pytest.mark.skipif(
    not ENRON_EMAILS.exists(),
    reason=f"the real Enron sample is not at {ENRON} (it lives beside the checkout, in shared/data/enron)")


@pytest.fixture(scope="session")
def demo_db_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "demo.db"
    emails, qs = demo.generate(seed=0)
    build.build_database(emails, qs, path, source="demo", progress=False)
    return path


@pytest.fixture(scope="session")
def demo_db(demo_db_path):
    db = data.EmailDB(demo_db_path)
    yield db
    db.close()


@pytest.fixture(scope="session")
def enron_db_path(tmp_path_factory) -> Path:
    if not ENRON_EMAILS.exists():
        pytest.skip(f"the real Enron sample is not at {ENRON}")
    path = tmp_path_factory.mktemp("enron") / "enron.db"
    build.build_database(data.read_emails(ENRON_EMAILS), questions.read_questions(ENRON_QUESTIONS), path,
                        source="enron sample", progress=False)
    return path


@pytest.fixture(scope="session")
def enron_db(enron_db_path):
    db = data.EmailDB(enron_db_path)
    yield db
    db.close()
