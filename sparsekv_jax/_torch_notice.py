"""Silences transformers' "PyTorch was not found. Models won't be available..." notice.

transformers prints it on import when torch is absent; this library uses only its tokenizers and
configs, so for a plain install (no torch) it is noise on every command. transformers logs it while
being imported, so its own ``transformers.logging.set_verbosity_*`` comes too late, and its
``TRANSFORMERS_NO_ADVISORY_WARNINGS`` variable would have to be set in the user's environment (and
would hide every advisory message). Instead a `logging.Filter` on transformers' root logger, added
before transformers is imported (the package's ``__init__`` imports this module first), drops that
one message; its other messages stay.
"""

from __future__ import annotations

import logging


class NoTorchNotice(logging.Filter):
    """Drops the records whose message starts with "PyTorch was not found"."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


if not any(isinstance(f, NoTorchNotice) for f in logging.getLogger("transformers").filters):
    logging.getLogger("transformers").addFilter(NoTorchNotice())
