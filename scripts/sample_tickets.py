"""Synthetic support tickets with known labels (and a small knowledge base) for demos and tests.

Tickets are drawn from many hand-written templates per label (billing, bug,
feature_request, account, other) with random slot values, greetings and sign-offs, so
accuracy against the known labels is measurable. Deterministic for a given seed.

    python scripts/sample_tickets.py OUT_DIR [--rows 2000] [--seed 0]

writes OUT_DIR/tickets.parquet (id, text, channel) and OUT_DIR/labels.parquet (id, label).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

LABELS = ["billing", "bug", "feature_request", "account", "other"]
WEIGHTS = [0.26, 0.26, 0.16, 0.18, 0.14]

SLOTS = {
    "product": [
        "the mobile app",
        "the web dashboard",
        "the desktop client",
        "the API",
        "the Android app",
        "the iOS app",
        "the browser extension",
        "the reporting module",
        "the admin console",
    ],
    "plan": ["Pro", "Team", "Business", "Starter", "Enterprise", "Premium"],
    "amount": ["$9.99", "$19", "$49.00", "$120", "EUR 29", "$299", "$15.50", "GBP 12"],
    "month": [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ],
    "device": [
        "my iPhone 14",
        "a Pixel 7",
        "Windows 11",
        "my MacBook",
        "an iPad",
        "Ubuntu 22.04",
        "a Samsung Galaxy S23",
        "Chrome on Linux",
    ],
    "browser": ["Chrome", "Firefox", "Safari", "Edge"],
    "feature": [
        "dark mode",
        "export to CSV",
        "a calendar view",
        "bulk editing",
        "keyboard shortcuts",
        "an offline mode",
        "Slack notifications",
        "custom fields",
        "two-way sync with Google Sheets",
        "recurring tasks",
        "a public API for reports",
        "SSO with Okta",
        "a Gantt chart",
    ],
    "error": [
        "error 500",
        "a blank white screen",
        "'Something went wrong'",
        "error code E102",
        "a timeout",
        "'Unexpected token'",
        "a spinning wheel forever",
        "HTTP 403",
    ],
    "action": [
        "upload a file",
        "save my changes",
        "open the settings page",
        "export a report",
        "sync my data",
        "log out",
        "share a document",
        "print an invoice",
        "search for a contact",
    ],
    "days": ["two days", "a week", "three days", "since yesterday", "10 days", "since the last update"],
    "email": ["anna@example.com", "j.smith@example.org", "mark.t@example.net", "li.wei@example.com"],
    "topic": [
        "your office hours",
        "a partnership",
        "your company's history",
        "a speaking opportunity",
        "your privacy policy",
        "job openings",
        "a press interview",
        "where your servers are located",
    ],
}

TEMPLATES = {
    "billing": [
        "I was charged twice for my {plan} subscription in {month}. Please refund the duplicate payment of {amount}.",
        "My invoice for {month} shows {amount} but my plan is supposed to be cheaper. Can you fix the invoice?",
        "I cancelled my {plan} plan last month but you still billed my credit card {amount}.",
        "How do I get a refund for the {amount} charge? I did not authorise it.",
        "Can you send me a VAT invoice for the {month} payment? I need it for my accountant.",
        "The price of the {plan} plan went up to {amount} without any notice. Why was I charged more?",
        "My payment keeps getting declined when I try to renew the {plan} subscription.",
        "I want to switch from monthly to annual billing for the {plan} plan. Will I be charged {amount} now?",
        "There is an unknown charge of {amount} on my bank statement from your company.",
        "Please update the billing address on my invoices and reissue the {month} invoice.",
        "I was promised a discount on the {plan} plan but the bill still says {amount}.",
        "Do you offer a refund if I downgrade from {plan} in the middle of the billing cycle?",
        "The receipt for my {amount} payment never arrived. Where can I download my invoices?",
        "Why did my trial convert to a paid {plan} plan without asking me? I want my {amount} back.",
    ],
    "bug": [
        "{product} crashes every time I try to {action} on {device}.",
        "When I {action} in {product} I get {error}. This started {days} ago.",
        "{product} is stuck on {error} after the latest update. Nothing loads.",
        "The {action} button does nothing in {browser}. It worked before the update.",
        "Since {days} {product} logs me out randomly and loses my unsaved work.",
        "Notifications stopped working on {device}; I do not receive anything anymore.",
        "Dates in the report are shifted by one day. Looks like a timezone bug in {product}.",
        "Search returns no results even for items I can see in the list. Broken {days}.",
        "The page freezes with {error} whenever I {action}. Tried {browser} and another browser.",
        "Images fail to upload in {product}, the progress bar stops at 99% and shows {error}.",
        "Sync is broken: changes made on {device} never appear in {product}.",
        "{product} uses 100% CPU and becomes unresponsive after a few minutes on {device}.",
        "The CSV export is corrupted, all the columns are mixed up.",
        "I get {error} when I open any shared document in {product}.",
    ],
    "feature_request": [
        "It would be great if {product} had {feature}. Any plans to add it?",
        "Please add {feature}. Our team would use it every day.",
        "Feature request: {feature} for {product}.",
        "Could you consider adding {feature}? Competitors already offer it.",
        "We would love to see {feature} in the next release.",
        "Is {feature} on your roadmap? It would save us hours each week.",
        "Suggestion: let users choose {feature} in the settings.",
        "Our company would upgrade to {plan} if you supported {feature}.",
        "Can you make it possible to get {feature}? Right now we have to do it by hand.",
        "I'd like to request {feature} so that we can stop using spreadsheets.",
        "An improvement idea: {feature} would make {product} much easier to use.",
    ],
    "account": [
        "I forgot my password and the reset email never arrives at {email}.",
        "How do I change the email address on my account to {email}?",
        "I lost my phone and can't log in because of two-factor authentication.",
        "Please delete my account and all my personal data.",
        "My account is locked after too many login attempts. Can you unlock it?",
        "I can't sign in with Google anymore, it says the account does not exist.",
        "Someone else may have accessed my account, I see logins from another country.",
        "How can I transfer ownership of my account to my colleague {email}?",
        "I want to merge my two accounts into one. Is that possible?",
        "The verification code for my login never arrives by SMS.",
        "Please change the username on my profile, I made a typo when I signed up.",
        "I need to add a second admin to our organisation account.",
    ],
    "other": [
        "Hi, I'd like to know more about {topic}.",
        "Who should I contact about {topic}?",
        "Just wanted to say thank you, your support team was very helpful last week!",
        "Do you have an office in Berlin? I'd like to visit.",
        "Are you attending any conferences this year?",
        "I'm writing a blog post about productivity tools, can I quote your website?",
        "What is your company's policy on remote work? I'm asking about {topic}.",
        "Could you tell me about {topic}? I could not find it on the website.",
        "Great product, keep up the good work.",
        "I have a question about {topic}, not about my account.",
        "Is there a community forum where users share tips?",
    ],
}

GREETINGS = ["", "", "Hello, ", "Hi team, ", "Hi, ", "Good morning. ", "Dear support, "]
SIGNOFFS = ["", "", "", " Thanks.", " Thank you!", " Regards, Sam", " Please help.", " Cheers"]
CHANNELS = ["email", "chat", "web_form", "phone_transcript"]


def generate(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` tickets: dicts with ``id``, ``text``, ``channel`` and ``label`` (the known truth)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = rng.choices(LABELS, WEIGHTS)[0]
        body = rng.choice(TEMPLATES[label])
        body = body.format(**{k: rng.choice(v) for k, v in SLOTS.items()})
        text = (rng.choice(GREETINGS) + body[0].upper() + body[1:] + rng.choice(SIGNOFFS)).strip()
        rows.append({"id": f"T{seed:03d}-{i:06d}", "text": text, "channel": rng.choice(CHANNELS), "label": label})
    return rows


KB_TOPICS = [
    ("Resetting your password", "Open the sign-in page, choose 'Forgot password' and follow the link we email you."),
    ("Changing your email address", "Go to Settings > Profile, enter the new address and confirm it from your inbox."),
    ("Two-factor authentication", "Enable 2FA under Settings > Security with an authenticator app or SMS codes."),
    ("Requesting a refund", "Refunds for duplicate or unauthorised charges are issued within 5 business days."),
    ("Downloading invoices", "Invoices and receipts are under Billing > History; each can be downloaded as PDF."),
    ("Exporting data to CSV", "Use Reports > Export and pick CSV; large exports are emailed as a download link."),
    ("Fixing sync problems", "Sign out and in again, check the device clock, then force a sync from the menu."),
    ("Keyboard shortcuts", "Press ? anywhere in the app to see every keyboard shortcut."),
    ("Deleting your account", "Account deletion removes all personal data after a 14-day grace period."),
    ("Upgrading your plan", "Switch plans under Billing > Plan; upgrades are prorated for the current cycle."),
]


def generate_kb(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` knowledge-base articles (``id``, ``text``): variations over a few topics."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        title, body = KB_TOPICS[i % len(KB_TOPICS)]
        extra = rng.choice(
            [
                "",
                " Contact support if this does not help.",
                " This applies to all plans.",
                " See also the related articles below.",
                " Updated for the latest release.",
            ]
        )
        rows.append({"id": f"kb-{i:05d}", "text": f"{title}. {body}{extra}"})
    return rows


def write_tickets(out_dir: str | Path, n: int, seed: int = 0, truth_dir: str | Path | None = None) -> dict[str, Path]:
    """Write ``tickets.parquet`` (id, text, channel) and the known labels to ``labels.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir, truth_dir = Path(out_dir), Path(truth_dir or out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    truth_dir.mkdir(parents=True, exist_ok=True)
    rows = generate(n, seed)
    tickets = pa.table({k: [r[k] for r in rows] for k in ("id", "text", "channel")})
    labels = pa.table({k: [r[k] for r in rows] for k in ("id", "label")})
    paths = {"tickets": out_dir / "tickets.parquet", "labels": truth_dir / "labels.parquet"}
    pq.write_table(tickets, paths["tickets"], row_group_size=512)
    pq.write_table(labels, paths["labels"])
    return paths


def write_kb(out_dir: str | Path, n: int, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = generate_kb(n, seed)
    path = out_dir / "articles.parquet"
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("id", "text")}), path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name, path in write_tickets(args.out_dir, args.rows, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
