"""test_email_search_agent.py's stages: who plays, what their episodes add up to, and the report.

Modules:
  players  each --model resolved and served the way it was trained (one vLLM server for a CPU run's checkpoints),
           probed before it plays, and what one answer records (`ask` and `serve` use it to serve a model too)
  scores   per-model accuracy, hallucination, turns, latency and cost; each episode's outcome; paired tests
  report_tables  the scores as tables (plain-text cells) and the notes that say how to read them
  report_html    report.html: those tables, charts, learning curves and every episode's trace, on one page
  report   summary.json, report.md and report.html written; the output folder made ready, an earlier one kept
"""
