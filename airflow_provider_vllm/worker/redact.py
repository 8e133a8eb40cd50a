"""Keep secrets out of the worker's logs.

The worker gets credentials only through its environment (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``
...; never through the job spec, see ``spec_guard``). ``install()`` adds a logging filter
that replaces the value of every such variable with ``***`` in each record, whoever logs it
(this package, vLLM, botocore, a traceback).
"""

from __future__ import annotations

import logging
import os
import re

SECRET_ENV = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY|SAS)", re.I)
MIN_SECRET_CHARS = 6  # shorter values would mask ordinary words


def secret_values(env: dict[str, str] | None = None) -> list[str]:
    """Values of environment variables whose names say they hold secrets, longest first."""
    env = os.environ if env is None else env
    vals = {v for k, v in env.items() if SECRET_ENV.search(k) and len(v) >= MIN_SECRET_CHARS}
    return sorted(vals, key=len, reverse=True)


class RedactSecrets(logging.Filter):
    """Replaces known secret values in a record's message (after %-formatting) and traceback."""

    def __init__(self, secrets: list[str]):
        super().__init__()
        self.secrets = secrets

    def redact(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            record.msg = self.redact(record.getMessage())
            record.args = None
            if record.exc_info:
                record.exc_text = self.redact(logging.Formatter().formatException(record.exc_info))
                record.exc_info = None
        return True


def install(env: dict[str, str] | None = None) -> RedactSecrets:
    """Add the filter to every handler of the root logger (filters on handlers see all loggers)."""
    f = RedactSecrets(secret_values(env))
    for h in logging.getLogger().handlers:
        h.addFilter(f)
    return f
