"""``pdserve serve``'s flags, generated from ``ServeConfig``: every field is a flag, nested
ones too (``--prefill-num-kv-blocks``, ``--decode-autoscaling-target-s``), so a field added
to the config is reachable from the command line without a list kept by hand.

A flag's type follows its field: ``Literal`` fields take their choices, ``bool`` fields a
``--x / --no-x`` pair, ``bool | "auto"`` fields ``true``, ``false`` or ``auto``, mappings and
lists a JSON value; an optional field takes ``none`` for null. vLLM's names are aliases where pdserve's differ (``ALIASES``). A flag left
out is None and leaves the YAML file and the environment to decide (``load_config``).
"""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr

from services.config import ServeConfig

# field path -> extra flag names (vLLM's, and pdserve's earlier hand-written ones)
ALIASES: dict[str, tuple[str, ...]] = {
    "ray_address": ("--address",),
    "auth_token": ("--api-key",),
    "prefill.num_kv_blocks": ("--prefill-kv-blocks",),
    "decode.num_kv_blocks": ("--decode-kv-blocks",),
}
_DEST = "cfg__"  # argparse dest prefix; "__" separates a nested field's path


class _Null:
    """``none`` given for an optional field: null, unlike a flag left out (None)."""


def _nullable(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def typed(text: str) -> Any:
        return _Null if text.lower() in ("none", "null") else parse(text)

    typed.__name__ = getattr(parse, "__name__", "value")  # argparse names it in errors
    return typed


def _bool_or_auto(text: str) -> bool | str:
    low = text.lower()
    if low in ("true", "false", "auto"):
        return {"true": True, "false": False}.get(low, "auto")
    raise argparse.ArgumentTypeError(f"expected true, false or auto, got {text!r}")


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def _kind(annotation: Any) -> tuple[str, Any]:
    """('model', cls) | ('bool', None) | ('bool_or_auto', None) | ('choices', [...]) |
    ('scalar', type) | ('json', None) for a field's annotation (Optional unwrapped)."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, types.UnionType):
        if len(args) == 1:
            return _kind(args[0])
        if bool in args and any(get_origin(a) is Literal for a in args):
            return "bool_or_auto", None
        return "json", None
    if get_origin(annotation) is Literal:
        return "choices", list(get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "model", annotation
    if annotation is bool:
        return "bool", None
    if annotation in (int, float, str):
        return "scalar", annotation
    if annotation is SecretStr:
        return "scalar", str
    return "json", None


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel] = ServeConfig) -> None:
    """One flag per field of ``model``, recursively, every default None."""
    _add(parser, model, ())


def _add(parser: argparse.ArgumentParser, model: type[BaseModel], path: tuple[str, ...]) -> None:
    for name, field in model.model_fields.items():
        here = (*path, name)
        kind, arg = _kind(field.annotation)
        if kind == "model":
            _add(parser, arg, here)
            continue
        dotted = ".".join(here)
        flags = ["--" + "-".join(here).replace("_", "-"), *ALIASES.get(dotted, ())]
        kw: dict[str, Any] = {
            "dest": _DEST + "__".join(here),
            "default": None,
            "help": (field.description or "").replace("%", "%%"),
            "metavar": name.upper(),
        }
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
            del kw["metavar"]
        elif kind == "choices":
            kw["choices"] = arg
            kw["type"] = _typed_choice(arg)
            del kw["metavar"]
        elif kind == "bool_or_auto":
            kw["type"] = _bool_or_auto
            kw["metavar"] = "{true,false,auto}"
        elif kind == "scalar":
            kw["type"] = arg
        else:
            kw["type"] = _json
            kw["metavar"] = "JSON"
        if type(None) in get_args(field.annotation) and "type" in kw and "choices" not in kw:
            kw["type"] = _nullable(kw["type"])
        parser.add_argument(*flags, **kw)


def _typed_choice(choices: list[Any]) -> Callable[[str], Any]:
    """A Literal of ints (or strs) takes its values' type from the command line."""
    kinds = {type(c) for c in choices}
    return kinds.pop() if len(kinds) == 1 else str


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as the nested mapping ``load_config`` takes."""
    out: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if not dest.startswith(_DEST) or value is None:
            continue
        *parents, leaf = dest.removeprefix(_DEST).split("__")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = None if value is _Null else value
    return out


def flag_paths(model: type[BaseModel] = ServeConfig) -> Mapping[str, str]:
    """Every field's dotted path -> its flag (for documentation and tests)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser, model)
    return {
        a.dest.removeprefix(_DEST).replace("__", "."): a.option_strings[0]
        for a in parser._actions
        if a.dest.startswith(_DEST)
    }
