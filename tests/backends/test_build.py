"""The compiled-kernel cache (``attnkit/backends/_build.py``) against a hostile or broken cache folder.

Each case runs a fresh Python process (a crash there is a failed test, not a dead test run) on its
own cache folder. Where the compiler is not the point, ``cpp_extension.load`` is replaced in that
process by a fake that sleeps, says "fake compile" on stderr and copies the kernel this test
session built, so the real compiler runs at most once (in the ``prebuilt`` fixture).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from attnkit.backends import _band

pytestmark = pytest.mark.slow

FAKE_COMPILE = """
import importlib.util, shutil, sys, time
from pathlib import Path
from torch.utils import cpp_extension

def _fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
    print("attnkit-test: fake compile", file=sys.stderr, flush=True)
    time.sleep({delay})
    made = Path(build_directory) / f"{{name}}.so"
    shutil.copyfile({prebuilt!r}, made)
    spec = importlib.util.spec_from_file_location(name, made)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

cpp_extension.load = _fake_load
"""
REPORT = """
from attnkit.backends import _band
print(_band.available())
print(_band.unavailable_reason())
"""


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    """A copy of this session's compiled kernel (built here if the session's cache has none)."""
    if not _band.available():
        pytest.skip(f"no compiled kernel to copy: {_band.unavailable_reason()}")
    path = tmp_path_factory.mktemp("prebuilt") / "kernel.so"
    path.write_bytes(_band._target()[2].read_bytes())
    return path


def _entry_name() -> str:
    return _band._target()[2].name


def _private(folder: Path) -> Path:
    folder.mkdir(mode=0o700, parents=True)
    return folder


def _code(prebuilt: Path | None, delay: float = 0.0, before: str = "") -> str:
    fake = FAKE_COMPILE.format(delay=delay, prebuilt=str(prebuilt)) if prebuilt is not None else ""
    return fake + textwrap.dedent(before) + REPORT


def _env(cache: Path, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "ATTNKIT_BUILD"}
    return {**base, "ATTNKIT_CACHE": str(cache), **env}


def _python(code: str, cache: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=_env(cache, **env))


def _outcome(res: subprocess.CompletedProcess) -> tuple[str, str]:
    """(available, reason) as the child printed them; the child must have exited cleanly."""
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
    ok, reason = res.stdout.strip().splitlines()[-2:]
    return ok, reason


def _constructor_library(tmp_path: Path) -> tuple[Path, Path]:
    """A shared object whose load-time constructor creates a file: (library, that file)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the planted library")
    ran = tmp_path / "constructor-ran"
    src = tmp_path / "planted.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) {{\n'
                   f'  FILE *f = fopen("{ran}", "w"); if (f) fclose(f);\n}}\n')
    lib = tmp_path / "planted.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    return lib, ran


def test_a_library_planted_at_the_cache_name_is_not_loaded(tmp_path, prebuilt):
    lib, ran = _constructor_library(tmp_path)
    cache = _private(tmp_path / "cache")
    shutil.copyfile(lib, cache / _entry_name())
    ok, reason = _outcome(_python(_code(None), cache, ATTNKIT_BUILD="0"))
    assert not ran.exists(), "the planted library's constructor ran"
    assert ok == "False" and "SHA-256" in reason
    res = _python(_code(prebuilt), cache)  # building is allowed: the planted file is replaced
    assert _outcome(res)[0] == "True" and res.stderr.count("fake compile") == 1
    assert not ran.exists()


@pytest.mark.parametrize("where", ["staging", "entry"])
def test_a_symlink_in_the_cache_is_never_followed(tmp_path, prebuilt, where):
    cache = _private(tmp_path / "cache")
    entry = cache / _entry_name()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    lib, ran = _constructor_library(tmp_path)
    if where == "entry":  # a link to a library elsewhere: not loaded, replaced by a build
        entry.symlink_to(lib)
        before = ""
    else:  # the staging name a build used to write through (entry name, '.so' -> '.<pid>.tmp')
        before = f"""
            import os
            from pathlib import Path
            os.symlink({str(victim)!r}, Path({str(entry)!r}).with_suffix(f".{{os.getpid()}}.tmp"))
            """
    res = _python(_code(prebuilt, before=before), cache)
    assert _outcome(res)[0] == "True"
    assert victim.read_bytes() == b"precious", "the build wrote through a planted link"
    assert not ran.exists(), "a linked library was loaded"
    assert entry.is_file() and not entry.is_symlink()


@pytest.mark.parametrize("damage", ["truncated", "junk_with_its_checksum"])
def test_a_damaged_cached_build_is_rebuilt_once_without_a_crash(tmp_path, prebuilt, damage):
    cache = _private(tmp_path / "cache")
    good = prebuilt.read_bytes()
    bad = good[:len(good) // 2] if damage == "truncated" else b"\x7fELF not a library"
    recorded = good if damage == "truncated" else bad
    (cache / _entry_name()).write_bytes(bad)
    (cache / _entry_name()).with_name(f"{_band._target()[0]}.sha256").write_text(hashlib.sha256(recorded).hexdigest())
    res = _python(_code(prebuilt), cache)
    assert _outcome(res)[0] == "True"
    assert res.stderr.count("fake compile") == 1
    assert (cache / _entry_name()).read_bytes() == good


@pytest.mark.parametrize("mode", [0o777, 0o770], ids=["world_writable", "group_writable"])
def test_a_cache_folder_others_may_write_to_is_refused_in_one_line(tmp_path, prebuilt, mode):
    cache = _private(tmp_path / "cache")
    # A good build in it first: what a build leaves, the module and its recorded SHA-256 (a new process loads
    # such a pair: test_a_compiled_kernel_is_reused_from_the_cache_with_its_recorded_checksum).
    entry = cache / _entry_name()
    entry.write_bytes(prebuilt.read_bytes())
    entry.with_name(f"{_band._target()[0]}.sha256").write_text(hashlib.sha256(entry.read_bytes()).hexdigest() + "\n")
    cache.chmod(mode)
    res = _python(_code(prebuilt), cache)
    ok, reason = _outcome(res)
    assert ok == "False" and "may be written by group or others" in reason
    assert res.stderr.count("\n") == 1 and "tile schedule" in res.stderr, res.stderr
    assert "fake compile" not in res.stderr


def test_the_cache_folder_is_created_private(tmp_path, prebuilt):
    cache = tmp_path / "home" / "cache"
    assert _outcome(_python(_code(prebuilt), cache))[0] == "True"
    assert cache.stat().st_mode & 0o777 == 0o700


def test_a_failed_build_names_its_cause_in_one_line_and_is_remembered(tmp_path):
    cache = tmp_path / "cache"
    first = _python(_code(None), cache, CXX="/nonexistent")
    ok, reason = _outcome(first)
    assert ok == "False" and "/nonexistent: not found" in reason
    lines = first.stderr.splitlines()
    assert len(lines) == 2 and "compiling" in lines[0] and "about a minute" in lines[0], first.stderr
    assert "/nonexistent: not found" in lines[1] and "tile schedule" in lines[1]
    again = _python(_code(None), cache, CXX="/nonexistent")
    ok, reason = _outcome(again)
    assert ok == "False" and "/nonexistent: not found" in reason and "ATTNKIT_BUILD=1" in reason
    assert "compiling" not in again.stderr and again.stderr.count("\n") == 1, again.stderr
    forced = _python(_code(None), cache, CXX="/nonexistent", ATTNKIT_BUILD="1")
    assert _outcome(forced)[0] == "False" and "compiling" in forced.stderr


def test_two_processes_on_an_empty_cache_compile_once(tmp_path, prebuilt):
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-c", _code(prebuilt, delay=8)]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(cache))
    seen = ""
    while "fake compile" not in seen:  # start the second one while the first is compiling
        line = first.stderr.readline()
        assert line, f"the first process ended without compiling: {seen}"
        seen += line
    second = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(cache))
    outs = [p.communicate(timeout=300) for p in (first, second)]
    stderr = seen + outs[0][1] + outs[1][1]
    assert [p.returncode for p in (first, second)] == [0, 0], stderr
    assert [out.split()[0] for out, _ in outs] == ["True", "True"], stderr
    assert stderr.count("fake compile") == 1, stderr
    assert "waiting for another process's build" in outs[1][1]


def test_without_a_build_it_falls_back_with_one_line_and_the_same_answer(tmp_path):
    code = ("import torch, attnkit\n"
            "from attnkit.backends import _band\n"
            "q = torch.randn(1, 2, 50, 8, dtype=torch.float64)\n"
            "a = attnkit.attention(q, q, q, window=(3, 3))\n"
            "b = attnkit.attention(q, q, q, window=(3, 3), backend='reference')\n"
            "print(_band.available(), float((a - b).abs().max()))\n"
            "print(_band.unavailable_reason())\n")
    res = _python(code, tmp_path, ATTNKIT_BUILD="0")
    assert res.returncode == 0, res.stderr
    ok, err = res.stdout.split()[:2]
    assert ok == "False" and float(err) < 1e-12
    assert "ATTNKIT_BUILD=0 forbids compiling it" in res.stdout
    assert res.stderr.count("\n") == 1 and "the blockwise backend uses its tile schedule instead" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_compiled_kernel_is_reused_from_the_cache_with_its_recorded_checksum(tmp_path):
    # Copy this process's build and its recorded SHA-256 into a fresh cache; a new process must import it.
    assert _band.available()
    built = _band._target()[2]
    sidecar = built.with_name(f"{_band._target()[0]}.sha256")
    assert sidecar.read_text().strip() == hashlib.sha256(built.read_bytes()).hexdigest()
    cache = _private(tmp_path / "cache")
    for path in (built, sidecar):
        (cache / path.name).write_bytes(path.read_bytes())
    res = _python(REPORT, cache, ATTNKIT_BUILD="0")
    assert _outcome(res)[0] == "True", res.stderr
    assert "compiling" not in res.stderr


def test_the_source_compiles_where_torch_has_no_brgemm(tmp_path):
    """Builds on a CPU or torch without oneDNN's brgemm micro-kernel (aarch64, an older torch) take the source's
    other branch, which this machine never compiles: checked here with the macro that selects it undefined
    (syntax and types only, no code made). Names that only the brgemm branch defined once broke them all."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    wrapper = tmp_path / "without_brgemm.cpp"
    wrapper.write_text("#include <ATen/native/CPUBlas.h>\n#undef CPUBLAS_BRGEMM_BF16BF16F32\n"
                       f'#include "{_band.SOURCE}"\n')
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    res = subprocess.run([cxx, "-fsyntax-only", "-std=c++17", "-fopenmp", "-w", "-DTORCH_EXTENSION_NAME=probe",
                          *includes, str(wrapper)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, "\n".join(line for line in res.stderr.splitlines() if "error" in line)
