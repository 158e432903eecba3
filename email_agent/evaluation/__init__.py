"""test_email_search_agent.py's stages: who plays, what their episodes add up to, and the report.

Modules:
  players  each --model resolved into a contestant served the way it was trained, checked and probed before it
           plays, and who plays when (`ask` and `serve` use it to serve a model too)
  serving  the servers one evaluation holds: one vLLM server per base model for CPU runs, ART's backend per run
  records  what one answer records in results.jsonl, and those records re-judged (--rejudge)
  scores   per-model accuracy, hallucination, turns, latency and cost; each episode's outcome; paired tests
  report_tables  the scores as tables (plain-text cells) and the notes that say how to read them
  report_html    report.html: those tables, charts, learning curves and every episode's trace, on one page
  report   summary.json, report.md and report.html written; the output folder made ready, an earlier one kept
"""
