"""A deterministic long multi-session conversation set for bench_conversations.py.

One person talks to an assistant over many sessions (conversations) about everyday topics. Facts are
stated once, deep inside long conversations, and asked about later in other words (``questions``), so a
retriever has to find one message among thousands. Everything comes from ``random.Random(seed)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["FACTS", "Fact", "Dataset", "build", "build_prose"]


@dataclass(frozen=True)
class Fact:
    statement: str
    question: str


FACTS = [Fact(s, q) for s, q in [
    ("By the way, my sister Margaret just adopted a greyhound she named Biscuit.", "What kind of dog did my sibling get?"),
    ("I finally switched my phone plan to Mintwave, it's 18 dollars a month.", "Which mobile carrier am I with now?"),
    ("My landlord said the rent goes up to 1,450 starting in March.",
     "How much will my apartment cost per month after the increase?"),
    ("I'm allergic to penicillin, found out the hard way as a kid.", "Is there any antibiotic I can't take?"),
    ("Our wedding anniversary is on the 14th of October.", "When do my spouse and I celebrate getting married?"),
    ("I parked the camper van at my uncle's farm in Ballarat for the winter.",
     "Where is the RV being stored during the cold months?"),
    ("My daughter's piano recital got moved to Saturday the 9th.", "When is my kid's music performance?"),
    ("I've decided to learn Portuguese before the trip to Lisbon next spring.",
     "Which language am I studying for my upcoming vacation?"),
    ("The wifi password at the cabin is bluefern-2291.", "What's the network key for the internet at our holiday house?"),
    ("I ran my first half marathon in 1 hour 52 minutes.", "What was my finishing time in the 21 km race?"),
    ("My blood type is O negative, the clinic confirmed it.", "Which blood group do I have?"),
    ("I lent my cordless drill to Priya from next door.", "Who has borrowed my power tool?"),
    ("Our team's standup moved to 9:45 because of the Sydney folks.", "What time is the daily sync meeting now?"),
    ("I'm vegetarian, but I still eat eggs and cheese.", "Do I eat meat?"),
    ("My car is a 2016 Subaru Outback, dark green.", "What vehicle do I drive?"),
    ("The plumber quoted 780 to replace the water heater.",
     "How much would the new hot water system cost according to the tradesman?"),
    ("My grandmother's lasagna recipe uses a layer of spinach and nutmeg in the bechamel.",
     "What is the secret in granny's pasta bake?"),
    ("I keep the spare house key inside the fake rock by the lemon tree.", "Where is the backup key hidden?"),
    ("My manager Tomasz approved my sabbatical for July and August.", "Who signed off on my extended leave?"),
    ("I switched from Vim to Helix last month and I'm not going back.", "Which text editor do I use these days?"),
    ("The kids' dentist is Dr. Okafor on Lygon Street.", "Who looks after my children's teeth?"),
    ("I want to repaint the living room a sage green colour.", "What shade did I pick for the lounge walls?"),
    ("I've been taking 2000 IU of vitamin D every morning since winter.", "What supplement dose am I on daily?"),
    ("My brother lives in Calgary now, he moved there for a job at an energy company.", "Where does my brother live these days?"),
    ("I got a parking ticket for 95 dollars outside the library.", "How much was the fine I received near the library?"),
    ("The cat's vet appointment is Tuesday at 4:30 for her vaccinations.", "When is the kitty getting her shots?"),
    ("My favourite board game is Terraforming Mars, we play it every Friday.", "Which tabletop game do I enjoy most?"),
    ("I invested 5,000 in an index fund that tracks the ASX 200.", "Where did I put money in the share market?"),
    ("I can't drink coffee after 2pm or I can't sleep.", "Why do I avoid caffeine in the afternoon?"),
    ("My GitHub username is quietlantern.", "What's my handle on the code hosting site?"),
    ("The book club is reading The Remains of the Day this month.", "Which novel is our reading group discussing?"),
    ("I broke my left wrist snowboarding in 2019.", "Have I ever fractured a bone?"),
    ("We booked the Airbnb in Hobart from the 3rd to the 8th of January.", "What are the dates for our Tasmania accommodation?"),
    ("My son is on the under-12 soccer team, training is Wednesdays.", "When does my boy have football practice?"),
    ("I'm saving up for a used Yamaha acoustic guitar around 400 dollars.", "What instrument am I putting money aside for?"),
    ("My passport expires in August next year, I need to renew it.", "When does my travel document run out?"),
    ("The server room door code is 4-7-1-9.", "What's the combination to get into the machine room?"),
    ("I have a standing desk now and I alternate every 30 minutes.",
     "How often do I switch between sitting and standing at work?"),
    ("I started a sourdough starter and named it Clint Yeastwood.", "What did I call my bread culture?"),
    ("We're having the kitchen benchtops replaced with quartz in May.", "What material are the new counters going to be?"),
    ("I'm lactose intolerant so I use oat milk.", "Which dairy alternative do I drink?"),
    ("My old laptop battery only lasts 40 minutes now.", "How long does my notebook computer run unplugged?"),
    ("Our flight to Tokyo leaves at 11:20pm on QF25.", "When does our plane to Japan depart?"),
    ("My mum's birthday is on the 2nd of June, she'll be 70.", "When is my mother turning seventy?"),
    ("I pay 62 dollars a month for the gym on Chapel Street.", "What's my fitness club membership fee?"),
    ("I tore my ACL playing netball and had surgery in 2021.", "What knee injury did I have operated on?"),
    ("I water the tomato seedlings every second evening.", "How often do I give my vegetable plants a drink?"),
    ("The accountant said I owe 1,200 in tax this year.", "What's my bill to the revenue office?"),
    ("I'm meeting Jun for dumplings on Thursday at Shanghai Street.", "Who am I having lunch with later this week?"),
    ("My preferred pronouns are they/them.", "How should people refer to me?"),
    ("Our dog Pepper is scared of thunderstorms and hides under the bed.", "What frightens our pet during bad weather?"),
    ("I cancelled the Netflix subscription and kept Stan.", "Which streaming services do I still pay for?"),
    ("The smoke alarm in the hallway needs a 9-volt battery.", "What power cell does the fire detector take?"),
    ("My commute on the 86 tram takes about 35 minutes.", "How long does it take me to get to work?"),
    ("I'm running the Melbourne marathon in October, my goal is under 4 hours.", "What time target do I have for the big race?"),
    ("I get migraines when I skip meals.", "What triggers my bad headaches?"),
    ("My wife's name is Ingrid and she's a marine biologist.", "What does my partner do for a living?"),
    ("Our house insurance renews on the 1st of September with Allianz.", "When is the home policy up for renewal?"),
    ("I planted a Meyer lemon tree in the backyard last autumn.", "What citrus is growing in my garden?"),
    ("I donated blood for the tenth time last week.", "How many times have I given blood?"),
]]

# Topic banks: user asks, assistant answers with sentences drawn from the topic's bank (slots filled at random).
TOPICS: dict[str, dict[str, list[str]]] = {
    "coding": {
        "user": ["How do I speed up this {lang} function that loops over {thing}?",
                 "My {lang} tests fail with a timeout on CI, any idea why?",
                 "Can you review this approach to caching {thing} in {lang}?",
                 "What's the cleanest way to parse {thing} in {lang}?",
                 "Should I use a queue or a cron job for the {thing} cleanup?", "The deploy broke the {thing} endpoint again."],
        "assistant": ["Profile first: measure where the time goes before rewriting the {thing} loop.",
                      "In {lang}, a dictionary lookup avoids scanning the whole list of {thing} each time.",
                      "A timeout on CI often means a test waits on a network call that is fast on your laptop.",
                      "Consider batching the writes so that each transaction handles a few hundred {thing} at once.",
                      "Keep the parsing strict and report the line number when a record of {thing} is malformed.",
                      "A small integration test around the {thing} endpoint would have caught the regression.",
                      "Idempotent handlers make retries safe, which matters once a queue redelivers messages.",
                      "If the data fits in memory, sort once and binary search instead of filtering repeatedly.",
                      "Logging the request id with every line makes the {thing} failures much easier to trace.",
                      "Pin the dependency versions so that the build on CI matches what you run locally."],
        "slots": {"lang": ["Python", "Go", "TypeScript", "Rust", "Java"],
                  "thing": ["invoices", "user records", "log lines", "orders", "events", "webhooks"]},
    },
    "cooking": {
        "user": ["What can I cook tonight with {ingredient} and {ingredient2}?",
                 "My {dish} always comes out too dry, what am I doing wrong?",
                 "How long should I roast {ingredient} at 200 degrees?", "Any tips for meal prepping {dish} for the week?",
                 "Can I freeze {dish} and reheat it later?"],
        "assistant": ["A quick stir fry with {ingredient} and {ingredient2} takes about fifteen minutes.",
                      "Dry {dish} usually means it cooked too long or the heat was too high.",
                      "Rest the meat for ten minutes so that the juices settle before slicing.",
                      "Season in layers: a little salt early, then taste and adjust at the end.",
                      "Roasting {ingredient} on a preheated tray gives a better caramelised edge.",
                      "Most stews freeze well for three months if you cool them quickly first.",
                      "Toast the spices in a dry pan for a minute to bring out their aroma.",
                      "A squeeze of citrus at the end brightens a heavy {dish} considerably.",
                      "Cook a big batch of grains on Sunday and keep it in airtight containers."],
        "slots": {"ingredient": ["chickpeas", "pumpkin", "salmon", "mushrooms", "tofu", "chicken thighs"],
                  "ingredient2": ["rice", "spinach", "noodles", "sweet potato", "feta"],
                  "dish": ["risotto", "curry", "meatloaf", "frittata", "ragu"]},
    },
    "travel": {
        "user": ["What should I pack for a week in {place} in {season}?", "Is it worth getting a rail pass for {place}?",
                 "How early should I get to the airport for a flight to {place}?",
                 "Any neighbourhoods in {place} you'd recommend staying in?"],
        "assistant": ["For {place} in {season}, pack layers and a light waterproof jacket.",
                      "A rail pass pays off if you take more than three long trips in a week.",
                      "Two hours before an international departure is a comfortable margin.",
                      "Staying near a metro line saves a lot of time when exploring {place}.",
                      "Check the entry requirements well before you book anything non-refundable.",
                      "Travel insurance that covers cancellations is worth it for longer trips.",
                      "Download offline maps in case the mobile data is patchy outside the city.",
                      "Local markets are usually the best place to try regional food cheaply."],
        "slots": {"place": ["Kyoto", "Lisbon", "Vancouver", "Marrakesh", "Edinburgh", "Queenstown"],
                  "season": ["winter", "spring", "summer", "autumn"]},
    },
    "fitness": {
        "user": ["How many days a week should I do {exercise}?", "My {body} is sore after {exercise}, is that normal?",
                 "Can you suggest a beginner plan for {exercise}?", "Should I stretch before or after {exercise}?"],
        "assistant": ["Three sessions of {exercise} a week with rest days in between is a good start.",
                      "Mild soreness in the {body} a day or two later is normal when you start something new.",
                      "Increase the load by about ten percent per week to avoid overuse injuries.",
                      "A dynamic warm-up before {exercise} and gentle stretching afterwards works well.",
                      "Sleep and protein intake matter as much as the workouts themselves.",
                      "Track your sessions so that you can see progress over a few months.",
                      "Sharp pain is different from soreness and is a reason to stop and get it checked."],
        "slots": {"exercise": ["running", "swimming", "weight training", "cycling", "yoga"],
                  "body": ["lower back", "calves", "shoulders", "hamstrings"]},
    },
    "finance": {
        "user": ["How much of my income should go into {account}?", "Is it better to pay off {debt} or invest?",
                 "How do I set up a budget that actually sticks?", "What's a sensible emergency fund size?"],
        "assistant": ["Many people aim to put ten to fifteen percent of their income into {account}.",
                      "Paying off {debt} first usually wins when its interest rate is above six percent.",
                      "Automate the transfers on payday so that saving happens before spending.",
                      "Three to six months of essential expenses is a common emergency fund target.",
                      "Review subscriptions every few months, they add up quietly.",
                      "Diversified low-cost funds beat picking individual stocks for most people.",
                      "Keep the emergency money in a separate high-interest savings account."],
        "slots": {"account": ["retirement savings", "a brokerage account", "a high-interest account"],
                  "debt": ["the credit card", "the car loan", "the student loan"]},
    },
    "garden": {
        "user": ["When is the best time to plant {plant}?", "The leaves on my {plant} are turning yellow, why?",
                 "How do I keep {pest} away from the vegetable patch?", "What grows well in a shady corner?"],
        "assistant": ["Plant {plant} after the last frost when the soil has warmed up.",
                      "Yellow leaves on {plant} often point to overwatering or a lack of nitrogen.",
                      "A layer of mulch keeps moisture in and suppresses weeds around the beds.",
                      "Companion planting with marigolds can discourage {pest} naturally.",
                      "Ferns, hostas and mint all cope well with shade.",
                      "Water deeply and less often so that the roots grow downwards.",
                      "Compost from kitchen scraps improves the soil structure over time."],
        "slots": {"plant": ["zucchini", "basil", "roses", "strawberries", "garlic"],
                  "pest": ["snails", "aphids", "possums", "caterpillars"]},
    },
    "home": {
        "user": ["How do I fix a {fixture} that keeps {problem}?", "Is it hard to replace a {fixture} myself?",
                 "What tools do I need to hang heavy shelves on {wall} walls?", "Any tips for reducing our electricity bill?"],
        "assistant": ["A {fixture} that keeps {problem} usually needs a new washer or seal.",
                      "Turn off the supply at the mains before you open anything up.",
                      "For {wall} walls use the matching anchors and a stud finder.",
                      "LED bulbs and a smart thermostat cut electricity use noticeably.",
                      "If you are unsure about wiring, a licensed electrician is the safe choice.",
                      "Take photos before disassembling so that reassembly is straightforward.",
                      "Weather strips on doors and windows stop a lot of drafts cheaply."],
        "slots": {"fixture": ["tap", "toilet cistern", "door hinge", "window latch"],
                  "problem": ["dripping", "running", "squeaking", "sticking"],
                  "wall": ["plasterboard", "brick", "concrete"]},
    },
    "work": {
        "user": ["How do I give feedback to a colleague who {habit}?", "Can you help me prepare for my {meeting}?",
                 "I have too many meetings, how do I protect focus time?",
                 "How should I structure a project update for {audience}?"],
        "assistant": ["Describe the specific behaviour and its effect, then ask for their view.",
                      "For the {meeting}, write down the three outcomes you want before it starts.",
                      "Block two mornings a week as focus time and decline overlapping invites.",
                      "Lead with the decision you need from {audience}, then the context.",
                      "Keep updates short: progress, risks, and what you need from others.",
                      "Follow up in writing so that everyone has the same record of what was agreed.",
                      "A weekly one-to-one prevents small issues from becoming big ones."],
        "slots": {"habit": ["interrupts in meetings", "misses deadlines", "rewrites other people's code"],
                  "meeting": ["performance review", "quarterly planning", "salary negotiation"],
                  "audience": ["executives", "the whole team", "a client"]},
    },
}

GENERIC = ["That makes sense.", "Good question.", "Here is what I would suggest.", "Let me know if you want more detail.",
           "It depends a little on your situation.", "Happy to help with the next step."]
ACKS = ["Noted, thanks for telling me.", "Got it, I'll keep that in mind.", "Thanks, that's useful to know.", "Understood."]
FOLLOW = ["Thanks, that helps.", "Okay, makes sense.", "Interesting, I didn't know that.", "Great, I'll try that this week.",
          "What else should I consider?", "Can you explain that a bit more?"]


@dataclass
class Dataset:
    #: conversations[i] = list of (role, content), in order
    conversations: list[list[tuple[str, str]]]
    #: (fact index, conversation index, 1-based sequence of the fact's message)
    placements: list[tuple[int, int, int]]


def _fill(rng: random.Random, template: str, slots: dict[str, list[str]]) -> str:
    out = template
    for name, values in slots.items():
        out = out.replace("{" + name + "}", rng.choice(values))
    return out


def _assistant(rng: random.Random, bank: dict, long_tail: bool) -> str:
    n = rng.randint(3, 7) if not long_tail else rng.randint(8, 14)
    sentences = [_fill(rng, s, bank["slots"]) for s in rng.sample(bank["assistant"], min(n, len(bank["assistant"])))]
    if rng.random() < 0.3:
        sentences.insert(0, rng.choice(GENERIC))
    return " ".join(sentences)


def build(conversations: int = 30, messages: int = 80, *, facts: int | None = None, seed: int = 20261122) -> Dataset:
    """``conversations`` sessions of ``messages`` messages; ``facts`` facts (default all, at most len(FACTS)),
    each stated once at a random depth of at least a quarter into a random conversation."""
    rng = random.Random(seed)
    topics = list(TOPICS)
    convs: list[list[tuple[str, str]]] = []
    for _ in range(conversations):
        bank = TOPICS[rng.choice(topics)]
        turns: list[tuple[str, str]] = []
        while len(turns) < messages:
            if rng.random() < 0.25 and turns:
                turns.append(("user", rng.choice(FOLLOW)))
            else:
                turns.append(("user", _fill(rng, rng.choice(bank["user"]), bank["slots"])))
            turns.append(("assistant", _assistant(rng, bank, rng.random() < 0.15)))
            if rng.random() < 0.1:  # sessions drift to another topic for a while
                bank = TOPICS[rng.choice(topics)]
        convs.append(turns[:messages])
    wanted = len(FACTS) if facts is None else min(facts, len(FACTS))
    placements = []
    taken: set[tuple[int, int]] = set()
    lo = max(1, messages // 4)
    for fi in range(wanted):
        for _ in range(10_000):
            ci = rng.randrange(conversations)
            pos = rng.randrange(lo, max(lo + 1, messages - 2))
            pos -= pos % 2  # a user turn
            if all((ci, p) not in taken for p in range(pos - 2, pos + 3)):
                break
        else:
            break  # the set is too small for more facts
        taken.add((ci, pos))
        convs[ci][pos] = ("user", FACTS[fi].statement)
        if pos + 1 < messages:
            convs[ci][pos + 1] = ("assistant", rng.choice(ACKS))
        placements.append((fi, ci, pos + 1))
    return Dataset(convs, placements)


def build_prose(conversations: int, messages: int, sentences: list[str], *, seed: int = 20261122) -> Dataset:
    """Like ``build`` but the assistant turns are 2-8 sentences of real English prose (``sentences``), so the
    vocabulary has a natural spread (the templates' few hundred words make every keyword common)."""
    rng = random.Random(seed)
    topics = list(TOPICS)
    convs = []
    for _ in range(conversations):
        bank = TOPICS[rng.choice(topics)]
        turns: list[tuple[str, str]] = []
        while len(turns) < messages:
            turns.append(("user", _fill(rng, rng.choice(bank["user"]), bank["slots"]) if rng.random() < 0.6
                          else rng.choice(sentences)))
            turns.append(("assistant", " ".join(rng.choice(sentences) for _ in range(rng.randint(2, 8)))))
        convs.append(turns[:messages])
    return Dataset(convs, [])
