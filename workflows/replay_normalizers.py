"""What a rollout may ignore when a new attempt's request is matched against a recorded call
(`RolloutSpec.replay`): named presets for the text tools print differently on every run, and
the rollout's own regular expressions. Each match in a message's text is replaced by one
placeholder before the comparison; the stored prompt is always the text the agent sent.

Pure data and `re`, so the contracts validate a spec with them and the gateway applies them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

PRESETS: dict[str, str] = {
    # `passed in 0.53s`, `took 12 ms`, `1.2 seconds`, `3 min`, `0:00:03.25` (not a bare `m`
    # or `h`: `5 m` may be metres)
    "durations": (
        r"\b\d+(?:\.\d+)?\s?(?:ns|us|µs|ms|s|sec|secs|seconds?|min|mins|minutes?|hrs?|hours?)\b"
        r"|\b\d+:\d{2}:\d{2}(?:\.\d+)?\b"
    ),
    # `2026-12-03T07:38:41.123Z`, `2026-12-03 07:38:41+00:00`
    "iso_timestamps": (
        r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"
    ),
    # `/tmp/pytest-of-root/pytest-3/test_x0`, `/var/folders/…`, `/tmp/tmpa1b2c3`
    "temp_paths": r"(?:/private)?/(?:tmp|var/folders|var/tmp)(?:/[\w.@%+=:-]+)*",
    # `0x7f3a9c2e`, a git sha, a uuid's hex (at least one letter: `31415926` is a number)
    "hex_ids": r"\b0x[0-9a-fA-F]+\b|\b(?=[0-9]*[a-f])[0-9a-f]{8,}\b",
    # `pid 12345`, `pid=12345`, and a log line's leading `[12345]`
    "pids": r"\b(?i:pid)[ =:]?\d+\b|(?m:^\[\d{2,}\])",
}

# What each span becomes: a character no tool prints, so texts differing only in such spans
# compare equal and no others do.
PLACEHOLDER = "\u2400"

MAX_PATTERNS = 16
MAX_PATTERN_LENGTH = 500


def check_presets(names: Sequence[str]) -> None:
    """Raise ValueError naming a preset DARL does not ship."""
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise ValueError(
            f"unknown normalizer(s) {unknown}: the presets are {', '.join(sorted(PRESETS))}"
        )


def check_patterns(patterns: Sequence[str]) -> None:
    """Raise ValueError for a pattern that does not compile, or too many or too long ones (they
    travel in every rollout token of the attempt)."""
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"at most {MAX_PATTERNS} patterns")
    for pattern in patterns:
        if len(pattern) > MAX_PATTERN_LENGTH:
            raise ValueError(f"a pattern is longer than {MAX_PATTERN_LENGTH} characters")
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"pattern {pattern!r} does not compile: {err}") from err


@dataclass(frozen=True)
class Normalizer:
    """The spans a rollout ignores when it matches requests: each expression compiled and
    applied on its own (so one's flags, groups and backreferences are its own), in order."""

    presets: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    _compiled: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_presets(self.presets)
        check_patterns(self.patterns)
        parts = [PRESETS[name] for name in self.presets] + list(self.patterns)
        # Frozen: set once, here.
        object.__setattr__(self, "_compiled", tuple(re.compile(p) for p in parts))

    def __bool__(self) -> bool:
        return bool(self._compiled)

    def apply(self, text: str) -> str:
        for expression in self._compiled:
            text = expression.sub(PLACEHOLDER, text)
        return text
