"""A text corpus that ships with Python: the docstrings of a fixed list of standard-library modules.

Nothing is downloaded. :func:`documents` imports each module of :data:`MODULES` (in their sorted
order) in a fresh interpreter and takes, in name order, the module's own docstring and those of its public functions,
classes, and the classes' public methods and properties, each headed by its qualified name and,
where :mod:`inspect` can read one, its signature. Only objects that say they belong to the module
(``__module__``) are taken, so a name re-exported elsewhere is read once; a text seen before is
skipped. No sets, no hash order: the same Python version gives the same text on every machine
(the docstrings themselves change between Python versions, so the corpus does too).

The fresh interpreter (``python -I -S``: no site-packages, no environment variables) is what makes
that true whatever the caller has imported: libraries patch the standard library (importing torch
replaces ``inspect.getfile``), and a patched function would drop out of, or change, the text. It
also leaves the ~120 modules out of the caller's process. This file is that interpreter's script,
so it imports nothing beyond the standard library.

The modules are pure-Python or built-in parts of the library whose docstrings do not depend on
the platform (no ``os``, ``sys``, ``shutil``, ``subprocess``, ``socket``, ``locale``...).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys
import warnings
from collections.abc import Iterable, Sequence

#: The modules read, sorted. ``builtins`` holds ``str``, ``dict``, ``int``... and their methods.
MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "asyncio.base_events", "asyncio.events", "asyncio.locks", "asyncio.queues",
    "asyncio.streams", "asyncio.tasks", "base64", "bdb", "binascii", "bisect", "builtins", "calendar", "cmd",
    "codecs", "collections", "collections.abc", "colorsys", "concurrent.futures._base", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "doctest",
    "email.feedparser", "email.header", "email.message", "email.utils", "enum", "fnmatch", "fractions", "ftplib",
    "functools", "gc", "getopt", "gettext", "glob", "graphlib", "gzip", "heapq", "hmac", "html.parser",
    "http.client", "http.cookiejar", "http.cookies", "http.server", "imaplib", "importlib.abc",
    "importlib.metadata", "inspect", "io", "ipaddress", "itertools", "json", "json.decoder", "json.encoder",
    "keyword", "logging", "mailbox", "marshal", "math", "netrc", "numbers", "operator", "optparse", "pathlib",
    "pdb", "pickle", "plistlib", "poplib", "pprint", "pstats", "pydoc", "queue", "quopri", "random", "re",
    "reprlib", "sched", "secrets", "shlex", "smtplib", "socketserver", "statistics", "string", "struct",
    "tarfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "types", "typing",
    "unittest.case", "unittest.mock", "urllib.parse", "urllib.request", "warnings", "wave", "weakref",
    "wsgiref.handlers", "xml.dom.minidom", "xml.etree.ElementTree", "xmlrpc.client", "xmlrpc.server",
    "zipfile", "zipimport", "zlib", "zoneinfo",
)

# A default such as ``<object object at 0x7f3a...>`` in a signature differs from run to run.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return "" if _ADDRESS.search(text) else text


def _entry(name: str, obj) -> tuple[str, str] | None:
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return None
    head = name if isinstance(obj, property) else name + _signature(obj)
    return head, inspect.cleandoc(doc)


def _module_entries(modname: str) -> Iterable[tuple[str, str] | None]:
    module = importlib.import_module(modname)
    yield _entry(modname, module)
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != modname:
            continue
        if inspect.isclass(obj):
            yield _entry(f"{modname}.{name}", obj)
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_"):
                    continue
                if isinstance(member, classmethod | staticmethod):
                    member = member.__func__
                if isinstance(member, property) or inspect.isroutine(member):
                    yield _entry(f"{modname}.{name}.{attr}", member)
        elif inspect.isroutine(obj):
            yield _entry(f"{modname}.{name}", obj)


def documents(modules: Sequence[str] = MODULES) -> list[str]:
    """One text per docstring: ``qualified.name(signature)``, a newline, the cleaned docstring.

    Read in a fresh ``python -I -S`` (see the module's docstring), about a second.

    Args:
        modules: standard-library module names, read in the order given (:data:`MODULES` is sorted).

    Returns:
        The documents in reading order, each text once (a later copy of an earlier docstring is
        left out).

    Raises:
        ValueError: a name that is not a standard-library module here (the message says which).
    """
    modules = list(modules)
    proc = subprocess.run([sys.executable, "-I", "-S", __file__, *modules], capture_output=True, text=True,
                          encoding="utf-8")
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise ValueError(f"reading the docstrings of {modules} failed: {last}")
    return json.loads(proc.stdout)


def read(modules: Sequence[str]) -> list[str]:
    """The documents of ``modules`` read in this process: :func:`documents` is this, run in a fresh
    interpreter; here, what the process has imported or patched can change the text."""
    docs: list[str] = []
    seen: set[str] = set()  # membership only: the order comes from the list
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated aliases (typing.io, ...) warn when touched
        for modname in modules:
            for entry in _module_entries(modname):
                if entry is None or entry[1] in seen:
                    continue
                seen.add(entry[1])
                docs.append(f"{entry[0]}\n{entry[1]}")
    return docs


def split(docs: Sequence[str], *, every: int = 10) -> tuple[str, str]:
    """``(train, validation)`` texts: every ``every``-th document (the 10th, 20th...) is held out.

    Documents are joined with a blank line; whole documents go to one side, so no docstring is
    split between training and validation.
    """
    if not isinstance(every, int) or every < 2:
        raise ValueError(f"every must be an integer >= 2, got {every!r}")
    val = [d for i, d in enumerate(docs) if i % every == every - 1]
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    return "\n\n".join(train), "\n\n".join(val)


if __name__ == "__main__":
    sys.stdout.write(json.dumps(read(sys.argv[1:])))  # ASCII (JSON escapes the rest): no encoding to agree on
