"""An INI-style configuration reader: sections, typed values and references."""

from confparse.config import Config
from confparse.parser import ConfigError, parse
from confparse.values import to_bool, to_duration, to_int, to_list, to_size

__all__ = [
    "Config",
    "ConfigError",
    "parse",
    "to_bool",
    "to_duration",
    "to_int",
    "to_list",
    "to_size",
]
