"""The ``attnkit`` command line (``attnkit = attnkit.cli:main``): :func:`main` runs it,
:func:`build_parser` builds its parser (:func:`build_parsers`: with each command's own), :data:`COMMANDS` names
its subcommands.

:mod:`.command` holds the parser and what the subcommands share; each subcommand is a module here
(``demo``, ``viz``, ``complexity``, ``bench``, ``lab``, ``train``). Importing this package imports
no torch: a mistyped argument is answered before torch is paid for.
"""

from .command import COMMANDS, build_parser, build_parsers, main

__all__ = ["COMMANDS", "build_parser", "build_parsers", "main"]
