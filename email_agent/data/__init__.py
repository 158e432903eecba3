"""The inbox: emails and questions into one SQLite database, and the agent's view of it.

Modules, in the order data flows through them:
  mime       a raw email's headers and text body, whatever its encoding
  sources    every export read (Enron from the hub, mbox, Maildir, .eml, JSONL, Parquet), its records normalised
  enron_sample  the real-mail sample (29,997 Enron emails) picked out of the Hub's corpus or the CMU release by its
             manifest, and checked against it
  build      `build-db`: the Enron corpus, your own mail (mbox, Maildir, .eml, JSONL) or the demo inbox, into one
             database, built atomically, with its question sets
  demo       the bundled demo inbox (a company's mail and questions made from a seed, offline)
  generate   `generate-questions`: an LLM writes question/answer pairs for an inbox
  question_checks  which of them may be stored (cited, shown, dated after their emails, no near-duplicate), and
             the train/test split by groups of emails
  questions  questions read back, split and ordered for training and evaluation
  email_db   `EmailDB`: the database the agent's tools search and read (FTS5, per-inbox, as of a date)
"""
