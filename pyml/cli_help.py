"""How the `pyml` command's help reads: in click's conventions, which newcomers know.

typer (0.29 here) writes every option's Python type beside it, a flag's too (`--resume <bool>`,
although a flag takes no value), a list argument's as `<list[Path]>`, the required arguments of a
usage line in braces (`pyml init [OPTIONS] {folder}`), and keeps the line breaks of a docstring's
first paragraph in the list of commands. `Typer` here is typer's, with commands of the class
below: flags show no type, an argument is named in capitals as the docstrings name it (`pyml init
[OPTIONS] FOLDER`, `[PATH]` when it may be left out, `SPECS...` for several, shown by their
elements' type), and each command's first paragraph is one line in the list.

typer builds the parameters itself and takes no class for them, so a command or group gives the
ones it is handed the subclasses below, once, when it is made.
"""

from __future__ import annotations

import re

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

HELP_OPTION_NAMES = ["-h", "--help"]


class ReadableOption(TyperOption):
    def display_type_rich(self, ctx):
        return None if self.is_flag else super().display_type_rich(ctx)


class ReadableArgument(TyperArgument):
    @property
    def display_name_raw(self) -> str:
        return self.metavar or self.name.upper()

    def display_type(self, ctx) -> str:
        # several paths are shown as SPECS... <path>, not <list[Path]>
        shown = super().display_type(ctx)
        return re.sub(r"^<list\[(\w+)\]>$", lambda m: f"<{m[1].lower()}>", shown)

    def get_usage_pieces(self, ctx) -> list[str]:
        name = self.display_name_raw if self.required else f"[{self.display_name_raw}]"
        return [name + ("..." if self.nargs != 1 else "")]


READABLE = {TyperOption: ReadableOption, TyperArgument: ReadableArgument}


def readable(param) -> None:
    param.__class__ = READABLE.get(type(param), type(param))


class ReadableParameters:
    """Gives a command's or group's parameters, its help option included, the classes above."""

    def __init__(self, *args, params=None, **settings):
        for param in params or []:
            readable(param)
        super().__init__(*args, params=params, **settings)

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            readable(option)
        return option


class ReadableCommand(ReadableParameters, TyperCommand):
    def __init__(self, name, *, help=None, short_help=None, **settings):
        if short_help is None and help:
            short_help = " ".join(help.split("\n\n")[0].split())
        super().__init__(name, help=help, short_help=short_help, **settings)


class ReadableGroup(ReadableParameters, TyperGroup):
    pass


class Typer(typer.Typer):
    """typer.Typer with -h beside --help, whose groups and commands are the readable ones."""

    def __init__(self, **settings):
        super().__init__(cls=ReadableGroup,
                         context_settings={"help_option_names": HELP_OPTION_NAMES}, **settings)

    def command(self, name=None, *, cls=ReadableCommand, **settings):
        return super().command(name, cls=cls, **settings)
