"""The demo inbox's world: Larkspur Energy's people, partners, projects and vocabulary (all invented), and the
small helpers that write its mail (dates, greetings, signatures, replies and forwards). `demo` builds the
scenarios, the emails and the questions from them.
"""

from __future__ import annotations

import random
from datetime import date, datetime, timedelta

COMPANY = "Larkspur Energy"
DOMAIN = "larkspur.example"
START, END = date(2024, 1, 8), date(2024, 6, 28)
TEST_SHARE = 0.4
# Locale-independent names: strftime's %A/%B follow LC_TIME.
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]


def _person(name: str, title: str, domain: str = DOMAIN, org: str = COMPANY) -> dict:
    first, last = name.split()
    return {"name": name, "first": first, "title": title, "org": org, "addr": f"{first}.{last}@{domain}".lower(),
            "folder": f"{last}-{first[0]}".lower()}


# The six inboxes questions are asked about, then colleagues who appear in their mail.
OWNERS = [_person("Maya Okafor", "Gas Trading Manager"), _person("Daniel Reyes", "Logistics Director"),
          _person("Priya Natarajan", "Senior Project Engineer"), _person("Tom Whitfield", "Finance Lead"),
          _person("Elena Sorensen", "Regulatory Affairs Manager"),
          _person("Marcus Bell", "Business Development Manager")]
STAFF = [_person("Grace Lin", "Chief Financial Officer"), _person("Victor Alvarez", "VP Operations"),
         _person("Hannah Cho", "Operations Analyst"), _person("Omar Haddad", "Facilities Manager"),
         _person("Sofia Marchetti", "HR Business Partner"), _person("Ben Kowalski", "IT Systems Administrator")]
CFO = STAFF[0]
PARTNERS = [_person("Ruth Adair", "Commercial Manager", "northwindgas.example", "Northwind Gas"),
            _person("Felix Moreau", "Account Director", "bluepeak-logistics.example", "Bluepeak Logistics"),
            _person("Nadia Brennan", "Chartering Manager", "harborline.example", "Harborline Shipping"),
            _person("Owen Tate", "Origination Lead", "cedarridgepower.example", "Cedar Ridge Power"),
            _person("Lucia Ferraro", "Sales Manager", "ironwoodrail.example", "Ironwood Rail"),
            _person("Jonas Lindqvist", "Terminal Manager", "saltmarsh-storage.example", "Saltmarsh Storage")]
TRAVEL = {"name": "Summit Travel", "first": "Summit", "title": "Bookings", "org": "Summit Travel",
          "addr": "bookings@summittravel.example"}
PEOPLE = {p["addr"]: p for p in OWNERS + STAFF + PARTNERS + [TRAVEL]}
ALL_STAFF = f"all-staff@{DOMAIN}"

PROJECTS = ["Falcon", "Heron", "Osprey", "Kestrel", "Condor", "Plover", "Merlin", "Egret", "Harrier", "Petrel",
            "Curlew", "Avocet", "Lapwing", "Godwit", "Dunlin", "Shrike", "Bittern", "Warbler", "Sandpiper", "Gannet"]
MEETING_KINDS = ["design review", "kickoff", "steering committee", "safety walkthrough", "vendor sync",
                 "risk workshop", "status review", "planning session"]
ROOMS = ["Room 2A", "Room 3C", "Room 4B", "Room 5D", "Room 6F", "Cedar Room", "Boardroom 7", "Harbor Room"]
SLOTS = [(9, 0), (9, 30), (10, 0), (10, 30), (11, 0), (13, 0), (13, 30), (14, 0), (14, 30), (15, 0), (16, 0)]
CITIES = ["Denver", "Calgary", "Rotterdam", "Aberdeen", "Tulsa", "Pittsburgh", "Oslo", "Singapore", "Boston",
          "Omaha", "Anchorage", "Lisbon", "Edmonton", "Midland", "Hamburg", "Perth", "Bismarck", "Glasgow"]
HOTEL_NAMES = ["Harbor View", "Granite Peak", "Riverside", "Old Mill", "Copper Lantern", "North Star", "Juniper",
               "Bayside", "Meridian", "Lakeshore", "Ironbridge", "Station House", "Bluebell", "Foxglove",
               "Saltwind", "Highgate", "Larchmont", "Kingfisher"]
HOTEL_KINDS = ["Hotel", "Inn", "Suites", "Lodge"]
AIRLINES = [("Skyline Air", "SK"), ("Northway Airlines", "NX"), ("Bluewing", "BW")]
# deal name -> (price unit, price range in cents, volumes to pick from)
DEAL_TYPES = {
    "gas supply agreement": ("/MMBtu", (280, 420), [f"{v:,} MMBtu/day" for v in range(10000, 60001, 5000)]),
    "storage lease": ("/MMBtu", (25, 60), [f"{v / 10:.1f} Bcf" for v in range(5, 31)]),
    "freight contract": (" per tonne", (3000, 6000), [f"{v:,} tonnes/month" for v in range(5000, 30001, 2500)]),
    "pipeline capacity deal": ("/MMBtu", (15, 45), [f"{v:,} MMBtu/day" for v in range(20000, 90001, 5000)]),
    "power purchase agreement": ("/MWh", (4000, 7000), [f"{v} MW" for v in range(25, 201, 5)]),
    "railcar lease": (" per car per month", (90000, 140000), [f"{v} railcars" for v in range(20, 121, 5)]),
}
# What each partner plausibly trades with us (pairs only need to be unique within one inbox).
PARTNER_DEALS = {
    "Northwind Gas": ["gas supply agreement", "storage lease", "pipeline capacity deal"],
    "Bluepeak Logistics": ["freight contract", "railcar lease"],
    "Harborline Shipping": ["freight contract", "storage lease"],
    "Cedar Ridge Power": ["power purchase agreement", "gas supply agreement", "pipeline capacity deal"],
    "Ironwood Rail": ["railcar lease", "freight contract"],
    "Saltmarsh Storage": ["storage lease", "pipeline capacity deal", "gas supply agreement"],
}
DELIVERABLES = ["permit filing", "design package", "safety case", "cost report", "environmental assessment",
                "vendor shortlist", "commissioning plan"]
NOTES = ["Please bring the latest cost estimate.", "We'll start with the open action items.",
         "Dial-in details will follow for anyone remote.", "Send me agenda items by the day before.",
         "Lunch will be provided.", "Plan for about ninety minutes."]
CODE_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O or 1/I: codes people read aloud


# --- small helpers -------------------------------------------------------------------------------------

def _long(d: date) -> str:
    return f"{DAYS[d.weekday()]}, {MONTHS[d.month - 1]} {d.day}"


def _short(d: date) -> str:
    return f"{MONTHS[d.month - 1][:3]} {d.day}"


def _clock(hour: int, minute: int) -> str:
    return f"{(hour - 1) % 12 + 1}:{minute:02d} {'AM' if hour < 12 else 'PM'}"


def _stamp(when: datetime) -> str:
    return f"{DAYS[when.weekday()][:3]}, {_short(when)}, {when.year} at {_clock(when.hour, when.minute)}"


def _workday(d: date) -> date:
    while d.weekday() >= 5:
        d += timedelta(days=1)
    return d


def _after(rng: random.Random, d: date, lo: int, hi: int) -> date:
    """A weekday at least `lo` days after d (so gaps between related emails hold)."""
    return _workday(d + timedelta(days=rng.randint(lo, hi)))


def _anchor(rng: random.Random, slack: int) -> date:
    """A start day that leaves `slack` days before END for the rest of the thread."""
    return _workday(START + timedelta(days=rng.randint(0, (END - START).days - slack)))


def _at(rng: random.Random, d: date, lo: int = 8, hi: int = 18) -> datetime:
    return datetime(d.year, d.month, d.day, rng.randint(lo, hi - 1), rng.randint(0, 59), rng.randint(0, 59))


def _code(rng: random.Random, n: int = 6) -> str:
    return "".join(rng.choice(CODE_CHARS) for _ in range(n))


def _greet(rng: random.Random, to: list[dict]) -> str:
    if len(to) > 1:
        return rng.choice(["Hi all,", "Hello team,", "All,"])
    return rng.choice([f"Hi {to[0]['first']},", f"{to[0]['first']},", f"Hello {to[0]['first']},"])


def _sign(rng: random.Random, p: dict) -> str:
    if p["org"] != COMPANY:
        return f"{p['name']}\n{p['title']}, {p['org']}"
    return rng.choice([f"Thanks,\n{p['first']}", f"{p['name']}\n{p['title']}, {COMPANY}", f"- {p['first']}",
                       f"Best,\n{p['first']}"])


def _mail(when: datetime, sender: dict, to: list[dict], subject: str, body: str, folder: str,
          cc: list[dict] = (), bcc: list[str] = ()) -> dict:
    """One email between people; the date stays a datetime until `generate` formats it."""
    return {"date": when, "subject": subject, "from_address": sender["addr"],
            "to_addresses": [p["addr"] for p in to], "cc_addresses": [p["addr"] for p in cc],
            "bcc_addresses": list(bcc), "body": body, "inbox": folder}


def _reply(orig: dict, when: datetime, sender: dict, to: list[dict], text: str, cc: list[dict] = ()) -> dict:
    """A reply that quotes the whole original below the new text, as mail clients do."""
    who = PEOPLE[orig["from_address"]]
    quoted = "\n".join(">" + (" " + line if line else "") for line in orig["body"].split("\n"))
    body = f"{text}\n\nOn {_stamp(orig['date'])}, {who['name']} <{who['addr']}> wrote:\n{quoted}"
    subject = orig["subject"] if orig["subject"].startswith("Re: ") else "Re: " + orig["subject"]
    return _mail(when, sender, to, subject, body, orig["inbox"], cc)


def _forward(orig: dict, when: datetime, sender: dict, to: list[dict], text: str) -> dict:
    who = PEOPLE[orig["from_address"]]
    header = (f"---------- Forwarded message ---------\nFrom: {who['name']} <{who['addr']}>\n"
              f"Date: {_stamp(orig['date'])}\nSubject: {orig['subject']}\nTo: {', '.join(orig['to_addresses'])}")
    return _mail(when, sender, to, "Fwd: " + orig["subject"], f"{text}\n\n{header}\n\n{orig['body']}",
                 orig["inbox"])
