"""Write manifest.json.xz, the real-mail sample's manifest, from the sample itself.

    python data/enron-sample/make_manifest.py                     # from ../shared/data/enron/emails.jsonl.gz
    python data/enron-sample/make_manifest.py --emails PATH       # another copy of it

The sample is ../shared/data/enron/emails.jsonl.gz (29,997 emails of 45 CMU `inbox` folders; its SOURCE.md says how
they were chosen and converted), the copy every real-mail figure of this project used. The manifest keeps, in the
sample's order (inbox folder, then file number), each email's message id and the digest of its body, and the
checksum over them (email_agent/data/enron_sample.py defines both); `build-db --enron-sample` picks the sample out of
Hugging Face's corbt/enron-emails or the CMU release with it. Nothing of an email but its id is in the repository.
The copy is checked against the sha256 SOURCE.md gives for it first: another file would make another manifest.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from email_agent.data.enron_sample import MANIFEST, write_manifest  # noqa: E402

SAMPLE = ROOT.parent / "shared" / "data" / "enron" / "emails.jsonl.gz"
SAMPLE_SHA256 = "ce04f1152627986b35314823aec08af7bf1cad0128895de3f1eef26d0cda56bc"  # SOURCE.md's, for emails.jsonl.gz


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--emails", type=Path, default=SAMPLE, help="the sample's emails.jsonl.gz")
    parser.add_argument("--output", type=Path, default=MANIFEST)
    args = parser.parse_args()
    digest = hashlib.sha256(args.emails.read_bytes()).hexdigest()
    if digest != SAMPLE_SHA256:
        raise SystemExit(f"{args.emails} has sha256 {digest}, not the sample's {SAMPLE_SHA256}")
    with gzip.open(args.emails, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    about = (f"The real-mail sample: {len(rows):,} emails of {len({r['inbox'] for r in rows})} CMU inbox folders "
             f"(emails.jsonl.gz, sha256 {SAMPLE_SHA256}). inboxes: folder -> [message_id, body digest] in the "
             f"sample's order; sha256: the checksum (email_agent/data/enron_sample.py). Written by "
             f"data/enron-sample/make_manifest.py.")
    manifest = write_manifest(rows, args.output, about)
    print(f"{args.output}: {len(manifest.digests):,} emails, {len(manifest.inboxes)} inboxes, checksum "
          f"{manifest.sha256}, {args.output.stat().st_size / 1000:.0f} kB")


if __name__ == "__main__":
    main()
