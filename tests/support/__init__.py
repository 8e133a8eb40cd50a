"""Helpers shared by the test tiers (fake engine, loopback servers, ledgers); no fixtures here."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""
