"""How an engine setting is declared: once, as a field of ``EngineOptions`` (config.py) whose
metadata is a :class:`Setting`. From that one declaration come the drop-in constructor's keyword
(``engine_options``), the flag of every command that starts or sizes an engine (``extract``,
``serve``, ``node``, ``plan``: ``add_engine_args``), the check that refuses a bad value with the
setting's name (the same for a flag and a keyword), and how ``serve`` hands it to ``vllm serve``.

Adding a setting: its field in EngineOptions with ``metadata=declare(...)``; nothing else has a list
of them (tests/test_settings.py walks the declaration through each surface).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

SETTING = "speculators_compat.setting"  # the metadata key of a declared field
HOSTS = "one engine over several hosts (docs/multi-node.md)"  # the argument group of those settings


@dataclass(frozen=True)
class Setting:
    """What a field of EngineOptions is to its users (``declare`` makes one)."""

    help: str
    parse: Callable[[str], Any] = str  # a flag's text -> the value
    check: Check | None = None  # what a value must be (the same for a keyword and a flag)
    choices: tuple | None = None
    switch: bool = False  # a flag that takes no value (True when given)
    flag: str | None = None  # the flag's name where it is not --the-field-name
    group: str | None = None  # the argument group its flag is listed in (None: the engine's)
    #: how ``serve`` passes it to ``vllm serve``: "flag" (the same flag and value, always: our default
    #: may not be vLLM's), "flag-if-set" (only a value other than the default, which is vLLM's too),
    #: "switch", "no-" (``async_scheduling=disable``: --no-async-scheduling), "ours" (taken by serve
    #: itself, not vLLM: the connector's config, the host watch) or "refuse" (a value other than the
    #: default is refused, saying ``serve_note``)
    serve: str = "flag"
    serve_note: str = ""


def declare(help: str, **kw) -> dict:
    """The metadata of a declared EngineOptions field."""
    return {SETTING: Setting(help=help, **kw)}


def declared(options_cls) -> list:
    """The declared fields of ``options_cls`` (EngineOptions), in order."""
    return [f for f in fields(options_cls) if SETTING in f.metadata]


def setting(f) -> Setting:
    return f.metadata[SETTING]


def flag_of(f) -> str:
    return setting(f).flag or "--" + f.name.replace("_", "-")


def default_of(f):
    return f.default_factory() if f.default is MISSING else f.default


# --- checks ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """What a setting's value must be: ``test`` passes it; ``expects`` says so in a message
    ("an integer >= 1"); ``why`` follows it in the keyword's message; ``none`` (the phrase after
    "or ") where None is taken too."""

    test: Callable[[Any], bool]
    expects: str
    why: str = ""
    none: str | None = None

    def wrong(self, v) -> bool:
        return not ((v is None and self.none is not None) or self.test(v))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_at_least(least: int, none: str | None = None, why: str = "") -> Check:
    return Check(lambda v: _is_int(v) and v >= least, f"an integer >= {least}", why, none)


FRACTION = Check(lambda v: _is_number(v) and 0.0 < v <= 1.0, "a fraction in (0, 1]")
SECONDS = Check(lambda v: _is_number(v) and v > 0, "a number of seconds > 0", none="None")


def one_of(choices: tuple, none: str | None = None) -> Check:
    return Check(lambda v: v in choices, f"one of {', '.join(map(str, choices))}", none=none)


def check_value(f, value) -> None:
    """ValueError naming the setting (as a keyword) when ``value`` is refused."""
    c = setting(f).check
    if c is not None and c.wrong(value):
        alt = f" or {c.none}" if c.none else ""
        raise ValueError(f"{f.name} must be {c.expects}{c.why}{alt}, not {value!r}")


def check_all(options) -> None:
    """Every declared setting of ``options`` (an EngineOptions), by its own check."""
    for f in declared(type(options)):
        check_value(f, getattr(options, f.name))


# --- the surfaces ----------------------------------------------------------------------------------


def add_engine_args(p: argparse.ArgumentParser, options_cls) -> None:
    """A flag for every declared setting of ``options_cls``, its value checked as a keyword's is."""
    groups: dict[str | None, Any] = {None: p}
    for f in declared(options_cls):
        s = setting(f)
        g = groups.get(s.group) or groups.setdefault(s.group, p.add_argument_group(s.group))
        kw: dict[str, Any] = {"dest": f.name, "default": default_of(f), "help": s.help}
        if s.switch:
            kw["action"] = "store_true"
        else:
            kw["type"] = _argparse_type(f)
            kw["metavar"] = None if s.choices else flag_of(f)[2:].upper().replace("-", "_")
            if s.choices:
                kw["choices"] = s.choices
        g.add_argument(flag_of(f), **kw)


def _argparse_type(f) -> Callable[[str], Any]:
    s = setting(f)

    def parse(text: str):
        try:
            value = s.parse(text)
        except ValueError:
            value = _UNPARSED
        if value is _UNPARSED or (s.check is not None and not s.choices and s.check.wrong(value)):
            raise argparse.ArgumentTypeError(f"expected {s.check.expects if s.check else 'a value'}, not {text!r}")
        return value

    parse.__name__ = f.name  # (argparse names the type in its messages)
    return parse


_UNPARSED = object()


def from_args(args: argparse.Namespace, options_cls) -> dict:
    """The declared settings a command's parsed flags hold, by name."""
    return {f.name: getattr(args, f.name) for f in declared(options_cls) if hasattr(args, f.name)}


def keywords(options_cls, given: dict) -> dict:
    """The drop-in constructor's engine keywords, checked: TypeError naming one it does not know
    (with the settings it does), ValueError naming a refused value."""
    by_name = {f.name: f for f in declared(options_cls)}
    unknown = sorted(set(given) - set(by_name))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}; the engine settings are: {', '.join(by_name)}"
        )
    for name, value in given.items():
        check_value(by_name[name], value)
    return dict(given)
