"""The offline grader against labelled real answers: agreement with a judge's verdicts, and how many wrong answers
it accepts.

    python bench/bench_grader.py                          # the labels in data/grader-labels/labels.jsonl
    python bench/bench_grader.py --rejudge eval/enron/seed-0/report   # an evaluation's figures by both graders
    python bench/bench_grader.py --show heldout           # every disagreement of the held-out labels

Each label is a real agent answer to a real question (the real-mail set, the demo, a set `generate-questions`
wrote), judged accept or reject by ART·E's judge rule (data/grader-labels/README.md). For the current grader
(`matcher.offline_verdict`) and the one shipped before it (`matcher.strict_verdict`), per split (`tune`: the
labels the rules were read from; `heldout`: never tuned on), per set and per round of labelling (round 1: the
labels the grader was written beside; later rounds: answers labelled after it was frozen, from other checkpoints,
every one unseen while tuning): agreement (share of labels the grader's verdict matches), wrong answers accepted
(share of the `reject` labels it accepts; the target is <= 2%) and right answers found (share of the `accept`
labels it accepts). Targets: >= 95% agreement and <= 2% wrong answers accepted on the held-out labels.

--rejudge DIR regrades an evaluation's saved answers (its results.jsonl) with both graders, no model run: each
model's right and hallucinated shares, as the evaluation counts them (over every question; "I don't know", out of
turns and errors are neither).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from email_agent.agent.matcher import GRADER, STRICT_GRADER, is_i_dont_know, offline_verdict, strict_verdict

LABELS = ROOT / "data" / "grader-labels" / "labels.jsonl"
ENRON_QUESTIONS = ROOT / "data" / "enron-questions" / "questions.jsonl"
GENERATED_QUESTIONS = ROOT / "data" / "generated-questions" / "questions.jsonl"
TARGET_AGREEMENT, TARGET_WRONG_ACCEPTED = 0.95, 0.02
GRADERS = {GRADER: offline_verdict, STRICT_GRADER: strict_verdict}


def read_labels(path: Path) -> list[dict]:
    if not path.is_file():
        raise SystemExit(f"{path}: no labels there (data/grader-labels/README.md says how they are made)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    unlabelled = [r for r in rows if r.get("label") not in ("accept", "reject")]
    if unlabelled:
        raise SystemExit(f"{path}: {len(unlabelled)} answers have no accept/reject label (first: "
                         f"{unlabelled[0]['set']} {unlabelled[0]['question_id']})")
    problem = disagreement_with_questions(rows)
    if problem:
        raise SystemExit(f"{path}: {problem}")
    return rows


def question_sets() -> dict[str, dict[str, tuple[str, str]]]:
    """Each set's questions by id: (question, gold answer), as the labels must carry them."""
    from email_agent.data import demo

    def read(path: Path) -> dict[str, tuple[str, str]]:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {str(q["id"]): (q["question"], q["answer"]) for q in rows}

    return {"enron": read(ENRON_QUESTIONS), "generated": read(GENERATED_QUESTIONS),
            "demo": {str(q["id"]): (q["question"], q["answer"]) for q in demo.generate()[1]}}


def disagreement_with_questions(rows: list[dict]) -> str | None:
    """One sentence on the first label whose question or gold answer is not its set's (a label set made from
    another version of the questions grades nothing it claims to), else None."""
    sets = question_sets()
    for r in rows:
        known = sets.get(r["set"], {}).get(str(r["question_id"]))
        if known is None:
            return f"label of {r['set']} question {r['question_id']} names a question its set does not have"
        if known != (r["question"], r["gold"]):
            return (f"label of {r['set']} question {r['question_id']} carries another question or gold answer than "
                    f"the set ({r['gold']!r} vs {known[1]!r}); collect the answers again from the current questions")
    return None


def figures(rows: list[dict], grade) -> dict:
    accepted = [grade(r["answer"], r["gold"], r["question"]).correct for r in rows]
    right = [a for a, r in zip(accepted, rows) if r["label"] == "accept"]
    wrong = [a for a, r in zip(accepted, rows) if r["label"] == "reject"]
    agree = sum(a == (r["label"] == "accept") for a, r in zip(accepted, rows))
    return {"n": len(rows), "agreement": agree / len(rows) if rows else None,
            "right_found": sum(right) / len(right) if right else None, "n_right": len(right),
            "wrong_accepted": sum(wrong) / len(wrong) if wrong else None, "n_wrong": len(wrong)}


def pct(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def print_agreement(rows: list[dict]) -> dict:
    print(f"{len(rows)} labelled answers ({sum(r['label'] == 'accept' for r in rows)} accept); by split and set:\n")
    print(f"{'grader':<52}{'labels':<22}{'n':>5}{'agreement':>11}{'right found':>13}{'wrong accepted':>16}")
    results = {}
    for name, grade in GRADERS.items():
        groups = defaultdict(list)
        for r in rows:
            groups[r["split"]].append(r)
            groups[f"{r['split']} / {r['set']}"].append(r)
            groups[f"round {r.get('round', 1)}"].append(r)
        for key in sorted(groups, key=lambda k: (not k.startswith("heldout"), k.startswith("round"), k)):
            f = figures(groups[key], grade)
            results[(name, key)] = f
            print(f"{name:<52}{key:<22}{f['n']:>5}{pct(f['agreement']):>11}"
                  f"{pct(f['right_found']) + ' of ' + str(f['n_right']):>13}"
                  f"{pct(f['wrong_accepted']) + ' of ' + str(f['n_wrong']):>16}")
    held = results.get((GRADER, "heldout"))
    if held:
        met = held["agreement"] >= TARGET_AGREEMENT and (held["wrong_accepted"] or 0) <= TARGET_WRONG_ACCEPTED
        print(f"\nheld out, {GRADER}: agreement {pct(held['agreement'])} (target >= {TARGET_AGREEMENT:.0%}), wrong "
              f"answers accepted {pct(held['wrong_accepted'])} (target <= {TARGET_WRONG_ACCEPTED:.0%}): "
              f"{'met' if met else 'NOT met'}")
    for key in sorted(k for n, k in results if n == GRADER and k.startswith("round ") and k != "round 1"):
        fresh = results[(GRADER, key)]
        print(f"{key} (answers labelled after round 1; the first, blind measurement of each round is in "
              f"bench/RESULTS.md), {GRADER}: agreement "
              f"{pct(fresh['agreement'])} of {fresh['n']}, wrong answers accepted {pct(fresh['wrong_accepted'])} of "
              f"{fresh['n_wrong']}")
    return results


def show(rows: list[dict], which: str) -> None:
    print(f"\ndisagreements of {GRADER} on {'round ' if which.isdigit() else ''}{which}:")
    for r in rows:
        if which in (r["split"], str(r.get("round", 1))):
            verdict = offline_verdict(r["answer"], r["gold"], r["question"])
            if verdict.correct != (r["label"] == "accept"):
                print(f"  [{r['label']}] {r['set']} {r['question_id']}: Q {r['question']!r}\n      gold {r['gold']!r}\n"
                      f"      answer {r['answer']!r}\n      grader: {verdict.reasoning}")


def rejudge(folder: Path) -> None:
    """An evaluation's right and hallucinated shares by both graders, from its saved answers."""
    results = folder / "results.jsonl"
    if not results.is_file():
        raise SystemExit(f"--rejudge {folder}: no results.jsonl there (an evaluation's output folder)")
    counts = defaultdict(lambda: defaultdict(int))
    for line in results.read_text().splitlines():
        r = json.loads(line)
        counts[r["model"]]["n"] += 1
        answer = r.get("answer")
        if not answer or is_i_dont_know(answer) or r.get("error"):
            continue
        for name, grade in GRADERS.items():
            counts[r["model"]][name] += grade(answer, r["gold_answer"], r["question"]).correct
        counts[r["model"]]["answered"] += 1
    print(f"{folder}: right / hallucinated by each grader (answers as the evaluation let them stand)")
    for model, c in counts.items():
        line = "; ".join(f"{name}: {c[name] / c['n']:.1%} right / {(c['answered'] - c[name]) / c['n']:.1%} halluc."
                         for name in GRADERS)
        print(f"  {model} (n={c['n']}): {line}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", type=Path, default=LABELS)
    parser.add_argument("--show", help="print each disagreement of that split (tune, heldout) or round (2, 3, ...)")
    parser.add_argument("--rejudge", type=Path, nargs="+", metavar="DIR", help="evaluations' folders to regrade")
    args = parser.parse_args(argv)
    if args.rejudge:
        for folder in args.rejudge:
            rejudge(folder)
        return
    rows = read_labels(args.labels)
    print_agreement(rows)
    if args.show:
        show(rows, args.show)


if __name__ == "__main__":
    main()
