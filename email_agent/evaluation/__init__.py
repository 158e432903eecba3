"""test_email_search_agent.py's stages: what the episodes add up to, and the report (who plays, and on which
servers, is email_agent.models', which `ask` and `serve` share).

Modules:
  records  what one answer records in results.jsonl, and those records re-judged (--rejudge)
  scores   per-model accuracy, hallucination, turns, latency and cost; each episode's outcome; paired tests
  report_tables  the scores as tables (plain-text cells) and the notes that say how to read them
  report_html    report.html: those tables, charts, learning curves and every episode's trace, on one page
  report   summary.json, report.md and report.html written; the output folder made ready, an earlier one kept
"""
