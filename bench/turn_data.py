"""A deterministic, LoCoMo-like multi-session conversational set for bench/bench_turns.py.

Each conversation is two friends chatting over ``sessions`` dated sessions (a few days to three weeks apart).
Speaker A is stored as ``user``, B as ``assistant``; each message reads ``Name: text`` like LoCoMo's turns. Life
events (a new pet, a trip, a job change, a hobby ...) are told once, in one turn, in some session; the rest is
small talk drawn from shared topic banks that reuse the events' vocabulary (other people's dogs, other trips),
so keywords alone are ambiguous. Questions are annotated with their evidence turns (conversation index,
1-based sequence):

* ``single-hop``: one fact, asked in other words ("What is the name of Maya's puppy?").
* ``temporal``: when something happened ("When did Maya adopt her dog?": the evidence is the turn telling it,
  the answer its session's date), and relative ones asked from a later point in time ("What did Maya say she
  had done last week?" with ``reference_time`` a week after the session; the product gets ``reference_time``,
  a plain BM25 cannot use it).
* ``multi-hop``: an aggregate over several sessions ("Which cities did Maya travel to for work?": 2-3
  evidence turns, each in a different session).
* ``open-domain``: an inference from a stated preference ("Would Maya enjoy a ceramics workshop?"), worded
  with little overlap with the evidence.

Everything comes from ``random.Random(seed)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

__all__ = ["Question", "TurnSet", "build"]

NAMES = ["Maya", "Jonah", "Priya", "Tomas", "Aiko", "Lena", "Omar", "Grace", "Felix", "Nadia", "Ruben", "Hana",
         "Marcus", "Ingrid", "Samir", "Clara", "Dev", "Yara", "Elliot", "Sofia"]

# One-off life events: (key, statement, single-hop question, temporal question). {n} = the speaker's name;
# {x} is drawn from the event's own choices.
EVENTS = [
    ("dog", ["I finally adopted a puppy from the shelter on Saturday, a little beagle we named {x}!",
             "Big news, we brought home a rescue beagle this weekend. The kids called him {x}."],
     "What is the name of {n}'s new pet?", "When did {n} adopt the beagle?", ["Biscuit", "Pickle", "Waffles", "Juniper"]),
    ("job", ["I accepted the offer, I start as a {x} at the hospital next month.",
             "So I quit the bank. Starting over as a {x}, can you believe it?"],
     "What new career did {n} begin?", "When did {n} decide to change jobs?", ["radiographer", "paramedic", "nurse educator"]),
    ("marathon", ["I ran the city half marathon this morning, finished in {x}, my legs are jelly.",
                  "Crossed the finish line of my first 21k today in {x}!"],
     "What was {n}'s finishing time in the race?", "When did {n} run the half marathon?", ["1:58", "2:04", "1:49"]),
    ("move", ["We signed the lease, we're moving to a flat in {x} at the end of the month.",
              "Packing boxes everywhere, the move to {x} is happening."],
     "Which neighbourhood did {n} relocate to?", "When did {n} move house?", ["Fitzroy", "Brunswick", "Northcote", "Carlton"]),
    ("pottery", ["I signed up for a wheel-throwing class on Tuesdays, my first bowl was lopsided but I love it.",
                 "Started a clay class, throwing bowls on the wheel, it's so calming."],
     "What creative class did {n} join?", "When did {n} start the clay class?", [""]),
    ("surgery", ["The knee operation went fine, the surgeon repaired the {x} and I'm on crutches for six weeks.",
                 "Just got out of hospital, they fixed my {x}, no running for a while."],
     "What injury did {n} have operated on?", "When did {n} have knee surgery?", ["torn meniscus", "ACL", "cartilage"]),
    ("car", ["Traded in the old hatchback, we bought a second-hand {x} yesterday.",
             "New wheels! Well, used, a {x}, picked it up from the dealer this afternoon."],
     "What vehicle did {n} buy?", "When did {n} buy the car?", ["Toyota RAV4", "Mazda 3", "Subaru Forester"]),
    ("concert", ["Went to see {x} live last night, the encore was unreal.",
                 "Still buzzing from the {x} gig, we were right at the front."],
     "Which band did {n} see perform?", "When did {n} go to the concert?",
     ["Arctic Monkeys", "Florence and the Machine", "Tame Impala"]),
    ("garden", ["Planted a whole bed of {x} along the back fence today, fingers crossed for the frost.",
                "Spent the afternoon digging, the {x} are finally in the ground."],
     "What did {n} plant in the backyard?", "When did {n} plant the new bed?",
     ["heirloom tomatoes", "sunflowers", "blueberry bushes"]),
    ("course", ["I enrolled in an online {x} course, lectures on Thursday nights.",
                "Decided to study again, I'm doing a {x} certificate online."],
     "What subject is {n} studying?", "When did {n} enrol in the online course?", ["data analytics", "Japanese", "UX design"]),
    ("baby", ["My sister had her baby on Monday, a girl, they named her {x}.",
              "I'm an aunt! Well, uncle or aunt, whatever, my sister's little {x} arrived this week."],
     "What is the name of {n}'s niece?", "When was {n}'s niece born?", ["Olive", "Mila", "Ada"]),
    ("volunteer", ["I started volunteering at the {x} on Sunday mornings.",
                   "Did my first shift at the {x} today, helping out on weekends now."],
     "Where does {n} volunteer?", "When did {n} begin volunteering?",
     ["community food bank", "animal shelter", "library reading program"]),
]

# Aggregates for multi-hop: several mentions, each told in a different session.
AGGREGATES = [
    ("cities", "Which cities did {n} travel to for work?",
     ["Flew to {x} for a client workshop, back on Friday.", "Work sent me to {x} again, three days of meetings.",
      "Just landed in {x} for the conference, hotel is nice at least."],
     ["Singapore", "Auckland", "Perth", "Osaka", "Denver", "Lisbon"]),
    ("sports", "What sports has {n} tried recently?",
     ["Tried {x} for the first time today, I was terrible but it was fun.", "A friend dragged me to {x}, I think I'm hooked.",
      "Did a beginner {x} session this morning, every muscle hurts."],
     ["bouldering", "paddle boarding", "fencing", "squash", "ultimate frisbee"]),
    ("books", "Which books has {n} read lately?",
     ["Finished reading {x}, couldn't put it down.", "Halfway through {x}, the ending better be worth it.",
      "Book club picked {x}, I read it in two evenings."],
     ["Piranesi", "The Overstory", "Klara and the Sun", "Circe", "Project Hail Mary"]),
]

# Open-domain: a stated preference, and a question needing an inference from it.
PREFERENCES = [
    ("I could spend hours in a museum looking at old pottery and ceramics.", "Would {n} enjoy a ceramics workshop?"),
    ("Honestly, loud crowds make me anxious, I'd rather stay home on New Year's Eve.",
     "Is {n} likely to go to a big music festival?"),
    ("I've been vegetarian for ten years, never missed meat once.", "Would {n} order the steak at a barbecue restaurant?"),
    ("Nothing beats a cold swim in the ocean at sunrise for me.", "Would {n} like a beach holiday?"),
    ("I get seasick on anything smaller than a ferry.", "Should {n} book a sailing trip?"),
    ("My dream is to see the northern lights one day.", "Which natural phenomenon does {n} hope to witness?"),
    ("I'm allergic to cats, my eyes swell up within minutes.", "Could {n} comfortably stay at a house with cats?"),
    ("I always pick the window seat so I can watch the clouds.", "Where does {n} prefer to sit on a plane?"),
]

SMALL_TALK = [
    "How was your week? Mine was a blur of meetings.", "The weather has been so grey, I miss the sun.",
    "Did you watch the game on Sunday?", "I made a curry last night, way too spicy.",
    "My neighbour's dog barked all night again.", "Work is busy but fine, nothing new really.",
    "We should grab coffee soon.", "I've been sleeping badly, too much screen time.",
    "The kids have a school concert next week.", "Traffic on the way home was terrible today.",
    "I keep meaning to start running again.", "Have you tried the new bakery near the station?",
    "My mum called, she says hi.", "I binge-watched a crime series all weekend.",
    "The office moved the team lunch to Fridays.", "I need a holiday, even just a long weekend.",
    "My brother is visiting from out of town soon.", "Prices at the supermarket are wild lately.",
    "I finally cleaned out the garage, found so much junk.", "Our book club meets at my place this month.",
    "It rained on our picnic, typical.", "I've been learning to cook Thai food from videos.",
    "My phone screen cracked again.", "Someone at work brought their puppy to the office today.",
    "The concert tickets sold out in minutes, so annoying.", "I'm thinking about repainting the bedroom.",
    "Flights are so expensive right now.", "My back is sore from the new office chair.",
    "I started a podcast about history, just for fun.", "We had friends over for a barbecue.",
]
REACTIONS = ["That's amazing, congrats!", "Wow, tell me more!", "No way, that's huge.", "I'm so happy for you.",
             "That sounds like a lot, how are you feeling?", "Ha, I love that.", "Oh nice, good for you.",
             "Really? I had no idea.", "That must have been exciting.", "Fair enough, makes sense."]
FOLLOW_UPS = ["Thanks! It's been a wild few days.", "Yeah, still sinking in.", "I'll send you photos.",
              "Honestly it felt like the right time.", "We'll see how it goes."]


@dataclass
class Question:
    text: str
    kind: str  # single-hop | temporal | multi-hop | open-domain
    #: (conversation index, 1-based sequence) of each evidence turn
    evidence: list[tuple[int, int]]
    #: epoch ms a relative question is asked at ("last week"); None: not relative
    reference_time: int | None = None


@dataclass
class Session:
    date: datetime
    turns: list[tuple[str, str, str]] = field(default_factory=list)  # (role, speaker, text)


@dataclass
class TurnSet:
    #: conversations[i] = sessions in order
    conversations: list[list[Session]]
    questions: list[Question]

    def turns(self, ci: int) -> list[tuple[str, str, str, int, str]]:
        """(role, speaker, "Speaker: text", session index, ISO date) of conversation ci, in sequence order."""
        out = []
        for si, s in enumerate(self.conversations[ci]):
            for role, speaker, text in s.turns:
                out.append((role, speaker, f"{speaker}: {text}", si, s.date.strftime("%Y-%m-%dT%H:%M:%SZ")))
        return out


def _ms(dt: datetime) -> int:
    return int(dt.timestamp() * 1000)


def build(conversations: int = 8, sessions: int = 10, turns_per_session: int = 24, *, seed: int = 20240607) -> TurnSet:
    rng = random.Random(seed)
    convs: list[list[Session]] = []
    questions: list[Question] = []
    dropped: set[tuple[int, int]] = set()
    names = rng.sample(NAMES, len(NAMES))  # every speaker of the set has a name of their own
    for ci in range(conversations):
        a, b = names[(2 * ci) % len(names)], names[(2 * ci + 1) % len(names)]
        start = datetime(2023, 1, 9, 18, 0, tzinfo=timezone.utc) + timedelta(days=rng.randrange(0, 200))
        dates = [start]
        for _ in range(sessions - 1):
            dates.append(dates[-1] + timedelta(days=rng.randrange(4, 22), hours=rng.randrange(-3, 4)))
        sess = [Session(d) for d in dates]
        # plan: which session carries which event / aggregate mention / preference, and who tells it
        plan: list[list[tuple]] = [[] for _ in range(sessions)]
        for speaker in (a, b):
            for ev in rng.sample(EVENTS, 4):
                plan[rng.randrange(sessions)].append(("event", speaker, ev))
            for agg in rng.sample(AGGREGATES, 2):
                items = rng.sample(agg[3], 3 if rng.random() < 0.5 else 2)
                for si, item in zip(rng.sample(range(sessions), len(items)), items, strict=True):
                    plan[si].append(("agg", speaker, agg, item))
            for pref in rng.sample(PREFERENCES, 2):
                plan[rng.randrange(sessions)].append(("pref", speaker, pref))
        seq = 0
        expected: dict[tuple[int, int], int] = {}
        agg_evidence: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for si, s in enumerate(sess):
            items = plan[si][:]
            slots = sorted(rng.sample(range(2, turns_per_session - 3), min(len(items), turns_per_session // 4)))
            rng.shuffle(items)
            pos = dict(zip(slots, items, strict=False))
            speakers = [a, b]
            i = 0
            while len(s.turns) < turns_per_session:
                who = speakers[len(s.turns) % 2]
                role = "user" if who == a else "assistant"
                item = pos.pop(i, None) if i in pos else None
                i += 1
                if item is not None and item[1] != who:  # let the right person tell it: one small-talk turn first
                    s.turns.append((role, who, rng.choice(SMALL_TALK)))
                    who, role = item[1], ("user" if item[1] == a else "assistant")
                if item is None:
                    s.turns.append((role, who, rng.choice(SMALL_TALK) if rng.random() < 0.8 else rng.choice(REACTIONS)))
                    continue
                seq_here = seq + len(s.turns) + 1
                expected[(ci, seq_here)] = len(s.turns)
                other = b if who == a else a
                if item[0] == "event":
                    key, statements, q1, q2, choices = item[2]
                    x = rng.choice(choices)
                    s.turns.append((role, who, rng.choice(statements).format(x=x)))
                    questions.append(Question(q1.format(n=who), "single-hop", [(ci, seq_here)]))
                    questions.append(Question(q2.format(n=who), "temporal", [(ci, seq_here)]))
                    if rng.random() < 0.5:  # asked later, relative to when it was told
                        days = rng.choice([(7, "last week"), (1, "yesterday"), (30, "last month")])
                        ref = s.date + timedelta(days=days[0], hours=2)
                        questions.append(Question(f"What did {who} say they had done {days[1]}?", "temporal",
                                                  [(ci, seq_here)], _ms(ref)))
                elif item[0] == "agg":
                    agg, x = item[2], item[3]
                    s.turns.append((role, who, rng.choice(agg[2]).format(x=x)))
                    agg_evidence.setdefault((who, agg[0]), []).append((ci, seq_here))
                else:
                    statement, q = item[2]
                    s.turns.append((role, who, statement))
                    questions.append(Question(q.format(n=who), "open-domain", [(ci, seq_here)]))
                if len(s.turns) < turns_per_session:
                    s.turns.append(("user" if other == a else "assistant", other, rng.choice(REACTIONS)))
            cut = s.turns[:turns_per_session]
            for key, index in list(expected.items()):
                if key[1] > seq and index >= len(cut) and key[1] <= seq + len(s.turns):
                    dropped.add(key)  # told after the session's last kept turn
            s.turns = cut
            seq += len(s.turns)
        for (who, key), ev in agg_evidence.items():
            agg = next(g for g in AGGREGATES if g[0] == key)
            if len(ev) >= 2:
                questions.append(Question(agg[1].format(n=who), "multi-hop", sorted(ev)))
        convs.append(sess)
    # evidence must point at a turn that exists (a planned item cut off by the session length is dropped)
    kept = []
    for q in questions:
        q.evidence = [e for e in q.evidence if e not in dropped]
        if q.evidence:
            kept.append(q)
    return TurnSet(convs, kept)
