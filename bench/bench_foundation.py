"""End-to-end benchmark of the service over real HTTP: capture, indexing, search (REST and MCP), auth.

Starts ``python -m api.cli serve`` in a separate process (its own GIL and cores, as deployed) on a fresh
data directory with the real local embedder, or measures an already-running service (``--url``), then:

1. signs up an organization;
2. captures N realistic notes (100-400 words of markdown: postmortems, meeting notes, recipes, research
   snippets, design records, customer calls; seeded, so every run sends the same texts) sequentially from
   one keep-alive client, then a smaller batch from several concurrent clients; prints the acknowledged
   latency (the HTTP response time) p50/p95/p99;
3. waits until every thought is vector-indexed (``/health`` pending_jobs, then a sample checked with
   ``GET /v1/thoughts/{id}``): the time from the first capture, and the embedder throughput it implies;
   then, with the queue drained, captures a few notes at a paced rate below the embedder's capacity and
   measures, for each, the time from the capture's acknowledgement until ``GET /v1/thoughts/{id}`` shows
   it indexed (polled every 20 ms);
4. search p50/p95 over REST (``POST /v1/search``, top_k 10, varied queries) and over MCP
   (``semantic_search`` through the ``mcp`` SDK's ClientSession: one session reused, and a fresh session
   per call);
5. cached-auth overhead: ``GET /v1/org`` (cheapest authenticated route) against ``GET /health``
   (unauthenticated), and the first, uncached (argon2id) verification of a freshly created key.

    /work/venv/bin/python bench/bench_foundation.py [--n 2000] [--searches 200] [--embedder local|hash]
                                                    [--data-dir DIR] [--url URL]

``--embedder hash`` swaps the model for the feature-hashing test embedder: indexing is then near
instantaneous, which measures capture and search at large N without waiting for the model (search
latency then excludes the model's query embedding, a few ms; the output says so).
The last line printed is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import random
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"search_p50_ms": 20.0, "capture_p50_ms": 15.0, "indexed_after_capture_s": 2.0}


# -- statistics ---------------------------------------------------------------------------------------

def pct(samples: list[float], q: float) -> float:
    """Percentile q (0-100) with linear interpolation; NaN for no samples."""
    if not samples:
        return float("nan")
    s = sorted(samples)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(samples: list[float]) -> dict:
    """p50 / p95 / p99 / max of samples in seconds, as milliseconds."""
    return {
        "n": len(samples),
        "p50": round(pct(samples, 50) * 1000, 2),
        "p95": round(pct(samples, 95) * 1000, 2),
        "p99": round(pct(samples, 99) * 1000, 2),
        "max": round(max(samples) * 1000, 2) if samples else float("nan"),
    }


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- realistic notes ------------------------------------------------------------------------------------

SERVICES = ["checkout", "payments-gateway", "search-indexer", "auth-service", "notifications", "billing-worker",
            "inventory-api", "recommendations", "image-resizer", "ledger", "session-store", "feature-flags",
            "order-router", "analytics-pipeline", "email-dispatcher", "geo-lookup", "cart-service", "webhooks"]
COMPONENTS = ["Redis connection pool", "Postgres primary", "Kafka consumer group", "the load balancer", "an nginx worker",
              "the DNS resolver cache", "a cron job", "the TLS certificate", "the CDN edge config", "a Kubernetes node pool",
              "the read replica", "the rate limiter", "the JVM heap", "the gRPC retry policy", "an S3 bucket policy",
              "the Elasticsearch cluster", "the message queue", "the service mesh sidecar", "the autoscaler",
              "a feature flag", "the schema migration", "the connection timeout", "the circuit breaker"]
SYMPTOMS = ["p99 latency climbed past 4 seconds", "error rates spiked to 12%", "requests queued and timed out",
            "the pods entered a crash loop", "writes were silently dropped", "customers saw duplicate charges",
            "the queue lag grew to 40 minutes", "health checks flapped every few seconds", "memory grew without bound",
            "CPU pinned at 100% on every replica", "stale data was served from cache", "logins failed intermittently"]
CAUSES = ["pool exhaustion after a traffic surge", "a misconfigured timeout introduced in the last deploy",
          "an expired certificate nobody was alerted about", "a slow query missing an index",
          "a retry storm amplifying a brief blip", "a memory leak in the new serializer",
          "a race between two deploys", "a hot partition caused by a skewed key", "DNS TTLs set far too high",
          "a config change rolled out to all regions at once", "an unbounded batch size in the backfill job",
          "a dependency upgrade that changed default keep-alive behaviour"]
ACTIONS = ["raised the pool size to 400", "rolled back the deploy", "added the missing composite index",
           "set a jittered exponential backoff on retries", "rotated the certificate and added expiry alerts",
           "capped the batch size at 500 rows", "split the hot partition by tenant", "lowered the DNS TTL to 60 s",
           "added a canary stage to config rollouts", "pinned the dependency and opened an upstream issue",
           "added a dashboard for queue lag", "wrote a runbook for the on-call rotation"]
PEOPLE = ["Priya", "Marcus", "Elena", "Tomás", "Aisha", "Jonas", "Mei", "Oluwaseun", "Hannah", "Ravi", "Sofia",
          "Dmitri", "Grace", "Kenji", "Fatima", "Lucas", "Ingrid", "Mateo", "Nadia", "Wei"]
PROJECTS = ["the Q3 platform migration", "the mobile onboarding revamp", "the data retention policy",
            "the pricing page experiment", "the SOC 2 audit", "the search relevance overhaul",
            "the multi-region failover plan", "the design system rollout", "the partner API launch",
            "the churn dashboard", "the hiring plan for the infra team", "the offline mode for the field app",
            "the invoice reconciliation tool", "the accessibility review", "the warehouse consolidation"]
MEETING_KINDS = ["Weekly sync", "Sprint planning", "Architecture review", "Retro", "1:1", "Roadmap review",
                 "Incident review", "Customer advisory board", "Budget check-in", "Design critique"]
DECISIONS = ["ship behind a feature flag first", "postpone until after the freeze", "split the work into two milestones",
             "run a two-week spike before committing", "ask legal to review the wording", "drop the legacy endpoint",
             "hire a contractor for the migration", "keep the current vendor for another year",
             "move the launch to the first week of the month", "measure for a month before deciding"]
DISHES = ["shakshuka", "mushroom risotto", "chicken tikka masala", "lentil soup", "banana bread", "pad thai",
          "ratatouille", "beef bourguignon", "miso-glazed salmon", "focaccia", "vegetable curry", "carbonara",
          "pumpkin pie", "tacos al pastor", "ramen", "paella", "falafel", "moussaka", "gazpacho", "dal makhani"]
INGREDIENTS = ["garlic", "shallots", "smoked paprika", "cumin", "fresh thyme", "arborio rice", "coconut milk",
               "chickpeas", "red lentils", "parmesan", "miso paste", "ginger", "lemon zest", "brown butter",
               "tahini", "fish sauce", "san marzano tomatoes", "crème fraîche", "saffron", "star anise",
               "sourdough starter", "buttermilk", "fennel seeds", "cardamom", "maple syrup", "capers"]
TECHNIQUES = ["sweat the onions slowly", "toast the spices in a dry pan", "deglaze with white wine",
              "rest the dough overnight in the fridge", "fold gently so the batter keeps its air",
              "sear in batches so the pan stays hot", "simmer uncovered until it thickens",
              "bloom the gelatine in cold water", "finish with a knob of cold butter", "blanch and shock in ice water"]
FIELDS = ["retrieval-augmented generation", "protein folding", "graph neural networks", "causal inference",
          "reinforcement learning from human feedback", "vector databases", "climate modelling", "federated learning",
          "speech recognition", "sparse attention", "contrastive pretraining", "approximate nearest neighbour search",
          "differential privacy", "time-series forecasting", "program synthesis", "quantization of language models"]
METHODS = ["a two-tower encoder", "product quantization", "a mixture of experts", "Bayesian optimisation",
           "HNSW graphs", "low-rank adapters", "knowledge distillation", "reciprocal rank fusion",
           "a cross-encoder reranker", "curriculum learning", "Monte Carlo dropout", "contrastive loss with hard negatives",
           "BM25 with query expansion", "int8 post-training quantization", "gradient checkpointing"]
DATASETS = ["MS MARCO", "BEIR", "ImageNet", "Natural Questions", "a proprietary support-ticket corpus", "CIFAR-10",
            "LibriSpeech", "the Pile", "HotpotQA", "a 2 TB clickstream sample", "ERA5 reanalysis data", "SQuAD 2.0"]
CUSTOMERS = ["Northwind Logistics", "Bluefin Health", "Acme Robotics", "Crescent Bank", "Orbit Media", "Greenfield Farms",
             "Helix Biotech", "Summit Outdoor", "Lumen Energy", "Harbor Insurance", "Pioneer Schools", "Vertex Retail"]
FEATURES = ["SSO with SAML", "audit log export", "bulk import from CSV", "a Slack integration", "role-based access control",
            "usage-based billing", "an on-prem deployment option", "webhooks for status changes", "a read-only API key",
            "data residency in the EU", "custom retention periods", "a mobile app for approvals"]
LANGS = ["Python", "Go", "Rust", "TypeScript", "Kotlin", "SQL"]
ADR_TOPICS = ["Use SQLite with WAL for the embedded backend", "Adopt OpenTelemetry for tracing",
              "Move background jobs to a durable queue", "Standardise on gRPC for internal calls",
              "Store secrets in the cloud KMS", "Introduce a monorepo build cache", "Replace cron with a workflow engine",
              "Shard the events table by month", "Adopt feature flags for every release", "Deprecate the v1 REST API"]


_ASIDES = [
    lambda r: f"{r.choice(PEOPLE)} pointed out that {r.choice(COMPONENTS)} behaves differently under load than in staging.",
    lambda r: f"This came up again while we were working on {r.choice(PROJECTS)}.",
    lambda r: f"Worth comparing with what {r.choice(CUSTOMERS)} told us last quarter about {r.choice(FEATURES)}.",
    lambda r: f"I am not convinced yet; {r.choice(PEOPLE)} has better numbers from {r.choice(DATASETS)}.",
    lambda r: f"The open question is whether we {r.choice(DECISIONS)}.",
    lambda r: f"Reminder to self: {r.choice(TECHNIQUES)} — it made a real difference last time.",
    lambda r: f"For context, {r.choice(SERVICES)} handles about {r.randint(2, 900)} requests per second at peak.",
    lambda r: f"{r.choice(PEOPLE)} and {r.choice(PEOPLE)} will pair on it next week.",
    lambda r: f"We should write this down properly in the {r.choice(LANGS)} style guide.",
    lambda r: f"Related reading: notes on {r.choice(METHODS)} for {r.choice(FIELDS)}.",
    lambda r: f"Budget impact is roughly ${r.randint(1, 250)}k per year if we {r.choice(DECISIONS)}.",
    lambda r: f"The last time {r.choice(SYMPTOMS)}, the cause turned out to be {r.choice(CAUSES)}.",
    lambda r: f"Nobody remembers why {r.choice(COMPONENTS)} was configured this way in the first place.",
    lambda r: (f"Follow up with {r.choice(PEOPLE)} before "
               f"{r.choice(['Friday', 'the offsite', 'the freeze', 'month end', 'the demo'])}."),
]


def aside(rng: random.Random) -> str:
    """A paragraph of loosely related remarks (filler that still reads like a note)."""
    return " ".join(f(rng) for f in rng.sample(_ASIDES, rng.randint(2, 5)))


class NoteGenerator:
    """Deterministic, varied markdown notes of 100-400 words; note ``i`` is always the same text."""

    KINDS = ("postmortem", "meeting", "recipe", "research", "adr", "customer")

    def __init__(self, seed: int = 1234) -> None:
        self.seed = seed

    #: Per kind: the order its sections appear in, and the sections that read as prose (used, without their
    #: heading, to reach the note's target length once every section has been written).
    LAYOUT = {
        "postmortem": ((0, 3, 1, 4, 2), (0, 1, 4)),
        "meeting": ((0, 1, 3, 2), (0, 1)),
        "recipe": ((0, 1, 2), (2,)),
        "research": ((0, 1, 2, 3), (0, 1, 2)),
        "adr": ((0, 3, 1, 2), (0, 3)),
        "customer": ((0, 1, 2), (0, 1)),
    }
    MAX_WORDS = 400

    def note(self, i: int) -> tuple[str, str]:
        rng = random.Random(self.seed * 1_000_003 + i)
        kind = self.KINDS[rng.randrange(len(self.KINDS))]
        target = rng.randint(100, self.MAX_WORDS)
        head, section = getattr(self, f"_{kind}")(rng, i)
        order, prose = self.LAYOUT[kind]
        parts = [head]
        words = len(head.split())
        for k in order:
            if words >= target:
                break
            parts.append(section(k))
            words += len(parts[-1].split())
        while words < target:
            if rng.random() < 0.5:
                p = section(rng.choice(prose))
                if p.startswith("## "):
                    p = p.split("\n\n", 1)[1]
            else:
                p = aside(rng)
            parts.append(p)
            words += len(p.split())
        text = "\n\n".join(parts)
        if words > self.MAX_WORDS:  # trim at the last sentence end within the limit
            limit = [m.end() for m in re.finditer(r"\S+", text)][self.MAX_WORDS - 1]
            cut = text[:limit]
            end = max(cut.rfind(". "), cut.rfind(".\n"), cut.rfind(".") if cut.endswith(".") else -1)
            text = cut[: end + 1] if end > len(head) else cut
        return kind, text

    # -- kinds

    def _date(self, rng: random.Random) -> str:
        return f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"

    def _postmortem(self, rng, i):
        svc = rng.choice(SERVICES)
        head = f"# Postmortem INC-{4000 + i}: {svc} degradation on {self._date(rng)}\n\n" \
               f"**Severity:** SEV{rng.randint(1, 3)} · **Duration:** {rng.randint(7, 240)} min · " \
               f"**Owner:** {rng.choice(PEOPLE)}"

        def para(k):
            if k == 0:
                return (f"## Impact\n\nAt {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} UTC {rng.choice(SYMPTOMS)} "
                        f"for {svc}. Roughly {rng.randint(2, 95)}% of requests in "
                        f"{rng.choice(['us-east', 'eu-west', 'ap-south'])} "
                        f"were affected, and {rng.randint(10, 9000)} customers opened tickets. {rng.choice(PEOPLE)} was paged "
                        f"after {rng.randint(2, 30)} minutes because the alert threshold was too lax.")
            if k == 1:
                return (f"## Root cause\n\nThe trigger was {rng.choice(CAUSES)}. {rng.choice(COMPONENTS).capitalize()} "
                        f"could not keep up, and because {rng.choice(COMPONENTS)} retried aggressively the problem spread to "
                        f"{rng.choice(SERVICES)}. We confirmed this from the traces and from the {rng.choice(LANGS)} "
                        f"service logs, which showed {rng.randint(100, 50000)} timeouts in the first five minutes.")
            if k == 2:
                items = rng.sample(ACTIONS, 3)
                return "## Action items\n\n" + "\n".join(
                    f"- [{' ' if rng.random() < 0.6 else 'x'}] {a.capitalize()} ({rng.choice(PEOPLE)}, due {self._date(rng)})"
                    for a in items)
            if k == 3:
                return (f"## Timeline\n\n- {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} deploy of {svc} "
                        f"v{rng.randint(1, 9)}.{rng.randint(0, 40)}.{rng.randint(0, 9)} starts\n"
                        f"- +{rng.randint(1, 9)} min first alert: {rng.choice(SYMPTOMS)}\n"
                        f"- +{rng.randint(10, 40)} min incident declared, {rng.choice(PEOPLE)} is commander\n"
                        f"- +{rng.randint(41, 120)} min mitigated: we {rng.choice(ACTIONS)}")
            return (f"## Lessons\n\nWe learned that {rng.choice(COMPONENTS)} needs explicit limits and that our "
                    f"dashboards hid {rng.choice(SYMPTOMS).split(' ')[0]} signals. What went well: the rollback took "
                    f"{rng.randint(2, 15)} minutes. What went badly: nobody owned {rng.choice(COMPONENTS)}, so "
                    f"{rng.choice(PEOPLE)} will write a runbook and we {rng.choice(ACTIONS)}.")
        return head, para

    def _meeting(self, rng, i):
        kind = rng.choice(MEETING_KINDS)
        proj = rng.choice(PROJECTS)
        attendees = ", ".join(rng.sample(PEOPLE, rng.randint(2, 6)))
        head = f"# {kind} — {proj} ({self._date(rng)}, #{i})\n\nAttendees: {attendees}"

        def para(k):
            if k == 0:
                return (f"## Discussion\n\n{rng.choice(PEOPLE)} summarised where {proj} stands: "
                        f"{rng.randint(10, 95)}% of the milestones are done, but {rng.choice(COMPONENTS)} is still a risk. "
                        f"{rng.choice(PEOPLE)} worried that {rng.choice(FEATURES)} would slip, since the team lost "
                        f"{rng.randint(1, 3)} engineers to {rng.choice(PROJECTS)}. We agreed the real bottleneck is review time.")
            if k == 1:
                return (f"## Decision\n\nWe decided to {rng.choice(DECISIONS)}. {rng.choice(PEOPLE)} disagreed and "
                        f"preferred to {rng.choice(DECISIONS)}, but the budget of ${rng.randint(5, 400)}k settles it. "
                        f"Revisit on {self._date(rng)}.")
            if k == 2:
                return "## Action items\n\n" + "\n".join(
                    f"- **{p}**: {rng.choice(['draft', 'review', 'estimate', 'prototype', 'document'])} "
                    f"{rng.choice(FEATURES)} by {self._date(rng)}" for p in rng.sample(PEOPLE, rng.randint(2, 4)))
            return (f"## Open questions\n\n1. Does {rng.choice(CUSTOMERS)} still need {rng.choice(FEATURES)}?\n"
                    f"2. Who owns {rng.choice(COMPONENTS)} after the reorg?\n"
                    f"3. Can we {rng.choice(DECISIONS)} without hurting {rng.choice(PROJECTS)}?")
        return head, para

    def _recipe(self, rng, i):
        dish = rng.choice(DISHES)
        serves = rng.randint(2, 8)
        head = (f"# {dish.title()} (version {i % 97 + 1})\n\n*Serves {serves}; {rng.randint(20, 180)} minutes; "
                f"adapted from {rng.choice(PEOPLE)}'s notes.*")

        def para(k):
            if k == 0:
                return "## Ingredients\n\n" + "\n".join(
                    f"- {rng.choice([50, 100, 150, 200, 250, 400, 500])} g {ing}" if rng.random() < 0.6
                    else f"- {rng.randint(1, 4)} tbsp {ing}" for ing in rng.sample(INGREDIENTS, rng.randint(4, 8)))
            if k == 1:
                steps = rng.sample(TECHNIQUES, 3)
                return "## Method\n\n" + "\n".join(
                    f"{n + 1}. {s.capitalize()}, then add the {rng.choice(INGREDIENTS)} and cook for "
                    f"{rng.randint(2, 40)} minutes." for n, s in enumerate(steps))
            return (f"## Notes\n\nLast time the {dish} came out "
                    f"{rng.choice(['too salty', 'a bit dry', 'perfect', 'bland', 'too thick'])}; "
                    f"next time {rng.choice(TECHNIQUES)} and use less {rng.choice(INGREDIENTS)}. "
                    f"{rng.choice(PEOPLE)} suggested swapping in {rng.choice(INGREDIENTS)}, which worked well with "
                    f"{rng.choice(INGREDIENTS)}. Keeps {rng.randint(2, 5)} days in the fridge.")
        return head, para

    def _research(self, rng, i):
        field = rng.choice(FIELDS)
        method = rng.choice(METHODS)
        head = (f"# Reading notes: {method} for {field}\n\n> {rng.choice(PEOPLE)} et al., {rng.randint(2015, 2024)}, "
                f"arXiv:{rng.randint(1500, 2412)}.{rng.randint(10000, 99999)}")

        def para(k):
            if k == 0:
                return (f"**Claim.** Applying {method} to {field} improves recall@10 by {rng.uniform(0.5, 12):.1f} points "
                        f"on {rng.choice(DATASETS)} while cutting latency by {rng.randint(5, 70)}%. The baseline is "
                        f"{rng.choice(METHODS)}, tuned with {rng.choice(METHODS)}.")
            if k == 1:
                return (f"**Method.** They train on {rng.choice(DATASETS)} for {rng.randint(1, 300)}k steps with a batch "
                        f"of {rng.choice([32, 64, 256, 1024, 4096])}, then evaluate on {rng.choice(DATASETS)}. The key trick "
                        f"is {rng.choice(METHODS)}: without it the gain mostly disappears "
                        f"(ablation in table {rng.randint(2, 9)}).")
            if k == 2:
                return (f"**Caveats.** The comparison against {rng.choice(METHODS)} is not compute-matched, and "
                        f"{rng.choice(DATASETS)} is probably contaminated. Worth reproducing on our own data before "
                        f"we use it for {rng.choice(PROJECTS)}.")
            return (f"**Ideas for us.**\n\n- Try {method} in the {rng.choice(SERVICES)} ranking path\n"
                    f"- Compare with {rng.choice(METHODS)} at {rng.choice(['1M', '10M', '100M'])} documents\n"
                    f"- Ask {rng.choice(PEOPLE)} whether {rng.choice(LANGS)} bindings exist")
        return head, para

    def _adr(self, rng, i):
        title = rng.choice(ADR_TOPICS)
        head = (f"# ADR-{100 + i}: {title}\n\nStatus: {rng.choice(['proposed', 'accepted', 'superseded', 'rejected'])} · "
                f"Deciders: {', '.join(rng.sample(PEOPLE, 3))}")

        def para(k):
            if k == 0:
                return (f"## Context\n\n{rng.choice(SERVICES).capitalize()} and {rng.choice(SERVICES)} both depend on "
                        f"{rng.choice(COMPONENTS)}, and last quarter {rng.choice(SYMPTOMS)} {rng.randint(2, 9)} times. "
                        f"Teams writing {rng.choice(LANGS)} and {rng.choice(LANGS)} solve the same problem differently.")
            if k == 1:
                return (f"## Decision\n\nWe will {title[0].lower() + title[1:]}. New code must follow it from "
                        f"{self._date(rng)}; existing services migrate during {rng.choice(PROJECTS)}.")
            if k == 2:
                return (f"## Consequences\n\n- Positive: fewer incidents caused by {rng.choice(CAUSES)}\n"
                        f"- Negative: roughly {rng.randint(2, 30)} engineer-weeks of migration\n"
                        f"- Risk: {rng.choice(COMPONENTS)} becomes a single point of failure")
            return (f"## Alternatives considered\n\nWe looked at {rng.choice(METHODS)} and at keeping the status quo. "
                    f"{rng.choice(PEOPLE)} benchmarked both in {rng.choice(LANGS)}: the status quo costs "
                    f"{rng.randint(10, 300)} ms more per request at p99.")
        return head, para

    def _customer(self, rng, i):
        cust = rng.choice(CUSTOMERS)
        head = (f"# Call with {cust} — {self._date(rng)}\n\nAccount owner: {rng.choice(PEOPLE)}; "
                f"ARR ${rng.randint(10, 900)}k; ticket CS-{70000 + i}")

        def para(k):
            if k == 0:
                return (f"They asked for {rng.choice(FEATURES)} and {rng.choice(FEATURES)}. Their security team blocks "
                        f"renewal without {rng.choice(FEATURES)}; the deadline is {self._date(rng)}. They currently work "
                        f"around it with a {rng.choice(LANGS)} script that exports data nightly.")
            if k == 1:
                return (f"Pain points: {rng.choice(SYMPTOMS)} during their month-end close, and {rng.choice(SERVICES)} "
                        f"is slow for their {rng.randint(50, 5000)} users in "
                        f"{rng.choice(['Germany', 'Brazil', 'Japan', 'Canada', 'India'])}. "
                        f"They mentioned a competitor offering {rng.choice(FEATURES)} for less.")
            return ("Next steps:\n\n" + "\n".join(
                f"- {p} to {rng.choice(['send a proposal for', 'demo', 'scope', 'escalate'])} {rng.choice(FEATURES)}"
                for p in rng.sample(PEOPLE, 2)))
        return head, para


def queries(n: int, seed: int = 99) -> list[str]:
    """Varied, realistic search queries over the notes' topics."""
    rng = random.Random(seed)
    shapes = [
        lambda: f"why did {rng.choice(SERVICES)} go down",
        lambda: f"incidents caused by {rng.choice(CAUSES)}",
        lambda: f"what did we do about {rng.choice(COMPONENTS)}",
        lambda: f"{rng.choice(DISHES)} recipe",
        lambda: f"something to cook with {rng.choice(INGREDIENTS)} and {rng.choice(INGREDIENTS)}",
        lambda: f"what did we decide about {rng.choice(PROJECTS)}",
        lambda: f"action items for {rng.choice(PEOPLE)}",
        lambda: f"papers on {rng.choice(METHODS)} for {rng.choice(FIELDS)}",
        lambda: f"results on {rng.choice(DATASETS)}",
        lambda: f"which customers asked for {rng.choice(FEATURES)}",
        lambda: f"{rng.choice(CUSTOMERS)} renewal blockers",
        lambda: f"architecture decision about {rng.choice(ADR_TOPICS).lower()}",
        lambda: rng.choice(SYMPTOMS),
        lambda: f"how to {rng.choice(TECHNIQUES)}",
    ]
    return [rng.choice(shapes)() for _ in range(n)]


# -- the service under test -----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Environment for a service under benchmark: one client hammering one key, so the per-process limits are
#: lifted; settings that would point it elsewhere are cleared.
#: The only settings a bench-started server changes from the product's defaults, and why (printed at start).
#: They are rate limits: a benchmark client sends far more requests per minute than one user's key may.
#: Nothing that changes what a search returns or how a write is processed is ever set here.
BENCH_ENV = {
    "MEMEX_KEY_RATE_PER_MINUTE": "100000000",
    "MEMEX_ORG_RATE_PER_MINUTE": "100000000",
    "MEMEX_SIGNUP_RATE_PER_HOUR": "100000",
    "MEMEX_AUTH_FAILURES_PER_MINUTE": "100000",
}
BENCH_ENV_WHY = "rate limits only: the bench's clients send more requests per minute than a user's key may"


def announce_settings(env: dict[str, str], why: dict[str, str] | None = None) -> None:
    """Print (stderr) every setting the bench changes from the product's defaults, with the reason."""
    print(f"[bench] settings changed from the defaults ({BENCH_ENV_WHY}): "
          + ", ".join(f"{k}={v}" for k, v in BENCH_ENV.items()), file=sys.stderr, flush=True)
    for k, v in env.items():
        print(f"[bench] setting {k}={v}: {(why or {}).get(k, 'see the bench docstring')}", file=sys.stderr, flush=True)


def wait_healthy(url: str, proc: subprocess.Popen, logpath: Path, timeout: float = 180) -> None:
    """Poll ``url`` until it answers 200; fail early (with the log's tail) if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2]} exited ({proc.returncode}): {logpath.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy in {timeout} s")
        time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (a clean shutdown: the worker stops, files close), then kill if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def bench_data_dir(path: str | None, prefix: str, keep: bool = False):
    """Yield the data directory a bench-started server uses: ``path`` (created, kept), else a fresh temporary one
    (removed afterwards unless ``keep``)."""
    if path:
        data_dir = Path(path)
        data_dir.mkdir(parents=True, exist_ok=True)
        yield data_dir
        return
    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    try:
        yield Path(tmp.name)
    finally:
        if not keep:
            tmp.cleanup()


@contextmanager
def serve_subprocess(data_dir: Path, env: dict[str, str], *, log_name: str = "bench-server.log", log_mode: str = "w",
                     why: dict[str, str] | None = None):
    """Start ``python -m api.cli serve`` on a free loopback port with BENCH_ENV plus ``env`` (printed, with
    ``why``: the reason for each setting the bench changes); yield (base_url, proc, seconds until healthy,
    command); stop it on exit."""
    announce_settings({k: v for k, v in env.items() if not k.startswith("CLOUDFLARE_")}, why)
    port = free_port()
    # The product's defaults: no MEMEX_* setting of the caller's shell leaks in; BENCH_ENV and ``env`` only.
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MEMEX_")}
    full_env.update(BENCH_ENV)
    full_env.update(env)
    full_env["PYTHONUNBUFFERED"] = "1"
    logpath = data_dir / log_name
    cmd = [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--data-dir", str(data_dir), "--log-level", "warning"]
    with open(logpath, log_mode) as logfile:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=logfile, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(f"{base}/health", proc, logpath)
            yield base, proc, time.perf_counter() - t0, " ".join(cmd)
        finally:
            stop(proc)


@contextmanager
def service(args):
    """Yield (base_url, info): the service started in a subprocess, or the one at --url."""
    if args.url:
        yield args.url.rstrip("/"), {"started_by_bench": False}
        return
    env = {} if args.embedder == "local" else {"MEMEX_EMBEDDER": args.embedder}
    why = {"MEMEX_EMBEDDER": "--embedder hash: a free embedding, to time everything but the model"}
    with bench_data_dir(args.data_dir, "memex-bench-", args.keep) as data_dir:
        with serve_subprocess(data_dir, env, why=why) as (base, proc, ready, cmd):
            log(f"server pid {proc.pid} on {base} ready in {ready:.1f} s (data {data_dir})")
            yield base, {"started_by_bench": True, "pid": proc.pid, "ready_s": round(ready, 2),
                         "data_dir": str(data_dir), "command": cmd}


def code_revision() -> str:
    """The checkout the started service runs: commit, plus how many files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{f' + {len(dirty)} uncommitted files' if dirty else ''}" if head else "unknown"


@asynccontextmanager
async def stored_org(data_dir: Path):
    """The organization a kept bench data set holds, in process, as ``memex serve`` builds it with the hash embedder
    the set was loaded with and no worker: yields (memex, its organization row, its services)."""
    from api.settings import Settings
    from api.wiring import Memex
    from tenancy.models import AuthContext

    memex = Memex(Settings(data_dir=data_dir, embedder="hash", run_worker=False))
    await memex.start(worker=False)
    try:
        org = (await memex.backend.control.execute("SELECT id, slug FROM organizations", ())).rows[0]
        ctx = AuthContext(org_id=org["id"], org_slug=org["slug"], principal="bench",
                          scopes=frozenset({"read", "write", "admin"}))
        yield memex, org, await memex.for_org(ctx)
    finally:
        await memex.stop()


@asynccontextmanager
async def stored_org_search(data_dir: Path):
    """The search service of the organization a kept bench data set holds (``stored_org``; the data does not
    change), its keyword indexes current first."""
    async with stored_org(data_dir) as (memex, org, services):
        # a running service has a large organization's keyword indexes (built once, kept beside its database)
        db = (await memex.stores.open(org["id"])).db
        # (a checkout older than the conversation chunks' index, measured with --root, has the thoughts' only)
        has_chunks = "chunks" in inspect.signature(db.keyword_sync).parameters
        for chunks, what in ((False, "thoughts"), (True, "conversation chunks"))[: 1 + has_chunks]:
            t0 = time.perf_counter()
            if await db.keyword_sync(timeout=600, **({"chunks": True} if chunks else {})):
                log(f"keyword index of the {what} current after {time.perf_counter() - t0:.1f} s")
        yield services.search


def wait_keyword_index(data_dir: Path, timeout: float = 600.0) -> float | None:
    """Seconds until the keyword index of every organization under ``data_dir`` that has one is current (the
    service builds it on a large organization's first search and keeps it beside the database, so a service that
    has been running has it); None when no organization has one."""
    from services.adapters.keyword_index import index_is_current

    t0 = time.perf_counter()
    while True:
        # an organization has one once its directory exists (made when the first build starts)
        dbs = [p for p in sorted((Path(data_dir) / "orgs").glob("*/memex.sqlite3"))
               if Path(f"{p}.keywords").is_dir()]
        if not dbs and time.perf_counter() - t0 > 2.0:
            return None  # the first search started none in 2 s: no organization is large enough
        if dbs and all(index_is_current(p) for p in dbs):
            return round(time.perf_counter() - t0, 1)
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"the keyword index under {data_dir} is not current after {timeout:.0f} s")
        time.sleep(0.2)


def rss_mb(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def cpu_seconds(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# -- the measurements -----------------------------------------------------------------------------------

class Api:
    """A thin keep-alive client that retries 429s (counted) so a rate-limited --url target still completes."""

    def __enter__(self) -> "Api":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __init__(self, base: str, key: str | None = None) -> None:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        self.c = httpx.Client(base_url=base, headers=headers, timeout=120)
        self.throttled = 0

    def request(self, method: str, path: str, **kw) -> tuple[httpx.Response, float]:
        while True:
            t0 = time.perf_counter()
            r = self.c.request(method, path, **kw)
            dt = time.perf_counter() - t0
            if r.status_code != 429:
                return r, dt
            self.throttled += 1
            time.sleep(float(r.headers.get("retry-after", "1") or 1))

    def close(self) -> None:
        self.c.close()


def signup(base: str) -> dict:
    slug = f"bench-{int(time.time())}-{secrets.token_hex(3)}"
    with httpx.Client(base_url=base, timeout=60) as c:
        r = c.post("/v1/signup", json={"name": "Bench Inc", "slug": slug})
        r.raise_for_status()
        body = r.json()
    return {"slug": slug, "key": body["api_key"]["key"], "org_id": body["organization"]["id"], "mcp_url": body["mcp_url"]}


def measure_auth(base: str, key: str, samples: int, fresh_keys: int) -> dict:
    api = Api(base, key)
    pub = Api(base)
    for _ in range(20):  # warm up both routes and the key cache
        api.request("GET", "/v1/org")
        pub.request("GET", "/health")
    health, org = [], []
    for _ in range(samples):  # interleaved so drift hits both equally
        r, dt = pub.request("GET", "/health")
        health.append(dt)
        r, dt = api.request("GET", "/v1/org")
        assert r.status_code == 200, r.text
        org.append(dt)
    first, second = [], []
    for k in range(fresh_keys):
        r, _ = api.request("POST", "/v1/keys", json={"name": f"bench-fresh-{k}", "scopes": ["read"]})
        assert r.status_code == 201, r.text
        fresh = Api(base, r.json()["key"])
        r, dt = fresh.request("GET", "/v1/org")
        assert r.status_code == 200, r.text
        first.append(dt)
        r, dt = fresh.request("GET", "/v1/org")
        second.append(dt)
        fresh.close()
    api.close()
    pub.close()
    return {
        "health": ms(health), "org": ms(org),
        "cached_auth_overhead_p50_ms": round((pct(org, 50) - pct(health, 50)) * 1000, 2),
        "first_uncached": ms(first), "same_key_second": ms(second),
        "argon2_verify_p50_ms": round((pct(first, 50) - pct(second, 50)) * 1000, 2),
    }


def capture_sequential(base: str, key: str, gen: NoteGenerator, start: int, n: int, progress_every: float = 15.0):
    api = Api(base, key)
    lat, ids, chunks, kinds = [], [], [], {}
    created = 0
    t_first = time.perf_counter()
    last = t_first
    for i in range(start, start + n):
        kind, text = gen.note(i)
        kinds[kind] = kinds.get(kind, 0) + 1
        r, dt = api.request("POST", "/v1/thoughts", json={"content": text, "source": f"bench-{kind}",
                                                          "metadata": {"bench": True, "kind": kind, "n": i}})
        assert r.status_code in (200, 201), r.text
        body = r.json()
        created += body["created"]
        lat.append(dt)
        ids.append(body["id"])
        chunks.append(body["chunks"])
        now = time.perf_counter()
        if now - last > progress_every:
            last = now
            log(f"captured {len(lat)}/{n}; p50 so far {pct(lat, 50) * 1000:.1f} ms")
    t_end = time.perf_counter()
    throttled = api.throttled
    api.close()
    return {"lat": lat, "ids": ids, "chunks": chunks, "created": created, "t_first": t_first, "t_end": t_end,
            "kinds": kinds, "throttled": throttled}


def capture_concurrent(base: str, key: str, gen: NoteGenerator, start: int, n: int, clients: int):
    lat: list[float] = []
    ids: list[str] = []
    chunks: list[int] = []
    lock = threading.Lock()

    def work(w: int):
        api = Api(base, key)
        mine_lat, mine_ids, mine_chunks = [], [], []
        for i in range(start + w, start + n, clients):
            kind, text = gen.note(i)
            r, dt = api.request("POST", "/v1/thoughts", json={"content": text, "source": f"bench-{kind}"})
            assert r.status_code in (200, 201), r.text
            mine_lat.append(dt)
            mine_ids.append(r.json()["id"])
            mine_chunks.append(r.json()["chunks"])
        api.close()
        with lock:
            lat.extend(mine_lat)
            ids.extend(mine_ids)
            chunks.extend(mine_chunks)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"lat": lat, "ids": ids, "chunks": chunks, "wall": wall, "t_end": time.perf_counter()}


def pending_jobs(api: Api) -> int:
    r, _ = api.request("GET", "/health")
    return r.json()["pending_jobs"]


def indexing_state(api: Api, tid: str) -> str:
    r, _ = api.request("GET", f"/v1/thoughts/{tid}")
    return r.json()["indexing"]["state"]


def count_indexed_prefix(api: Api, ids: list[str]) -> int:
    """How many of ``ids`` (in capture order) are indexed, by binary search: the worker claims jobs in id
    order, so the indexed thoughts are (close to) a prefix of the capture order."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if indexing_state(api, ids[mid]) == "indexed":
            lo = mid + 1
        else:
            hi = mid
    return lo


def wait_all_indexed(base: str, key: str, ids: list[str], timeout: float):
    """Poll until the last thought captured, then a random sample of 50 more, show ``indexed``.
    (``/health``'s pending_jobs is only logged: it also counts other kinds of jobs.)"""
    api = Api(base, key)
    pub = Api(base)
    rng = random.Random(7)
    sample = rng.sample(ids, min(50, len(ids)))
    deadline = time.monotonic() + timeout
    last_log = time.perf_counter()
    while True:
        if indexing_state(api, ids[-1]) == "indexed":
            sample = [t for t in sample if indexing_state(api, t) != "indexed"]
            if not sample:
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"not indexed after {timeout} s")
        now = time.perf_counter()
        if now - last_log > 15:
            last_log = now
            log(f"waiting for the index: {count_indexed_prefix(api, ids)}/{len(ids)} thoughts indexed, "
                f"{pending_jobs(pub)} jobs pending")
        time.sleep(0.1)
    t_done = time.perf_counter()
    api.close()
    pub.close()
    return t_done


def paced_indexing(base: str, key: str, gen: NoteGenerator, start: int, n: int, rate: float, poll: float = 0.02):
    """Capture n notes at `rate`/s; for each, time from the ack until GET shows it indexed (polled every `poll` s)."""
    ack_lat: list[float] = []
    to_indexed: list[float] = []
    lock = threading.Lock()
    local = threading.local()

    def client() -> Api:
        if not hasattr(local, "api"):
            local.api = Api(base, key)
        return local.api

    def one(i: int):
        api = client()
        _, text = gen.note(i)
        r, dt = api.request("POST", "/v1/thoughts", json={"content": text, "source": "bench-paced"})
        assert r.status_code == 201, r.text
        t_ack = time.perf_counter()
        body = r.json()
        tid = body["id"]
        if body["indexing"]["state"] != "indexed":
            deadline = t_ack + 120
            while True:
                time.sleep(poll)
                rr, _ = api.request("GET", f"/v1/thoughts/{tid}")
                if rr.json()["indexing"]["state"] == "indexed":
                    break
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{tid} not indexed after 120 s")
        done = time.perf_counter() - t_ack
        with lock:
            ack_lat.append(dt)
            to_indexed.append(done)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=32) as pool:
        futures = []
        for k in range(n):
            delay = t0 + k / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, start + k))
        for f in futures:
            f.result()
    return {"ack": ack_lat, "indexed": to_indexed, "rate": rate}


def isolated_indexing(base: str, key: str, gen: NoteGenerator, start: int, n: int, poll: float = 0.02):
    """n captures one at a time, each after the previous one is indexed (no backlog at all): ack -> indexed."""
    api = Api(base, key)
    ack, indexed = [], []
    for i in range(start, start + n):
        _, text = gen.note(i)
        r, dt = api.request("POST", "/v1/thoughts", json={"content": text, "source": "bench-isolated"})
        assert r.status_code == 201, r.text
        t_ack = time.perf_counter()
        tid = r.json()["id"]
        while indexing_state(api, tid) != "indexed":
            if time.perf_counter() - t_ack > 120:
                raise TimeoutError(f"{tid} not indexed after 120 s")
            time.sleep(poll)
        indexed.append(time.perf_counter() - t_ack)
        ack.append(dt)
        time.sleep(0.2)
    api.close()
    return {"ack": ack, "indexed": indexed}


def search_rest(base: str, key: str, qs: list[str], warmup: int = 10):
    api = Api(base, key)
    for q in qs[:warmup]:
        api.request("POST", "/v1/search", json={"query": q, "top_k": 10})
    lat, hits = [], []
    for q in qs:
        r, dt = api.request("POST", "/v1/search", json={"query": q, "top_k": 10})
        assert r.status_code == 200, r.text
        lat.append(dt)
        hits.append(len(r.json()["results"]))
    api.close()
    return {"lat": lat, "mean_hits": statistics.mean(hits) if hits else 0}


def search_mcp_raw(mcp_url: str, key: str, qs: list[str]):
    """semantic_search as bare JSON-RPC POSTs (no SDK client): the server's share of an MCP call."""
    headers = {"authorization": f"Bearer {key}", "accept": "application/json, text/event-stream",
               "content-type": "application/json", "mcp-protocol-version": "2025-06-18"}
    lat = []
    with httpx.Client(headers=headers, timeout=120) as c:
        r = c.post(mcp_url, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}})
        r.raise_for_status()
        for n, q in enumerate(qs[:10] + qs):
            t0 = time.perf_counter()
            r = c.post(mcp_url, json={"jsonrpc": "2.0", "id": n + 1, "method": "tools/call",
                                      "params": {"name": "semantic_search", "arguments": {"query": q, "top_k": 10}}})
            dt = time.perf_counter() - t0
            assert r.status_code == 200 and not r.json()["result"].get("isError"), r.text[:500]
            if n >= 10:
                lat.append(dt)
    return lat


async def search_mcp(mcp_url: str, key: str, qs: list[str], fresh: int):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {"authorization": f"Bearer {key}"}
    reused: list[float] = []
    errors = 0
    t_open = time.perf_counter()
    async with httpx.AsyncClient(headers=headers, timeout=120) as http:
        async with streamable_http_client(mcp_url, http_client=http) as (read, write, _):
            async with ClientSession(read, write) as s:
                await s.initialize()
                session_open = time.perf_counter() - t_open
                for q in qs[:10]:
                    await s.call_tool("semantic_search", {"query": q, "top_k": 10})
                for q in qs:
                    t0 = time.perf_counter()
                    res = await s.call_tool("semantic_search", {"query": q, "top_k": 10})
                    reused.append(time.perf_counter() - t0)
                    errors += bool(res.isError)
    fresh_lat: list[float] = []
    for q in qs[:fresh]:
        t0 = time.perf_counter()
        async with httpx.AsyncClient(headers=headers, timeout=120) as http:
            async with streamable_http_client(mcp_url, http_client=http) as (read, write, _):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    res = await s.call_tool("semantic_search", {"query": q, "top_k": 10})
                    errors += bool(res.isError)
        fresh_lat.append(time.perf_counter() - t0)
    return {"reused": reused, "fresh": fresh_lat, "errors": errors, "session_open_s": session_open}


# -- report ---------------------------------------------------------------------------------------------

def row(label: str, value: str, target: str = "") -> str:
    return f"  {label:<58} {value:<36} {target}"


def verdict(value: float, limit: float) -> str:
    return f"target <= {limit:g}: {'MET' if value <= limit else 'MISSED'}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="thoughts captured sequentially (default 2000, up to 100000)")
    ap.add_argument("--searches", type=int, default=200, help="search calls per transport (default 200)")
    ap.add_argument("--embedder", choices=["local", "hash"], default="local",
                    help="embedder of the service the bench starts (default: the real local model)")
    ap.add_argument("--data-dir", default=None, help="data directory for the started service (default: a fresh temp dir)")
    ap.add_argument("--url", default=None, help="benchmark an already-running service instead of starting one")
    ap.add_argument("--concurrency", type=int, default=4, help="clients in the concurrent capture variant")
    ap.add_argument("--concurrent-n", type=int, default=None,
                    help="extra thoughts captured by the concurrent clients (default min(400, n/5); 0 skips)")
    ap.add_argument("--paced", type=int, default=50, help="thoughts captured at a paced rate after the drain (0 skips)")
    ap.add_argument("--paced-rate", type=float, default=None,
                    help="captures per second in the paced phase (default: half the embedder capacity measured "
                         "in the drain, at most 5/s)")
    ap.add_argument("--isolated", type=int, default=10,
                    help="captures made one at a time, each after the previous is indexed (0 skips)")
    ap.add_argument("--busy-searches", type=int, default=30,
                    help="REST searches run right after the captures, while the worker is still indexing (0 skips)")
    ap.add_argument("--mcp-fresh", type=int, default=30, help="MCP calls each with a fresh session (0 skips)")
    ap.add_argument("--auth-samples", type=int, default=300, help="interleaved /health and /v1/org calls")
    ap.add_argument("--fresh-keys", type=int, default=5, help="fresh keys for the uncached (argon2) verification")
    ap.add_argument("--index-timeout", type=float, default=6 * 3600, help="seconds to wait for the index to drain")
    ap.add_argument("--seed", type=int, default=1234, help="note generator seed")
    ap.add_argument("--keep", action="store_true", help="keep the temp data dir")
    args = ap.parse_args()
    if not 1 <= args.n <= 100_000:
        ap.error("--n must be between 1 and 100000")
    conc_n = args.concurrent_n if args.concurrent_n is not None else min(400, args.n // 5)

    cores = os.cpu_count() or 1
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    load0 = os.getloadavg()[0]
    gen = NoteGenerator(args.seed)
    revision = code_revision()
    start_wall = time.time()
    t_bench = time.perf_counter()

    with service(args) as (base, info):
        pid = info.get("pid")
        with httpx.Client(base_url=base, timeout=30) as c:
            h = c.get("/health").json()
        embedder_desc = f"{h['embedder']} ({h['embedding_model']})"
        org = signup(base)
        log(f"signed up {org['slug']}; measuring auth overhead on the idle service")
        auth = measure_auth(base, org["key"], args.auth_samples, args.fresh_keys)

        log(f"capturing {args.n} thoughts sequentially")
        cpu0 = cpu_seconds(pid)
        seq = capture_sequential(base, org["key"], gen, 0, args.n)
        seq_wall = seq["t_end"] - seq["t_first"]
        pub = Api(base)
        pending_after_seq = pending_jobs(pub)
        conc = None
        if conc_n > 0:
            log(f"capturing {conc_n} more with {args.concurrency} concurrent clients")
            conc = capture_concurrent(base, org["key"], gen, args.n, conc_n, args.concurrency)
        pending_after_capture = pending_jobs(pub)
        t_capture_end = time.perf_counter()
        all_ids = seq["ids"] + (conc["ids"] if conc else [])
        all_chunks = seq["chunks"] + (conc["chunks"] if conc else [])
        with Api(base, org["key"]) as _api:
            indexed_at_end = count_indexed_prefix(_api, all_ids)
        busy_search = None
        if args.busy_searches > 0 and indexed_at_end < len(all_ids):
            log(f"REST search x{args.busy_searches} while the worker is indexing "
                f"({len(all_ids) - indexed_at_end} thoughts to go)")
            busy_search = search_rest(base, org["key"], queries(args.busy_searches, seed=3), warmup=0)
        log(f"captures done; {indexed_at_end}/{len(all_ids)} thoughts indexed, {pending_after_capture} jobs pending; "
            "waiting for the index")
        t_indexed = wait_all_indexed(base, org["key"], all_ids, args.index_timeout)
        cpu1 = cpu_seconds(pid)
        total_idx = t_indexed - seq["t_first"]
        drain = t_indexed - t_capture_end
        remaining = len(all_ids) - indexed_at_end
        remaining_chunks = sum(all_chunks[indexed_at_end:])
        indexing = {
            "thoughts": len(all_ids), "chunks": sum(all_chunks),
            "chunks_per_thought": round(sum(all_chunks) / len(all_chunks), 2),
            "first_capture_to_all_indexed_s": round(total_idx, 1),
            "after_last_capture_s": round(drain, 1),
            "pending_jobs_after_sequential": pending_after_seq,
            "pending_jobs_after_all_captures": pending_after_capture,
            "thoughts_not_indexed_after_captures": remaining,
            "chunks_per_s_overall": round(sum(all_chunks) / total_idx, 1),
            "thoughts_per_s_overall": round(len(all_ids) / total_idx, 1),
            "chunks_per_s_drain": round(remaining_chunks / drain, 1) if remaining >= 20 and drain > 2 else None,
            "server_cpu_s_capture_and_index": round(cpu1 - cpu0, 1) if cpu0 is not None and cpu1 is not None else None,
        }
        # Capacity in thoughts/s: the lower of the whole run's rate (every embedding, at capture or in the worker)
        # and the drain's (when it lasted long enough), so "half the capacity" stays below it either way.
        capacity = len(all_ids) / total_idx
        if remaining >= 20 and drain > 2:
            capacity = min(capacity, remaining / drain)
        indexing["capacity_thoughts_per_s"] = round(capacity, 2)
        paced = None
        if args.paced > 0:
            rate = args.paced_rate or min(5.0, 0.5 * capacity)
            log(f"paced capture: {args.paced} thoughts at {rate:.2f}/s (capacity ~{capacity:.1f}/s), polling each every 20 ms")
            paced = paced_indexing(base, org["key"], gen, args.n + conc_n, args.paced, rate)
        isolated = None
        if args.isolated > 0:
            log(f"isolated captures: {args.isolated}, each after the previous one is indexed")
            isolated = isolated_indexing(base, org["key"], gen, args.n + conc_n + args.paced, args.isolated)

        qs = queries(args.searches)
        log(f"REST search x{len(qs)}")
        rest = search_rest(base, org["key"], qs)
        log(f"MCP search x{len(qs)} (one session) + x{min(args.mcp_fresh, len(qs))} (fresh sessions) "
            f"+ x{len(qs)} (bare JSON-RPC)")
        mcp = asyncio.run(search_mcp(org["mcp_url"], org["key"], qs, min(args.mcp_fresh, len(qs))))
        mcp_raw = search_mcp_raw(org["mcp_url"], org["key"], qs)
        rss = rss_mb(pid)
        pub.close()

    # -- print
    cap = ms(seq["lat"])
    conc_ms = ms(conc["lat"]) if conc else None
    rest_ms = ms(rest["lat"])
    mcp_ms = ms(mcp["reused"])
    mcp_raw_ms = ms(mcp_raw)
    mcp_fresh_ms = ms(mcp["fresh"]) if mcp["fresh"] else None
    paced_ack = ms(paced["ack"]) if paced else None
    paced_idx = ms(paced["indexed"]) if paced else None
    hash_note = args.embedder == "hash" and not args.url

    print()
    print("Memex foundation benchmark")
    print(f"  machine: {cores} cores ({affinity} usable), load average {load0:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end; Python {sys.version.split()[0]}")
    where = f"started by the bench as a subprocess (pid {pid}, ready in {info['ready_s']} s)" if info["started_by_bench"] \
        else f"already running at {base}"
    print(f"  service: {base}, {where}")
    if info["started_by_bench"]:
        print(f"  code: {revision} (at {time.strftime('%Y-%m-%d %H:%M', time.localtime(start_wall))})")
    print(f"  embedder: {embedder_desc}; N = {args.n:,} sequential + {conc_n:,} concurrent + {args.paced} paced thoughts "
          f"({indexing['chunks_per_thought']} chunks each on average)")
    if hash_note:
        print("  NOTE: --embedder hash: the feature-hashing test embedder, NOT the model. Indexing figures say nothing about")
        print("        the model's throughput, and search latency excludes the model's query embedding (a few ms per query).")
    print()
    print(row("capture, sequential, 1 keep-alive client (acknowledged)",
              f"p50 {cap['p50']:.1f}  p95 {cap['p95']:.1f}  p99 {cap['p99']:.1f} ms",
              verdict(cap["p50"], TARGETS["capture_p50_ms"])))
    print(row("  throughput", f"{args.n / seq_wall:,.1f} captures/s over {seq_wall:.1f} s"))
    if conc:
        print(row(f"capture, {args.concurrency} concurrent clients ({conc_n} thoughts)",
                  f"p50 {conc_ms['p50']:.1f}  p95 {conc_ms['p95']:.1f}  p99 {conc_ms['p99']:.1f} ms"))
        print(row("  throughput", f"{conc_n / conc['wall']:,.1f} captures/s over {conc['wall']:.1f} s"))
    print(row("all vector-indexed, from the first capture",
              f"{indexing['first_capture_to_all_indexed_s']:,.1f} s ({indexing['after_last_capture_s']:,.1f} s after the last)"))
    print(row("  implied embedder throughput (overall)",
              f"{indexing['chunks_per_s_overall']:,.1f} chunks/s = {indexing['thoughts_per_s_overall']:,.1f} thoughts/s"))
    if indexing["chunks_per_s_drain"]:
        print(row("  during the drain after capture (no ingest competing)", f"{indexing['chunks_per_s_drain']:,.1f} chunks/s"))
    if indexing["server_cpu_s_capture_and_index"] is not None:
        print(row("  server CPU time, capture + indexing", f"{indexing['server_cpu_s_capture_and_index']:,.1f} s"))
    if paced:
        print(row(f"paced capture at {paced['rate']:.2f}/s ({paced['rate'] / capacity:.0%} of capacity), acknowledged",
                  f"p50 {paced_ack['p50']:.1f}  p95 {paced_ack['p95']:.1f} ms",
                  verdict(paced_ack["p50"], TARGETS["capture_p50_ms"])))
        print(row("  ack -> GET shows indexed (polled every 20 ms)",
                  f"p50 {paced_idx['p50']:.0f}  p95 {paced_idx['p95']:.0f}  max {paced_idx['max']:.0f} ms",
                  verdict(paced_idx["p95"] / 1000, TARGETS["indexed_after_capture_s"]) + " (p95, s)"))
    if isolated:
        ia, ii = ms(isolated["ack"]), ms(isolated["indexed"])
        print(row(f"isolated captures (x{args.isolated}, no backlog), acknowledged",
                  f"p50 {ia['p50']:.1f}  p95 {ia['p95']:.1f} ms"))
        print(row("  ack -> GET shows indexed (polled every 20 ms)",
                  f"p50 {ii['p50']:.0f}  p95 {ii['p95']:.0f}  max {ii['max']:.0f} ms",
                  verdict(ii["p95"] / 1000, TARGETS["indexed_after_capture_s"]) + " (p95, s)"))
    total_thoughts = indexing["thoughts"] + (args.paced if paced else 0) + (args.isolated if isolated else 0)
    print(row(f"search REST POST /v1/search, top_k 10, at {total_thoughts:,} thoughts",
              f"p50 {rest_ms['p50']:.1f}  p95 {rest_ms['p95']:.1f} ms ({rest['mean_hits']:.1f} hits)",
              verdict(rest_ms["p50"], TARGETS["search_p50_ms"])))
    if busy_search:
        b = ms(busy_search["lat"])
        print(row(f"search REST while indexing ({indexing['thoughts_not_indexed_after_captures']} thoughts queued)",
                  f"p50 {b['p50']:.1f}  p95 {b['p95']:.1f} ms"))
    print(row("search MCP semantic_search, one session reused",
              f"p50 {mcp_ms['p50']:.1f}  p95 {mcp_ms['p95']:.1f} ms", verdict(mcp_ms["p50"], TARGETS["search_p50_ms"])))
    print(row("  same call as bare JSON-RPC POSTs (server share, no SDK)",
              f"p50 {mcp_raw_ms['p50']:.1f}  p95 {mcp_raw_ms['p95']:.1f} ms"))
    if mcp_fresh_ms:
        print(row("search MCP, fresh session per call (connect+initialize+call)",
                  f"p50 {mcp_fresh_ms['p50']:.1f}  p95 {mcp_fresh_ms['p95']:.1f} ms"))
    print(row("GET /health (unauthenticated)", f"p50 {auth['health']['p50']:.2f}  p95 {auth['health']['p95']:.2f} ms"))
    print(row("GET /v1/org (cached API key)", f"p50 {auth['org']['p50']:.2f}  p95 {auth['org']['p95']:.2f} ms"))
    print(row("  => cached-auth overhead (p50 difference)", f"{auth['cached_auth_overhead_p50_ms']:.2f} ms"))
    print(row(f"first request with a fresh key (uncached argon2id), x{args.fresh_keys}",
              f"p50 {auth['first_uncached']['p50']:.1f}  max {auth['first_uncached']['max']:.1f} ms "
              f"(verify ~{auth['argon2_verify_p50_ms']:.1f} ms)"))
    if rss:
        print(row("server RSS at the end", f"{rss:,.0f} MB"))
    throttled = seq["throttled"]
    if throttled:
        print(f"  ({throttled} requests were rate limited (429) and retried; their wait is excluded)")
    print(f"  bench wall time {time.perf_counter() - t_bench:,.0f} s")

    summary = {
        "bench": "foundation", "cores": cores, "n": args.n, "concurrent_n": conc_n, "embedder": h["embedder"],
        "model": h["embedding_model"], "started_by_bench": info["started_by_bench"],
        "code": revision if info["started_by_bench"] else None, "load_avg_start": round(load0, 1),
        "capture_ms": cap, "capture_concurrent_ms": conc_ms, "concurrency": args.concurrency,
        "capture_per_s": round(args.n / seq_wall, 1), "indexing": indexing,
        "paced_rate": round(paced["rate"], 2) if paced else None, "paced_ack_ms": paced_ack, "paced_to_indexed_ms": paced_idx,
        "isolated_ack_ms": ms(isolated["ack"]) if isolated else None,
        "isolated_to_indexed_ms": ms(isolated["indexed"]) if isolated else None,
        "search_rest_ms": rest_ms, "search_rest_while_indexing_ms": ms(busy_search["lat"]) if busy_search else None,
        "search_mcp_ms": mcp_ms, "search_mcp_raw_jsonrpc_ms": mcp_raw_ms, "search_mcp_fresh_session_ms": mcp_fresh_ms,
        "search_at_thoughts": total_thoughts, "auth": auth, "server_rss_mb": rss, "server_ready_s": info.get("ready_s"),
        "wall_s": round(time.perf_counter() - t_bench, 1),
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
