"""The demo corpus: a seeded generator of a small fictional inbox corpus and its questions.

Owns the data behind `build-db --demo` and the offline quick start, which is also the training and
held-out set for the tiny tool-use model. Everything in it is fiction written for this project: Larkspur
Energy, its staff, partners, projects, trips and numbers are invented, and no real email is used.

Emails follow the project's JSONL email schema, questions the Hugging Face
`corbt/enron_emails_sample_questions` schema plus `split`. Every question has one gold email, a short
answer found verbatim in that email's body, and a few keywords shared with it. Distractors make it harder:
meetings that move, offers before the final price, budget requests before approvals, itinerary changes,
deadline extensions, and mail dated after a question's query_date that the agent must not see.

Output depends on the seed alone: only `random.Random(seed)` is used and nothing iterates a set or reads
the clock, so a seed gives byte-identical JSONL in any process.
"""

from __future__ import annotations

import json
import random
from datetime import date, timedelta
from pathlib import Path

from email_agent.data.demo_world import (
    START, END, DOMAIN, TEST_SHARE, MONTHS, OWNERS, STAFF, CFO, PARTNERS, TRAVEL, ALL_STAFF, PROJECTS,
    MEETING_KINDS, ROOMS, SLOTS, CITIES, HOTEL_NAMES, HOTEL_KINDS, AIRLINES, DEAL_TYPES, PARTNER_DEALS,
    DELIVERABLES, NOTES, _long, _short, _clock, _workday, _after, _anchor, _at, _code, _greet, _sign, _mail, _reply,
    _forward)


# --- scenarios: each returns (emails, asks); an ask is (question, answer, gold email, limit) where ------
# --- limit is the first day the question may no longer be asked (None: no limit) ----------------------

def _meeting(rng: random.Random, owner: dict, project: str, kind: str):
    variant = rng.choice(["plain", "plain", "cc", "room", "moved", "future"])
    topic = f"{project} {kind}"
    sent = _anchor(rng, 45)
    # At least 9 days out, so a move (at most 8 days after the invite) always precedes the meeting.
    day, time, room = _after(rng, sent, 9, 20), _clock(*rng.choice(SLOTS)), rng.choice(ROOMS)
    a, b = rng.sample(STAFF, 2)
    if variant == "cc":
        organizer, to, cc = a, [b], [owner]
    elif rng.random() < 0.5:
        organizer, to, cc = owner, [a, b], []
    else:
        organizer, to, cc = a, [owner, b], []
    fields = {"greet": _greet(rng, to), "topic": topic, "date": _long(day), "time": time, "room": room,
              "note": rng.choice(NOTES), "sign": _sign(rng, organizer)}
    body = rng.choice([
        "{greet}\n\nLet's hold the {topic} on {date} at {time} in {room}. {note}\n\n{sign}",
        "{greet}\n\nI've booked {room} for the {topic}.\n\nWhen: {date}, {time}\nWhere: {room}\n\n{note}\n\n{sign}",
        "{greet}\n\nLocking in the {topic} for {date}, starting at {time}. We'll be in {room}. {note}\n\n{sign}",
    ]).format(**fields)
    subject = rng.choice([f"{topic} - {_short(day)}", f"Invite: {topic}", f"{topic} on {_short(day)}",
                          f"Scheduling the {topic}"])
    invite = _mail(_at(rng, sent), organizer, to, subject, body, owner["folder"], cc)
    mails, gold, limit, room_answer = [invite], {"date": invite, "time": invite, "room": invite}, day, room
    if variant == "room":  # the room changes in a reply; date and time stand
        new_room = rng.choice([r for r in ROOMS if r != room])
        text = rng.choice([f"Small change: we'll use {new_room} instead of {room}. Date and time stay the same.",
                           f"{room} is double-booked, so the {topic} moves to {new_room}. Same time."])
        when = _at(rng, _after(rng, sent, 1, 4))
        change = _reply(invite, when, organizer, to, f"{text}\n\n{_sign(rng, organizer)}", cc)
        mails.append(change)
        gold["room"], room_answer = change, new_room
    elif variant in ("moved", "future"):  # "future": the move lands after the question is asked
        moved_on = _after(rng, sent, 3, 6)
        day2 = _after(rng, moved_on, 5, 15)
        slot2 = _clock(*rng.choice([s for s in SLOTS if _clock(*s) != time]))
        fields.update(date=_long(day2), time=slot2, sign=_sign(rng, organizer))
        body = rng.choice([
            "{greet}\n\nWe need to move the {topic}. New slot: {date} at {time}, still in {room}. "
            "Sorry for the shuffle.\n\n{sign}",
            "{greet}\n\nHeads-up: the {topic} is rescheduled to {date}, {time}. Same room ({room}).\n\n{sign}",
        ]).format(**fields)
        subject2 = rng.choice([f"Moved: {topic}", f"Rescheduled: {topic}", f"New date for the {topic}"])
        moved = _mail(_at(rng, moved_on), organizer, to, subject2, body, owner["folder"], cc)
        mails.append(moved)
        if variant == "moved":
            gold, limit, day, time = dict.fromkeys(gold, moved), day2, day2, slot2
        else:
            limit = moved_on
    asks = [
        (rng.choice([f"When is the {topic}?", f"What day is the {topic} on?",
                     f"What date is the {topic} scheduled for?"]), _long(day), gold["date"], limit),
        (rng.choice([f"What time does the {topic} start?", f"What time is the {topic}?"]), time, gold["time"], limit),
        (rng.choice([f"Which room is the {topic} in?", f"Where is the {topic} being held?"]),
         room_answer, gold["room"], limit),
    ]
    return mails, asks


def _trip(rng: random.Random, owner: dict, city: str, hotel: str):
    variant = rng.choice(["plain", "plain", "cc", "changed", "future", "forward"])
    booked = _anchor(rng, 40)
    depart = _after(rng, booked, 9, 25)
    airline, carrier = rng.choice(AIRLINES)
    flight, conf, ref = f"{carrier} {rng.randint(120, 1980)}", _code(rng), _code(rng)
    traveller = rng.choice(STAFF) if variant == "cc" else owner  # "cc": a colleague booked for both of them
    fields = {"first": traveller["first"], "city": city, "date": _long(depart), "airline": airline, "flight": flight,
              "time": _clock(rng.randint(6, 19), rng.choice([0, 15, 30, 45])), "hotel": hotel,
              "nights": rng.randint(2, 4), "conf": conf, "ref": ref,
              "who": f"{traveller['name']} and {owner['name']}" if variant == "cc" else traveller["name"]}
    body = rng.choice([
        "Dear {first},\n\nYour trip to {city} is confirmed. Traveller(s): {who}.\n\nFlight: {airline} {flight}, "
        "departing {date} at {time}\nHotel: {hotel}, {nights} nights\nHotel confirmation code: {conf}\n"
        "Booking reference: {ref}\n\nSafe travels,\nSummit Travel",
        "Hello {first},\n\nThanks for booking with Summit Travel (traveller(s): {who}). The flight to {city} "
        "leaves on {date}: {airline} flight {flight}, departing {time}. We have reserved {nights} nights at the "
        "{hotel}, confirmation {conf}.\n\n"
        "Trip reference {ref}. Reply to this email if anything needs changing.\n\nSummit Travel Bookings",
        "Hi {first},\n\nAll set for {city}.\n- Outbound flight: {date}, {airline} {flight} at {time}\n- Stay: {hotel} "
        "({nights} nights), hotel confirmation {conf}\n- Agency reference: {ref}\n\nSummit Travel",
    ]).format(**fields)
    subject = rng.choice([f"Itinerary: {city}, {_short(depart)}", f"Booking confirmed - {city} trip ({ref})",
                          f"Your {city} travel confirmation"])
    cc = [owner] if variant == "cc" else []
    booking = _mail(_at(rng, booked), TRAVEL, [traveller], subject, body, owner["folder"], cc)
    mails, flight_gold, limit = [booking], booking, depart
    if variant in ("changed", "future"):
        changed_on = _after(rng, booked, 2, 5)
        new_flight = f"{carrier} {rng.randint(120, 1980)}"
        new_time = _clock(rng.randint(6, 19), rng.choice([5, 20, 35, 50]))
        text = (f"Dear {owner['first']},\n\nThe airline has changed your outbound flight to {city}. Your new "
                f"flight is {airline} {new_flight}, departing {_long(depart)} at {new_time} "
                f"(replacing {flight}). Your hotel booking is unchanged.\n\nSummit Travel")
        change = _mail(_at(rng, changed_on), TRAVEL, [owner], f"Schedule change - {city} trip", text, owner["folder"])
        mails.append(change)
        if variant == "changed":
            flight, flight_gold = new_flight, change
        else:
            limit = changed_on
    elif variant == "forward":  # a copy of the answer in the owner's sent mail, not the gold email
        to = rng.choice(STAFF)
        text = f"{_greet(rng, [to])}\n\nFYI, my {city} itinerary in case you need to reach me.\n\n{_sign(rng, owner)}"
        mails.append(_forward(booking, _at(rng, _after(rng, booked, 1, 3)), owner, [to], text))
    asks = [
        (rng.choice([f"What's my flight number to {city}?", f"Which flight am I on for the {city} trip?"]),
         flight, flight_gold, limit),
        (rng.choice([f"What hotel am I booked at for the {city} trip?", f"Which hotel am I staying at in {city}?"]),
         hotel, booking, limit),
        (rng.choice([f"What's the hotel confirmation code for my {city} trip?",
                     f"What is my {city} hotel confirmation number?"]), conf, booking, limit),
        (rng.choice([f"When does my flight to {city} leave?", f"What date is my flight to {city}?"]),
         _long(depart), booking, limit),
    ]
    return mails, asks


def _deal(rng: random.Random, owner: dict, contact: dict, name: str):
    unit, (lo, hi), volumes = DEAL_TYPES[name]
    partner, topic = contact["org"], f"{contact['org']} {name}"
    # Offer > final > counter, in whole cents so the three prices never print the same.
    offer = rng.randint(lo, hi)
    gap = max(2, round(offer * rng.uniform(0.06, 0.12)))
    counter = offer - gap
    final = counter + rng.randint(1, gap - 1)
    price = {k: f"${v / 100:,.2f}{unit}" for k, v in (("offer", offer), ("counter", counter), ("final", final))}
    volume, contract = rng.choice(volumes), f"LK-{rng.randint(1000, 9999)}"
    first = _anchor(rng, 30)
    body = rng.choice([
        f"Hi {owner['first']},\n\nFollowing our call, {partner} can offer the {name} at {price['offer']} for {volume}, "
        f"on a {rng.choice([6, 12, 18, 24])}-month term. The offer is open until {_long(_after(rng, first, 7, 10))}.",
        f"{owner['first']},\n\nAs promised, here are our terms for the {name}: {volume} at {price['offer']}. "
        f"Happy to walk through the details on a call.",
    ]) + f"\n\n{_sign(rng, contact)}"
    subject = rng.choice([f"{partner} proposal: {name}", f"{name.capitalize()} - {partner} offer", f"{topic} terms"])
    offer_mail = _mail(_at(rng, first), contact, [owner], subject, body, owner["folder"])
    text = rng.choice([
        f"Thanks {contact['first']}. {price['offer']} is above where we can go; we could sign at {price['counter']}.",
        f"Appreciate the quick turnaround. Our number for the {name} is {price['counter']}; "
        f"{price['offer']} doesn't work for us.",
    ]) + f"\n\n{_sign(rng, owner)}"
    counter_mail = _reply(offer_mail, _at(rng, _after(rng, first, 1, 3)), owner, [contact], text)
    confirmed_on = _after(rng, counter_mail["date"].date(), 2, 6)
    text = rng.choice([
        f"{owner['first']},\n\nWe can meet you at {price['final']}. The {name} is booked under contract number "
        f"{contract} for {volume}, starting {_long(_after(rng, confirmed_on, 10, 30))}.",
        f"Good news: {partner} accepts {price['final']} for the {name}. Contract number {contract}; "
        f"{volume} from {_long(_after(rng, confirmed_on, 10, 30))}.",
    ]) + f"\n\n{_sign(rng, contact)}"
    confirm = _reply(counter_mail, _at(rng, confirmed_on), contact, [owner], text, rng.sample(STAFF, 1))
    # One in three confirmations arrives after the questions are asked: no final-price questions then.
    limit = confirmed_on if rng.random() < 1 / 3 else None
    asks = [
        (rng.choice([f"What price did {partner} first offer for the {name}?",
                     f"What was {partner}'s opening price on the {name}?"]), price["offer"], offer_mail, limit),
        (rng.choice([f"What price did I counter with on the {topic}?",
                     f"What counteroffer did I send {partner} on the {name}?"]),
         price["counter"], counter_mail, limit),
        (rng.choice([f"What volume is the {topic} for?", f"How much volume does the {topic} cover?"]),
         volume, offer_mail, limit),
    ]
    if limit is None:
        asks += [(rng.choice([f"What's the agreed price for the {topic}?",
                              f"What price did we settle on with {partner} for the {name}?"]),
                  price["final"], confirm, None),
                 (f"What's the contract number for the {topic}?", contract, confirm, None)]
    return [offer_mail, counter_mail, confirm], asks


def _money(tenths: int) -> str:
    """Tenths of a million -> "$2.4 million", or "$800,000" below a million."""
    return f"${tenths / 10:.1f} million" if tenths >= 10 else f"${tenths * 100_000:,}"


def _budget(rng: random.Random, owner: dict, project: str):
    requested = rng.randint(6, 60)
    approved = requested - rng.randint(1, max(1, requested // 4))
    heads = rng.randint(6, 25)
    approved_heads = heads - rng.randint(1, 4)
    lead = rng.choice(STAFF[1:]) if rng.random() < 0.35 else owner  # someone else's request, owner cc'd
    cc = [owner] if lead is not owner else rng.sample(STAFF[1:], 1)
    sent = _anchor(rng, 25)
    body = rng.choice([
        f"Hi Grace,\n\nFor {project} phase two we're requesting {_money(requested)}, which covers {heads} FTEs "
        f"through year end. Breakdown attached.",
        f"Grace,\n\nSubmitting the {project} budget request: {_money(requested)} in total, staffing of {heads} FTEs. "
        f"Happy to go through the assumptions.",
    ]) + f"\n\n{_sign(rng, lead)}"
    subject = rng.choice([f"{project} budget request", f"Budget request: {project}"])
    request = _mail(_at(rng, sent), lead, [CFO], subject, body, owner["folder"], cc)
    approved_on = _after(rng, sent, 3, 12)
    text = rng.choice([
        f"Finance approved {_money(approved)} for {project}, with headcount capped at {approved_heads} FTEs. "
        f"Please book spend against the {project} cost code.",
        f"Approved: {_money(approved)} and {approved_heads} FTEs for {project}. We could not fund the full request "
        f"this quarter.",
    ]) + f"\n\n{_sign(rng, CFO)}"
    approval = _reply(request, _at(rng, approved_on), CFO, [lead], text, cc)
    limit = approved_on if rng.random() < 0.25 else None  # the approval is "from the future"
    asks = [(rng.choice([f"How much did we ask for in the {project} budget request?",
                         f"What amount did the {project} budget request ask for?"]), _money(requested), request, limit)]
    if limit is None:
        asks += [(rng.choice([f"What budget was approved for {project}?",
                              f"How much did finance approve for {project}?"]), _money(approved), approval, None),
                 (rng.choice([f"What headcount was approved for {project}?",
                              f"How many FTEs were approved for {project}?"]),
                  f"{approved_heads} FTEs", approval, None)]
    return [request, approval], asks


def _deadline(rng: random.Random, owner: dict, project: str, deliverable: str):
    variant = rng.choice(["plain", "plain", "extended", "future"])
    topic = f"{project} {deliverable}"
    sender, preparer = rng.sample(STAFF[1:], 2)
    sent = _anchor(rng, 45)
    due = _after(rng, sent, 10, 30)
    body = rng.choice([
        f"{_greet(rng, [owner])}\n\nReminder that the {topic} is due {_long(due)}. {preparer['name']} is preparing "
        f"it, so please send your input by {_long(_after(rng, sent, 3, 6))}.",
        f"{_greet(rng, [owner])}\n\nThe {topic} deadline is {_long(due)}. {preparer['name']} owns the document; "
        f"comments welcome any time before then.",
    ]) + f"\n\n{_sign(rng, sender)}"
    subject = rng.choice([f"{topic} due {_short(due)}", f"Deadline: {topic}", f"Reminder: {topic}"])
    first = _mail(_at(rng, sent), sender, [owner], subject, body, owner["folder"], [preparer])
    mails, due_gold, limit = [first], first, due
    if variant != "plain":
        extended_on = _after(rng, sent, 3, 8)
        new_due = _after(rng, due, 7, 14)
        text = (f"{_greet(rng, [owner])}\n\nWe've been granted an extension: the {topic} is now due "
                f"{_long(new_due)}.\n\n{_sign(rng, sender)}")
        extension = _mail(_at(rng, extended_on), sender, [owner], f"Extension: {topic}", text, owner["folder"],
                          [preparer])
        mails.append(extension)
        if variant == "extended":
            due, due_gold, limit = new_due, extension, new_due
        else:
            limit = extended_on
    asks = [(rng.choice([f"When is the {topic} due?", f"What's the deadline for the {topic}?"]),
             _long(due), due_gold, limit),
            (rng.choice([f"Who is preparing the {topic}?", f"Who owns the {topic}?"]), preparer["name"], first, limit)]
    return mails, asks


# --- noise: mail no question is about, with its own dates, times and rooms to distract ------------------

NEWSLETTERS = [("Energy Wire", "news@energywire.example"), ("Gridline Digest", "digest@gridline.example")]
HEADLINES = ["Gas futures edge higher on a colder ten-day forecast", "Regulators open consultation on storage tariffs",
             "LNG shipping rates ease as new vessels arrive", "Utility-scale solar additions hit a quarterly record",
             "Rail carloads of chemicals rise for a third month", "Interview: what grid operators want from batteries",
             "Pipeline maintenance season: the outages to watch", "Carbon credit prices slip after auction",
             "Freight brokers report softer spot rates", "Five charts on this winter's demand peak",
             "Hydrogen pilot projects move to the next phase", "Transmission queue reform: a primer"]
IT_NOTICES = [
    ("Planned maintenance: email on {short}", "All,\n\nEmail and calendar will be unavailable on {day} from 10:00 PM "
     "to 1:00 AM while we patch the mail servers. No action is needed.\n\nIT Helpdesk (ticket {ticket})"),
    ("Password expiry reminder", "Hello,\n\nYour network password expires in 7 days. Change it from any office PC "
     "or through the self-service portal before {day}.\n\nIT Helpdesk"),
    ("Phishing warning: fake invoice emails", "All,\n\nWe are seeing emails with fake invoices asking you to "
     "'verify' your login. Do not click the links; forward them to the helpdesk (ticket {ticket}).\n\nIT Security"),
    ("VPN client upgrade on {short}", "Hello,\n\nThe VPN client will update automatically on {day}. Please restart "
     "your laptop that evening.\n\nIT Helpdesk"),
    ("Laptop refresh programme", "Hi,\n\nLaptops older than four years will be replaced this quarter. Drop yours at "
     "{room} on {day} between 9:00 AM and 4:00 PM.\n\nIT Helpdesk (ticket {ticket})"),
    ("New printer on the third floor", "All,\n\nThe third-floor printer has been replaced. Print queue name: "
     "LK-PRN-3. Scanning to email works as before.\n\nIT Helpdesk"),
]
SOCIAL = [
    ("Potluck lunch {short}", "Hi everyone,\n\nOur potluck is on {day} at 12:30 PM in {room}. The sign-up "
     "sheet is on the kitchen fridge.\n\nSofia"),
    ("Book club: next meeting", "Hello readers,\n\nThe book club meets {day} at 5:30 PM in {room}. Bring snacks "
     "and opinions.\n\nSofia"),
    ("Charity 5K - join the Larkspur team", "Hi all,\n\nWe're entering a team in the charity 5K on {day}. "
     "Registration closes Friday; the company covers the entry fee.\n\nSofia"),
    ("Cake in the kitchen!", "Hi all,\n\nIt's Omar's birthday: cake in the second-floor kitchen at 3:00 PM today."
     "\n\nSofia"),
    ("Volunteer day sign-up", "Hello,\n\nOur volunteer day at the food bank is {day}. Twelve places left; reply "
     "to grab one.\n\nSofia"),
    ("Friday drinks", "All,\n\nDrinks on the roof terrace this Friday from 5:00 PM. Weather permitting!\n\nSofia"),
]
CHATTER = [
    ("Coffee?", "Hi {first},\n\nFree for a coffee on {day}? I owe you one after last week.\n\n{sign}"),
    ("Parking garage closure", "{first},\n\nHeads-up: level 2 of the garage is closed on {day} for resurfacing."
     "\n\n{sign}"),
    ("Out of office", "Hi {first},\n\nI'm out of the office until {day} with limited access to email. Hannah "
     "can help with anything urgent.\n\n{sign}"),
    ("Expense reports", "{first},\n\nFriendly reminder that expense reports for this month are due {day}.\n\n{sign}"),
    ("Thanks for today", "Hi {first},\n\nThanks for the help this morning, really appreciated.\n\n{sign}"),
    ("Lunch and learn recording", "{first},\n\nThe lunch and learn recording is on the intranet now. Worth a look "
     "when you have a spare half hour.\n\n{sign}"),
    ("Desk move", "Hi {first},\n\nFacilities will move your desk to {room} on {day}. Please pack personal items "
     "the evening before.\n\n{sign}"),
    ("Quick favour", "{first},\n\nCould you cover my slot at the team stand-up on {day}? Happy to return the "
     "favour.\n\n{sign}"),
]


def _noise(rng: random.Random, owner: dict) -> list[dict]:
    mails = []
    title, sender = rng.choice(NEWSLETTERS)
    d = _workday(START + timedelta(days=rng.randint(0, 6)))
    while d <= END:  # roughly fortnightly, early in the morning
        items = "\n".join(f"* {h}" for h in rng.sample(HEADLINES, 3))
        body = (f"{title} - {_long(d)}\n\nThis issue:\n{items}\n\nRead the full stories on our website.\n\n"
                f"You are receiving this because you subscribed with {owner['addr']}. Unsubscribe any time.")
        mails.append(_mail(_at(rng, d, 6, 7), {"addr": sender}, [owner], f"{title}: {_short(d)}", body,
                           owner["folder"]))
        d = _workday(d + timedelta(days=rng.randint(12, 16)))
    # Company-wide notices go to the all-staff list; the owner gets a blind copy.
    notices = [(f"it-helpdesk@{DOMAIN}", *t) for t in IT_NOTICES] + [(STAFF[4]["addr"], *t) for t in SOCIAL]
    for sender, subject, body in notices:
        d = _anchor(rng, 10)
        event = _after(rng, d, 2, 6)
        fields = {"short": _short(event), "day": _long(event),
                  "room": rng.choice(ROOMS), "ticket": f"INC-{rng.randint(10000, 99999)}"}
        mails.append({**_mail(_at(rng, d), {"addr": sender}, [], subject.format(**fields), body.format(**fields),
                              owner["folder"], bcc=[owner["addr"]]), "to_addresses": [ALL_STAFF]})
    for subject, body in rng.sample(CHATTER, 8) + rng.sample(CHATTER, 6):
        colleague, d = rng.choice(STAFF), _anchor(rng, 5)
        fields = {"first": owner["first"], "day": _long(_after(rng, d, 1, 5)), "room": rng.choice(ROOMS),
                  "sign": _sign(rng, colleague)}
        mails.append(_mail(_at(rng, d), colleague, [owner], subject, body.format(**fields), owner["folder"]))
    # Monthly ops numbers: figures that look like answers but that no question asks about.
    analyst = STAFF[2]
    for month in range(START.month + 1, END.month + 1):
        d = _workday(date(START.year, month, rng.randint(1, 5)))
        body = (f"{_greet(rng, [owner])}\n\nOperations summary for {MONTHS[month - 2]}:\n"
                f"- Average throughput: {rng.randint(180, 420) * 100:,} MMBtu/day\n"
                f"- Terminal utilisation: {rng.randint(61, 97)}%\n"
                f"- Near-miss reports: {rng.randint(0, 6)}, no lost-time incidents\n"
                f"- Open maintenance tickets: {rng.randint(4, 40)}\n\n{_sign(rng, analyst)}")
        mails.append(_mail(_at(rng, d), analyst, [owner], f"Monthly operations summary - {MONTHS[month - 2]}",
                           body, owner["folder"]))
    return mails


# --- assembly ------------------------------------------------------------------------------------------

def _scenarios(rng: random.Random):
    """(owner, scenario function, arguments) for every owner, with unique topics across the corpus."""
    projects, cities = rng.sample(PROJECTS, 18), rng.sample(CITIES, 18)
    hotels = [f"{name} {rng.choice(HOTEL_KINDS)}" for name in rng.sample(HOTEL_NAMES, 18)]
    deal_pairs = [(p, name) for p in PARTNERS for name in PARTNER_DEALS[p["org"]]]
    plan = []
    for i, owner in enumerate(OWNERS):
        mine = projects[3 * i:3 * i + 3]
        for project in mine:
            plan += [(owner, _meeting, (project, kind)) for kind in rng.sample(MEETING_KINDS, 2)]
            plan.append((owner, _budget, (project,)))
        for deliverable in rng.sample(DELIVERABLES, 4):
            plan.append((owner, _deadline, (rng.choice(mine), deliverable)))
        plan += [(owner, _trip, (cities[j], hotels[j])) for j in range(3 * i, 3 * i + 3)]
        plan += [(owner, _deal, pair) for pair in rng.sample(deal_pairs, 3)]
    return plan


def generate(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Return (emails, questions); same seed -> identical output."""
    rng = random.Random(seed)
    emails, asks = [], []
    for group, (owner, scenario, args) in enumerate(_scenarios(rng)):
        mails, found = scenario(rng, owner, *args)
        emails += mails
        asks += [(group, owner, *ask) for ask in found]
    for owner in OWNERS:
        emails += _noise(rng, owner)

    # Chronological message ids and per-folder file numbers; the sort is stable, so ties keep creation order.
    emails.sort(key=lambda m: m["date"])
    counters: dict[str, int] = {}
    owner_addr = {o["folder"]: o["addr"] for o in OWNERS}
    for n, mail in enumerate(emails, 1):
        mail["message_id"] = f"<demo.{n:06d}@{DOMAIN}>"
        box = f"demo/{mail['inbox']}/{'sent' if mail['from_address'] == owner_addr[mail['inbox']] else 'inbox'}"
        counters[box] = counters.get(box, 0) + 1
        mail["file_name"] = f"{box}/{counters[box]}"

    # Split by scenario, so no thread has questions on both sides of the held-out line.
    sizes: dict[int, int] = {}
    for ask in asks:
        sizes[ask[0]] = sizes.get(ask[0], 0) + 1
    groups = sorted(sizes)
    rng.shuffle(groups)
    test, n_test = set(), 0
    for group in groups:
        if n_test >= TEST_SHARE * len(asks):
            break
        test.add(group)
        n_test += sizes[group]

    rng.shuffle(asks)
    questions = []
    for qid, (group, owner, question, answer, gold, limit) in enumerate(asks, 1):
        sent = gold["date"].date()
        # Ask 1-14 days after the gold email, and before anything that would change the answer arrives.
        span = 14 if limit is None else min(14, (limit - sent).days - 1)
        assert span >= 1, f"no room to ask {question!r}"
        questions.append({
            "id": qid, "question": question, "answer": answer, "message_ids": [gold["message_id"]],
            "how_realistic": round(rng.uniform(0.3, 1.0), 2), "inbox_address": owner["addr"],
            "query_date": (sent + timedelta(days=rng.randint(1, span))).isoformat(),
            "split": "test" if group in test else "train",
        })
    for mail in emails:
        mail["date"] = mail["date"].strftime("%Y-%m-%dT%H:%M:%SZ")
    return emails, questions


def write_jsonl(rows, path) -> None:
    """One JSON object per line, keys sorted: the same rows always give the same bytes."""
    with open(Path(path), "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
