"""The offline grader against the labelled real answers of data/grader-labels (bench/bench_grader.py prints the
same figures by split and set): the issue's targets, pinned on the held-out labels the grader was not tuned on."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_grader  # noqa: E402

from email_agent.agent.matcher import offline_verdict  # noqa: E402


@pytest.fixture(scope="module")
def labels():
    return bench_grader.read_labels(bench_grader.LABELS)


def test_the_label_set_is_real_labelled_and_split(labels):
    """At least 300 real answers from both question sets and several checkpoints, in rounds, each labelled by a named
    labeller, with both verdicts on both sides of the split, and no answer twice."""
    assert len(labels) >= 300
    assert len({r["source"].split(" (")[0] for r in labels}) >= 5  # checkpoints: warm@1, warm@5, pen2s0@5, ...
    assert {r["round"] for r in labels} >= {1, 2, 3}
    assert {r["set"] for r in labels} == {"enron", "demo", "generated"}
    assert all(r["labeller"] and r["source"] for r in labels)
    assert len({(r["set"], r["question_id"], r["answer"]) for r in labels}) == len(labels)
    for split in ("tune", "heldout"):
        side = [r for r in labels if r["split"] == split]
        assert len(side) >= 70 and {r["label"] for r in side} == {"accept", "reject"}


def test_the_grader_agrees_with_the_held_out_labels(labels):
    """>= 95% agreement and <= 2% of wrong answers accepted, on labels no rule was read from."""
    held = bench_grader.figures([r for r in labels if r["split"] == "heldout"], offline_verdict)
    assert held["agreement"] >= bench_grader.TARGET_AGREEMENT, held
    assert held["wrong_accepted"] <= bench_grader.TARGET_WRONG_ACCEPTED, held


def test_a_label_set_that_disagrees_with_its_questions_is_refused_in_one_sentence(labels, tmp_path):
    """A label made from another version of a question would grade nothing it claims to."""
    changed = dict(labels[0], gold=labels[0]["gold"] + " (changed)")
    path = tmp_path / "labels.jsonl"
    path.write_text(json.dumps(changed) + "\n")
    with pytest.raises(SystemExit, match=r"carries another question or gold answer than the set"):
        bench_grader.read_labels(path)


def test_the_bench_prints_both_graders_and_the_verdict_on_the_targets(capsys):
    bench_grader.main([])
    out = capsys.readouterr().out
    assert "offline matcher v1" in out and "offline matcher v2" in out
    assert "held out, offline matcher v2" in out and ": met" in out
