"""Real mail exports (Gmail Takeout mbox, Thunderbird folders, maildir, Outlook HTML) into records.

Every fixture is written by the tests from the raw bytes real clients produce; none is committed."""

import base64
import email
import email.policy
import quopri

import pytest

from email_agent.data import sources
from email_agent.data.build import build_database
from email_agent.errors import UserError
from email_agent.data.email_db import EmailDB
from email_agent.data.sources import normalize_email
from email_agent.data.mime import decode_bytes, decode_header, html_to_text, message_body


def crlf(text: str) -> bytes:
    return text.replace("\n", "\r\n").encode("ascii")


def b64(data: bytes) -> str:
    return base64.encodebytes(data).decode()


def qp(text: str, charset="utf-8") -> str:
    return quopri.encodestring(text.encode(charset)).decode()


# Gmail Takeout: CRLF, X-GM-* headers, multipart/alternative, base64 subjects with emoji, encoded display names.
GMAIL_ALTERNATIVE = crlf(f"""From 1790000000000000001@xxx Tue Jan 09 10:00:00 +0000 2024
X-GM-THRID: 1790000000000000001
X-Gmail-Labels: Inbox,Important
Message-ID: <CAF1@mail.gmail.com>
Date: Tue, 9 Jan 2024 11:00:00 +0100
From: =?UTF-8?Q?M=C3=BCller=2C_J=C3=B6rg?= <joerg@example.de>
To: "Ana" <ana@example.com>
Subject: =?UTF-8?B?{base64.b64encode('Grüße aus Köln 🎉'.encode()).decode()}?=
MIME-Version: 1.0
Content-Type: multipart/alternative; boundary="b1"

--b1
Content-Type: text/plain; charset="UTF-8"
Content-Transfer-Encoding: quoted-printable

{qp("Die Übergabe ist am Freitag um 14 Uhr im Büro.")}
--b1
Content-Type: text/html; charset="UTF-8"
Content-Transfer-Encoding: quoted-printable

{qp("<div>Die <b>Übergabe</b> ist am Freitag um 14 Uhr im Büro.</div>")}
--b1--

""")

RECEIPT_HTML = '''<html><head><style>p {color: red}</style><title>Receipt</title></head><body>
<script>var tracking = "zzsecretzz";</script><p>Danke f\u00fcr Ihren Einkauf&nbsp;&amp; bis bald!</p>
<table><tr><td>Kaffeem\u00fchle</td><td>89,00 &euro;</td></tr><tr><td>Filter</td><td>4,50 &euro;</td></tr></table>
Line one<br>Line two</body></html>'''

# HTML only, latin-1, base64: style/script hidden, entities decoded, table rows and breaks kept.
HTML_ONLY = crlf(f"""From 1790000000000000002@xxx Wed Jan 10 10:00:00 +0000 2024
Message-ID: <CAF2@mail.gmail.com>
Date: Wed, 10 Jan 2024 09:00:00 +0000
From: billing@shop.example
To: ana@example.com
Subject: Your receipt
Content-Type: text/html; charset=ISO-8859-1
Content-Transfer-Encoding: base64

{b64(RECEIPT_HTML.encode('latin-1', errors='replace'))}
""")

# Outlook: multipart/mixed, Windows-1252 smart quotes in quoted-printable HTML with Office markup, a PDF and a
# text attachment (neither is the body), and a forwarded message attached as message/rfc822.
OUTLOOK_HTML = ('<html xmlns:o="urn:schemas-microsoft-com:office:office"><head><!--[if gte mso 9]><xml>junk</xml>'
                '<![endif]--></head><body><p class=MsoNormal>The \u201cAtlas\u201d budget is $12,400.<o:p></o:p></p>'
                '<p class=MsoNormal><o:p>&nbsp;</o:p></p><p class=MsoNormal>Regards, Sam<o:p></o:p></p></body></html>')
OUTLOOK_MIXED = crlf(f"""From sam@corp.example Thu Jan 11 08:00:00 2024
Message-ID: <DM6PR01@outlook.com>
Date: Thu, 11 Jan 2024 08:00:00 -0500
From: "Sam Lee" <Sam.Lee@corp.example>
To: ana@example.com
Cc: =?windows-1252?Q?Ren=E9e_O=92Hara?= <renee@corp.example>
Subject: =?Windows-1252?Q?FW:_=93Atlas=94_budget?=
Content-Type: multipart/mixed; boundary="outer"

--outer
Content-Type: multipart/alternative; boundary="inner"

--inner
Content-Type: text/html; charset="Windows-1252"
Content-Transfer-Encoding: quoted-printable

{qp(OUTLOOK_HTML, 'cp1252')}
--inner--

--outer
Content-Type: application/pdf; name="budget.pdf"
Content-Disposition: attachment; filename="budget.pdf"
Content-Transfer-Encoding: base64

{b64(b'%PDF-1.4 zzpdfzz')}
--outer
Content-Type: text/plain; name="notes.txt"
Content-Disposition: attachment; filename="notes.txt"

zzattachmentzz should never be the body
--outer
Content-Type: message/rfc822

Message-ID: <old@corp.example>
Subject: the forwarded one
Content-Type: text/plain

zzforwardedzz
--outer--

""")

# A wrong charset name (UTF-8 bytes inside), raw 8-bit latin-1 in a header, and no Message-ID (a draft).
ODD_CHARSETS = ("From draft Fri Jan 12 08:00:00 2024\n"
                "Date: Fri, 12 Jan 2024 08:00:00 +0000\nFrom: ana@example.com\nTo: bo@example.com\n"
                "Subject: Gr\u00fc\u00dfe vom Caf\u00e9\n"
                "Content-Type: text/plain; charset=x-no-such-charset\nContent-Transfer-Encoding: 8bit\n\n").encode(
                    "latin-1") + "Café crème at 9, naïve plan.\n".encode("utf-8")


def mbox(*messages: bytes) -> bytes:
    return b"\n".join(m.rstrip(b"\r\n") + b"\n" for m in messages)


def records(path):
    return {r["message_id"]: r for r in (normalize_email(x) for x in sources.read_emails(path))}


def test_gmail_takeout_mbox(tmp_path):
    path = tmp_path / "All mail Including Spam and Trash.mbox"
    undated = (b"From me@example.com Thu Jan 11 10:00:00 2024\nMessage-ID: <undated@x>\nFrom: me@example.com\n"
               b"To: ana@example.com\nSubject: no Date header\n\nA draft.\n")
    path.write_bytes(mbox(GMAIL_ALTERNATIVE, HTML_ONLY, OUTLOOK_MIXED, ODD_CHARSETS, undated))
    rows = records(path)
    assert len(rows) == 5
    assert rows["<undated@x>"]["date"] == "2024-01-11 10:00:00"  # from the mbox separator line
    gmail = rows["<CAF1@mail.gmail.com>"]
    assert gmail["subject"] == "Grüße aus Köln 🎉"
    assert gmail["from_address"] == "joerg@example.de" and gmail["to"] == ["ana@example.com"]
    assert gmail["body"] == "Die Übergabe ist am Freitag um 14 Uhr im Büro."  # the plain part, not both
    assert gmail["date"] == "2024-01-09 10:00:00"
    receipt = rows["<CAF2@mail.gmail.com>"]["body"]
    assert "Danke für Ihren Einkauf & bis bald!" in receipt and "Kaffeemühle 89,00 €" in receipt
    assert "Line one\nLine two" in receipt
    assert "zzsecretzz" not in receipt and "color" not in receipt and "Receipt" not in receipt
    outlook = rows["<DM6PR01@outlook.com>"]
    assert outlook["subject"] == "FW: “Atlas” budget"
    assert outlook["body"] == "The “Atlas” budget is $12,400.\n\nRegards, Sam"
    assert outlook["from_address"] == "sam.lee@corp.example" and outlook["cc"] == ["renee@corp.example"]
    draft = next(r for mid, r in rows.items() if mid.endswith("@no-message-id>"))
    assert draft["subject"] == "Grüße vom Café" and draft["body"].strip() == "Café crème at 9, naïve plan."
    assert records(path).keys() == rows.keys()  # the made-up id is stable across imports


def test_thunderbird_profile_and_nested_maildirs(tmp_path):
    tb = tmp_path / "export" / "Local Folders"
    (tb / "Archives.sbd" / "2024.sbd").mkdir(parents=True)
    (tb / "Inbox").write_bytes(mbox(GMAIL_ALTERNATIVE))
    (tb / "Inbox.msf").write_bytes(b"// <!-- <mdb:mork:z v=\"1.4\"/> -->\n< <(a=c)> // (f=iso-8859-1)")
    (tb / "Trash").write_bytes(b"")  # an empty folder
    (tb / "Archives.msf").write_bytes(b"junk")
    (tb / "filterlog.html").write_bytes(b"<html><body>filter log</body></html>")
    (tb / "msgFilterRules.dat").write_bytes(b'version="9"\nlogging="no"\n')
    (tb / "Archives.sbd" / "2024").write_bytes(mbox(HTML_ONLY))
    (tb / "Archives.sbd" / "2024.sbd" / "Receipts").write_bytes(mbox(HTML_ONLY, OUTLOOK_MIXED))  # HTML_ONLY twice
    md = tmp_path / "export" / "Maildir"
    for sub in ("cur", "new", "tmp", ".Sent/cur", ".Sent/new", ".Sent/tmp", ".Work.Projects/cur"):
        (md / sub).mkdir(parents=True)
    (md / "cur" / "1704790800.M1P1.host:2,S").write_bytes(ODD_CHARSETS.split(b"\n", 1)[1])
    (md / "tmp" / "1704790801.M2P2.host").write_bytes(b"Message-ID: <half@x>\nDate: Fri, 12 Jan 2024")
    (md / ".Sent" / "new" / "1704790802.M3P3.host").write_bytes(
        b"Message-ID: <sent@x>\nDate: Sat, 13 Jan 2024 10:00:00 +0000\nFrom: ana@example.com\nTo: z@x\n"
        b"Subject: sent\n\nSent from maildir++.\n")
    (md / ".Work.Projects" / "cur" / "1704790803.M4P4.host:2,").write_bytes(
        b"Message-ID: <work@x>\nDate: Sun, 14 Jan 2024 10:00:00 +0000\nFrom: q@x\nTo: ana@example.com\n"
        b"Subject: work\n\nNested folder mail.\n")
    for junk in ("dovecot-uidlist", "maildirfolder", ".DS_Store", "dovecot.index.log",
                 # a --db kept in the folder: its build's temporary file, its journal, its question cache
                 "me.db.tmp-4242", "me.db-journal", "me.db.questions-cache.jsonl"):
        (md / junk).write_bytes(b"3 V1 N1\n")
    (md / ".Sent" / "maildirfolder").write_bytes(b"")
    summary = build_database(sources.read_emails(tmp_path / "export"), [], tmp_path / "tb.db", source="t",
                             progress=False)
    assert summary.emails == 6 and summary.duplicates == 1 and summary.skipped == {}
    db = EmailDB(tmp_path / "tb.db")
    try:
        assert db.read("<half@x>") is None  # tmp/ holds unfinished deliveries
        assert db.read("<work@x>").file_name == "export/Maildir/.Work.Projects/cur/1704790803.M4P4.host:2,"
        assert db.read("<DM6PR01@outlook.com>").file_name == "export/Local Folders/Archives.sbd/2024.sbd/Receipts#1"
        hits = db.search("ana@example.com", ["Kaffeemühle"])
        assert [h.message_id for h in hits] == ["<CAF2@mail.gmail.com>"]
        assert (db.search("ana@example.com", ["zzattachmentzz"]) == []
                and db.search("ana@example.com", ["zzpdfzz"]) == [])
        assert db.search("ana@example.com", ["zzforwardedzz"]) == []
        assert [h.message_id for h in db.search("ana@example.com", ["Atlas", "budget"])] == ["<DM6PR01@outlook.com>"]
    finally:
        db.close()


def test_single_eml_and_outlook_archives(tmp_path):
    (tmp_path / "one.eml").write_bytes(OUTLOOK_MIXED.split(b"\r\n", 1)[1])
    assert list(records(tmp_path / "one.eml")) == ["<DM6PR01@outlook.com>"]
    (tmp_path / "Outlook.pst").write_bytes(b"!BDN....")
    with pytest.raises(UserError, match="Outlook archive.*export the folders as mbox"):
        sources.read_emails(tmp_path / "Outlook.pst")


@pytest.mark.parametrize("payload,charset,expected", [
    ("naïve".encode("utf-8"), "utf-8", "naïve"),
    ("naïve".encode("latin-1"), "iso-8859-1", "naïve"),
    ("“quoted”".encode("cp1252"), "windows-1252", "“quoted”"),
    ("Привет".encode("koi8-r"), "koi8-r", "Привет"),
    ("naïve".encode("utf-8"), "us-ascii", "naïve"),  # mislabelled: UTF-8 is tried next
    ("naïve".encode("utf-8"), "no-such-charset", "naïve"),  # a bad charset name
    ("caf\xe9".encode("latin-1"), None, "café"),  # undeclared 8-bit: cp1252
    (b"\x81\xff", "utf-8", "\ufffdÿ"),  # undecodable: replacement characters, never an exception
])
def test_decode_bytes(payload, charset, expected):
    assert decode_bytes(payload, charset) == expected


def test_a_multipart_message_without_its_boundary_keeps_its_text():
    broken = email.message_from_bytes(b"Message-ID: <x@y>\nContent-Type: multipart/mixed\n\nThe text, unsplit.\n",
                                      policy=email.policy.compat32)
    assert message_body(broken) == "The text, unsplit."


def test_decode_header_and_html():
    assert decode_header("=?iso-8859-1?q?J=F6rg?= =?utf-8?b?w6TDtsO8?= und mehr") == "Jörgäöü und mehr"
    assert decode_header("=?x-bogus?q?abc?= plain") == "abc plain"
    assert decode_header("=?utf-8?q?broken") == "=?utf-8?q?broken"
    assert html_to_text("<ul><li>one</li><li>two &lt;3</li></ul><p>a&nbsp;b</p>") == "- one\n- two <3\n\na b"
