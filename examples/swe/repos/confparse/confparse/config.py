"""A parsed configuration with `${section.key}` references resolved on read."""

from __future__ import annotations

from confparse.parser import parse
from confparse.values import to_bool, to_duration, to_int, to_list

_MISSING = object()


class Config:
    """Read access to sections of keys, with references and typed getters."""

    def __init__(self, sections: dict[str, dict[str, str]]) -> None:
        self._sections = sections

    @classmethod
    def from_text(cls, text: str) -> Config:
        return cls(parse(text))

    def sections(self) -> list[str]:
        return list(self._sections)

    def get(self, section: str, key: str, default: object = _MISSING) -> str:
        """The value with its references resolved; `default` when the key is missing."""
        values = self._sections.get(section, {})
        if key.lower() not in values:
            if default is _MISSING:
                raise KeyError(f"no key {key!r} in section [{section}]")
            return str(default)
        return self._resolve(section, key.lower(), ())

    def get_int(self, section: str, key: str) -> int:
        return to_int(self.get(section, key))

    def get_bool(self, section: str, key: str) -> bool:
        return to_bool(self.get(section, key))

    def get_list(self, section: str, key: str) -> list[str]:
        return to_list(self.get(section, key))

    def get_duration(self, section: str, key: str) -> int:
        return to_duration(self.get(section, key))

    def _resolve(self, section: str, key: str, seen: tuple[str, ...]) -> str:
        name = f"{section}.{key}"
        if name in seen:
            raise ValueError(f"circular reference: {' -> '.join([*seen, name])}")
        if key not in self._sections.get(section, {}):
            raise KeyError(f"reference to missing key ${{{name}}}")
        value = self._sections[section][key]
        parts = []
        index = 0
        while True:
            start = value.find("${", index)
            if start < 0:
                parts.append(value[index:])
                break
            end = value.find("}", start)
            if end < 0:
                raise ValueError(f"unclosed reference in {name}: {value!r}")
            parts.append(value[index:start])
            target_section, dot, target_key = value[start + 2 : end].rpartition(".")
            if not dot:
                target_section = section
            parts.append(self._resolve(target_section, target_key.lower(), (*seen, name)))
            index = end + 1
        return "".join(parts)
