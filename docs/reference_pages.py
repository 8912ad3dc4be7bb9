"""The reference pages made from the code, never written by hand: the error table (from
`weightserver.protocol.errors.STATUS_CODES`), the command line (from `weightserver.cli`'s argparse
parser) and the server configuration (from `ServerConfig`'s fields and how `serve` fills them).

A page asks for one with a marker line, ``<!-- generated: errors -->`` (or ``cli``, ``configuration``);
`expand` replaces each marker with the markdown. The MkDocs hook (docs/hooks.py) calls it at build
time; tests import this file by path, so nothing here needs mkdocs.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Callable, Iterator

MARKER = re.compile(r"^<!-- generated: (\w+) -->$", re.MULTILINE)


def cell(text: object) -> str:
    """`text` fit for one markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text: object) -> str:
    """`text` as inline code in a table cell."""
    text = str(text).replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def first_line(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


# Errors ----------------------------------------------------------------------------------


def errors_markdown() -> str:
    """Every exception of the status table: its gRPC status, its base class and what it means."""
    from weightserver.protocol import errors

    rows = [
        [code(cls.__name__), code(status), code(cls.__mro__[1].__name__), cell(first_line(cls.__doc__))]
        for cls, status in errors.STATUS_CODES.items()
    ]
    intro = (
        f"Generated from `STATUS_CODES` in `weightserver/protocol/errors.py`: {len(rows)} exceptions, all "
        f"subclasses of `WeightServerError` and exported by `weightclient`. The server sends the name in the "
        f"trailing metadata key `{errors.ERROR_METADATA_KEY}`; a client that gets only a code raises the first "
        "class listed for it."
    )
    headers = ["exception", "gRPC status", "base class", "meaning"]
    return intro + "\n\n" + table(headers, rows)


# Command line ----------------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name, in the order `--help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's own arguments (options and positionals), without help and subcommands."""
    return [
        action
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
    ]


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help as `--help` prints it (with %(default)s and the like filled in)."""
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = parser.prog
    if parser.prog == "weightserver serve" and action.dest in computed_defaults():
        params["default"] = computed_defaults()[action.dest]  # not this machine's value
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return action.help % params


def _value(action: argparse.Action) -> str:
    """What the option takes: its metavar, its choices or its type; "" for a flag."""
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return " \\| ".join(code(choice) for choice in action.choices)
    if action.metavar is not None:
        return code(action.metavar)
    name = getattr(action.type, "__name__", None) or "str"
    return code({"parse_size": "SIZE", "_model_list": "A,B", "_parse_meta": "KEY=VALUE"}.get(name, name.upper()))


def _names(action: argparse.Action) -> str:
    return ", ".join(code(name) for name in action.option_strings) or code(action.dest)


def _options_table(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> str:
    rows = []
    for action in actions:
        required = " (required)" if action.required and action.option_strings else ""
        rows.append([_names(action), _value(action), cell(_help(parser, action) + required)])
    return table(["option", "value", "description"], rows)


def _option_sections(parser: argparse.ArgumentParser, level: str) -> list[str]:
    """The parser's options as tables: the plain ones, then one under a heading per named group."""
    plain, named = [], []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a in options(parser)]
        if not actions:
            continue
        if group.title in ("positional arguments", "options", "optional arguments"):
            plain += actions
        else:
            named.append((group, actions))
    out = ["", _options_table(parser, plain)] if plain else []
    for group, actions in named:
        out += ["", f"{level} {group.title} options", "", group.description or "", "", _options_table(parser, actions)]
    return out


def cli_markdown() -> str:
    """Every subcommand of `weightserver` and every option, with its help text."""
    from weightserver.cli import build_parser

    parser = build_parser()
    commands = subcommands(parser)
    summaries = {
        choice.dest: choice.help
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for choice in action._choices_actions
    }
    out = [
        f"Generated from `weightserver.cli.build_parser()`: {len(commands)} commands. "
        "`weightserver COMMAND --help` prints the same.",
        "",
        "## weightserver",
        "",
        parser.description or "",
        "",
        "```text\n" + parser.format_usage().strip() + "\n```",
        *_option_sections(parser, "###"),
    ]
    for name, sub in commands.items():
        out += ["", f"## weightserver {name}", "", sub.description or summaries.get(name) or ""]
        out += ["", "```text\n" + sub.format_usage().strip() + "\n```", *_option_sections(sub, "###")]
    return "\n".join(out)


# Configuration ---------------------------------------------------------------------------


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in its class's source: the comment on its line, after the comment
    lines just above it (those describe the field below them)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            trailing = [comments[node.lineno]] if node.lineno in comments else []
            found[node.target.id] = " ".join([*above, *trailing])
    return found


def _field_defaults(cls: type) -> dict[str, ast.expr]:
    """Each field's default as written in the source."""
    source = textwrap.dedent(inspect.getsource(cls))
    return {
        node.target.id: node.value
        for node in ast.parse(source).body[0].body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None
    }


def _size(value: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size and value % size == 0:
            return f"{value // size} {unit}"
    return str(value)


def computed_defaults() -> dict[str, str]:
    """`ServerConfig` fields whose default is a module constant computed at import (one per CPU,
    say): field -> the expression, which the pages show rather than this machine's value."""
    from weightserver import config

    constants = {
        target.id: node.value
        for node in ast.parse(inspect.getsource(config)).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return {
        name: ast.unparse(constants[written.id])
        for name, written in _field_defaults(config.ServerConfig).items()
        if isinstance(written, ast.Name) and not isinstance(constants.get(written.id, ast.Constant()), ast.Constant)
    }


def _default(name: str, value: object) -> str:
    """A field's default for people: a size in units, a computed one as its expression."""
    computed = computed_defaults()
    if name in computed:
        return code(computed[name])
    if isinstance(value, int) and not isinstance(value, bool) and name.endswith("_bytes"):
        return f"{code(value)} ({_size(value)})"
    return code(repr(value) if isinstance(value, str) else value)


def _sources(function: Callable, env_names: dict[str, str]) -> dict[str, set[str]]:
    """Where `function` (the CLI's `server_config`) takes each option it sets from, read from its
    code: `options["field"] = ...` of `args.DEST`, or of locals assigned from those, or of an
    environment variable named by a module constant."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    depends: dict[str, set[str]] = {}  # local name -> args dests and env constants it comes from

    def refs(node: ast.AST) -> set[str]:
        found = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "args":
                found.add("args." + sub.attr)
            elif isinstance(sub, ast.Name):
                found |= depends.get(sub.id, set()) | ({"env." + sub.id} if sub.id in env_names else set())
        return found

    sets: dict[str, set[str]] = {}
    assigns = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)]
    while True:  # until nothing new is learnt: a name may be used before the code that sets it
        before = repr(sorted((k, sorted(v)) for k, v in [*depends.items(), *sets.items()]))
        for node in assigns:
            for target in node.targets:
                pairs: Iterator[tuple[ast.expr, ast.expr]]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = zip(target.elts, node.value.elts, strict=True)
                else:
                    pairs = iter([(target, node.value)])
                for name, value in pairs:
                    if isinstance(name, ast.Name):
                        depends[name.id] = depends.get(name.id, set()) | refs(value)
                    elif isinstance(name, ast.Subscript) and isinstance(name.slice, ast.Constant):
                        sets[name.slice.value] = sets.get(name.slice.value, set()) | refs(value)
        if repr(sorted((k, sorted(v)) for k, v in [*depends.items(), *sets.items()])) == before:
            return sets


def config_fields() -> list[dict[str, str]]:
    """One record per `ServerConfig` field: name, type, default, where serve takes it from, and
    its description (the code's comment, then the help of its options)."""
    from weightserver import cli, config

    serve = subcommands(cli.build_parser())["serve"]
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in options(serve):
        by_dest.setdefault(action.dest, []).append(action)
    env_names = {name: value for name, value in vars(cli).items() if name.endswith("_ENV") and isinstance(value, str)}
    taken = _sources(cli.server_config, env_names)
    comments = _field_comments(config.ServerConfig)
    records = []
    for field in dataclasses.fields(config.ServerConfig):
        actions = list(by_dest.get(field.name, []))
        envs = []
        for source in sorted(taken.get(field.name, ())):
            kind, name = source.split(".", 1)
            if kind == "args":
                actions += [a for a in by_dest.get(name, []) if a not in actions]
            else:
                envs.append("$" + env_names[name])
        flags = [name for action in actions for name in action.option_strings]
        helps = [_help(serve, action) for action in actions if action.help]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        records.append(
            {
                "name": field.name,
                "type": str(field.type),
                "default": _default(field.name, default),
                "set by": ", ".join([*(code(f) for f in flags), *(code(e) for e in envs)]),
                "help": "; ".join(helps),
                "comment": comments.get(field.name, ""),
            }
        )
    return records


def configuration_markdown() -> str:
    """Every `ServerConfig` field with its type, default, description and `serve` option."""
    records = config_fields()
    rows = [
        [
            code(r["name"]),
            code(r["type"]),
            r["default"],
            r["set by"] or "(no option)",
            cell(r["help"]),
            cell(r["comment"]),
        ]
        for r in records
    ]
    intro = (
        f"Generated from `weightserver.config.ServerConfig` ({len(records)} fields), its comments, and the "
        "`serve` options that `weightserver.cli.server_config` reads into each field. "
        "`ServerConfig(...)` validates the combination when it is built (`__post_init__`)."
    )
    headers = ["field", "type", "default", "set by", "option help (`serve --help`)", "comment in config.py"]
    return intro + "\n\n" + table(headers, rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "errors": errors_markdown,
    "cli": cli_markdown,
    "configuration": configuration_markdown,
}


def expand(markdown: str) -> str:
    """`markdown` with every ``<!-- generated: NAME -->`` line replaced by that page part."""

    def generated(match: re.Match[str]) -> str:
        name = match[1]
        if name not in GENERATORS:
            raise KeyError(f"<!-- generated: {name} --> names no generator; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(generated, markdown)
