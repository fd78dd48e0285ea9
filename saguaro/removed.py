"""Spellings that were removed after a release of deprecation warnings, each with what replaced it.

A removed keyword of ``Config`` / ``LLM`` or a removed command-line flag is refused with an error that names
its replacement, rather than silently accepted or left to a bare "unexpected keyword".
"""
from __future__ import annotations

import argparse

# Config / LLM keyword -> what to write instead
OPTIONS = {
    "compile": "the fast path is the default; enforce_eager=True runs the eager reference instead (compile=False)",
    "speculator": "the SD proposer is proposer='draft' or proposer='ngram'",
    "fallback": "the cache-miss strategy is miss_strategy=...",
}

# command-line flag -> what to write instead
FLAGS = {
    "--compile": "the fast path is the default; --enforce-eager runs the eager reference instead",
    "--speculator": "use --proposer",
    "--fallback": "use --miss-strategy",
}


def refuse_options(options: dict) -> None:
    """Raise ``TypeError`` naming the replacement of the first removed keyword in ``options``."""
    for name in options:
        if name in OPTIONS:
            raise TypeError(f"{name}= was removed: {OPTIONS[name]}")


class _Removed(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0 if option_strings[0] == "--compile" else None,
                         help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} was removed: {FLAGS[option_string]}")


def add_removed_flags(parser: argparse.ArgumentParser, *flags: str) -> None:
    """Let ``parser`` refuse each of ``flags`` (keys of ``FLAGS``) with its replacement."""
    for flag in flags:
        parser.add_argument(flag, action=_Removed, dest=f"removed_{flag.lstrip('-')}")
