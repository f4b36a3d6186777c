"""The kernel built at install and its fallback, the compiled-kernel cache (``attnkit/backends/_build.py``),
against a hostile or broken cache folder or installed module.

Each case runs a fresh Python process (a crash there is a failed test, not a dead test run) on its
own cache folder. Unless the installed module is the point, that process sees none (``NOT_INSTALLED``), so it
takes the fallback. Where the compiler is not the point, ``cpp_extension.load`` is replaced in that
process by a fake that sleeps, says "fake compile" on stderr and copies the kernel this test
session loaded (installed, or compiled in the ``prebuilt`` fixture), so the real compiler runs at most once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from attnkit.backends import _band, _band_sources, _build

pytestmark = pytest.mark.slow

NOT_INSTALLED = """
from pathlib import Path
from attnkit.backends import _band
_band.INSTALLED = Path({missing!r})
"""
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


def _installed() -> str | None:
    """Why the module built at install is not used here (None: it is, as a fresh process would load it)."""
    try:
        _build.check_installed(_band.INSTALLED, _band.INSTALLED_RECORD, _band.build_key())
    except _build.BuildError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    """A copy of this session's kernel: the module built at install, else the cache's (built here if need be)."""
    if not _band.available():
        pytest.skip(f"no compiled kernel to copy: {_band.unavailable_reason()}")
    path = tmp_path_factory.mktemp("prebuilt") / "kernel.so"
    path.write_bytes(_band.INSTALLED.read_bytes() if _installed() is None else _band._target()[2].read_bytes())
    return path


def _entry_name() -> str:
    return _band._target()[2].name


def _private(folder: Path) -> Path:
    folder.mkdir(mode=0o700, parents=True)
    return folder


def _code(prebuilt: Path | None, delay: float = 0.0, before: str = "", report: str = REPORT) -> str:
    fake = FAKE_COMPILE.format(delay=delay, prebuilt=str(prebuilt)) if prebuilt is not None else ""
    return NOT_INSTALLED.format(missing="/nonexistent/_band_kernel.so") + fake + textwrap.dedent(before) + report


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
    assert len(lines) == 2 and "BuildWarning" in lines[0] and "compiling" in lines[0], first.stderr
    assert "built at install is not used" in lines[0] and "--no-build-isolation" in lines[0]
    assert "RuntimeWarning" in lines[1] and "/nonexistent: not found" in lines[1] and "tile schedule" in lines[1]
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
    res = _python(_code(None, report=code), tmp_path, ATTNKIT_BUILD="0")
    assert res.returncode == 0, res.stderr
    ok, err = res.stdout.split()[:2]
    assert ok == "False" and float(err) < 1e-12
    assert "ATTNKIT_BUILD=0 forbids compiling it" in res.stdout
    assert res.stderr.count("\n") == 1 and "the blockwise backend uses its tile schedule instead" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_compiled_kernel_is_reused_from_the_cache_with_its_recorded_checksum(tmp_path, prebuilt):
    # This session's build and its SHA-256 in a fresh cache, as a build leaves them: a new process imports it,
    # quietly (no installed module: it is the fallback's cache).
    cache = _private(tmp_path / "cache")
    entry = cache / _entry_name()
    entry.write_bytes(prebuilt.read_bytes())
    entry.with_name(f"{_band._target()[0]}.sha256").write_text(hashlib.sha256(entry.read_bytes()).hexdigest() + "\n")
    res = _python(_code(None), cache, ATTNKIT_BUILD="0")
    assert _outcome(res)[0] == "True", res.stderr
    assert res.stderr == ""


def test_the_source_compiles_where_torch_has_no_brgemm(tmp_path):
    """Builds on a CPU or torch without oneDNN's brgemm micro-kernel (aarch64, an older torch) take the source's
    other branch, which this machine never compiles: checked here with the macro that selects it undefined
    (syntax and types only, no code made). Names that only the brgemm branch defined once broke them all."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    wrapper = tmp_path / "without_brgemm.cpp"  # every translation unit in one: the headers are parsed once
    wrapper.write_text("#include <ATen/native/CPUBlas.h>\n#undef CPUBLAS_BRGEMM_BF16BF16F32\n"
                       + "".join(f'#include "{source}"\n' for source in _band_sources.sources()))
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    res = subprocess.run([cxx, "-fsyntax-only", "-std=c++17", "-fopenmp", "-w", "-DTORCH_EXTENSION_NAME=probe",
                          *includes, str(wrapper)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, "\n".join(line for line in res.stderr.splitlines() if "error" in line)


def test_the_fallback_says_once_that_it_compiles_and_why(tmp_path, prebuilt):
    """No module built at install: the first call compiles (here a fake compile) and says so by one BuildWarning,
    pointed at the user's line, with the reason and the way to build at install; its time goes to logging."""
    calls = """
        import json, warnings
        import torch, attnkit
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            q = torch.randn(1, 2, 64, 16)
            for _ in range(2):
                attnkit.attention(q, q, q, window=(8, 0))
                attnkit.attention(q, q, q, is_causal=True)
                attnkit.attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), window=(8, 8))
        print(json.dumps([[w.category.__name__, str(w.message), w.filename] for w in seen]))
        """
    res = _python(_code(prebuilt, before=calls, report=""), tmp_path / "cache")
    assert res.returncode == 0, res.stderr[-2000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert [w[0] for w in seen] == ["BuildWarning"], seen
    _, message, filename = seen[0]
    assert filename == "<string>", seen  # the user's call, not attnkit's code
    assert "built at install is not used: no _band_kernel" in message and "--no-build-isolation" in message
    assert "compiling the banded attention kernel" in message
    assert res.stderr.count("fake compile") == 1
    assert "compiled the banded attention kernel in" in res.stderr  # logging's last resort prints a warning


@pytest.mark.parametrize("install", ["another_build", "planted", "symlink"])
def test_an_installed_module_that_is_not_this_build_is_never_loaded(tmp_path, prebuilt, install):
    """The installed module is loaded only with a build record naming this process's build key and its bytes'
    SHA-256, read without following a link; anything else takes the fallback (here a fake compile), loading
    nothing of it."""
    lib, ran = _constructor_library(tmp_path)
    folder = tmp_path / "site"
    folder.mkdir()
    module, record = folder / _band.INSTALLED.name, folder / _band_sources.RECORD
    good = prebuilt.read_bytes()
    key = _band.build_key()
    if install == "another_build":  # e.g. built at install against another torch
        module.write_bytes(good)
        record.write_bytes(_band_sources.record("0" * 16, hashlib.sha256(good).hexdigest()))
        why = "was built for other sources, another torch or another CPU"
    elif install == "planted":  # a library under the name, beside the record of a good build
        shutil.copyfile(lib, module)
        record.write_bytes(_band_sources.record(key, hashlib.sha256(good).hexdigest()))
        why = "does not match its recorded SHA-256"
    else:  # a link to a library elsewhere, with a record that matches it
        module.symlink_to(lib)
        record.write_bytes(_band_sources.record(key, hashlib.sha256(lib.read_bytes()).hexdigest()))
        why = "unreadable"
    before = f"""
        from pathlib import Path
        from attnkit.backends import _band
        _band.INSTALLED, _band.INSTALLED_RECORD = Path({str(module)!r}), Path({str(record)!r})
        """
    res = _python(_code(prebuilt, before=before), tmp_path / "cache")
    assert _outcome(res)[0] == "True"
    assert not ran.exists(), "the planted library's constructor ran"
    assert res.stderr.count("fake compile") == 1 and why in res.stderr, res.stderr


#: The first window call of a fresh process with the kernel installed, at most (a load and the self-check).
FIRST_CALL_S = 2.0
QUIET_CALLS = """
import json, sys, time
import torch
import attnkit
q = torch.randn(1, 4, 1024, 64)
start = time.perf_counter()
attnkit.attention(q, q, q, window=(128, 0))
first = time.perf_counter() - start
attnkit.attention(q, q, q, is_causal=True)
attnkit.attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), window=(64, 64))
with open(sys.argv[1], "w") as f:
    json.dump({"first": first}, f)
"""


def test_with_the_kernel_installed_a_fresh_process_says_nothing_and_its_first_call_is_quick(tmp_path):
    """`python -W error` (any warning an error): import, a window, a causal and a bfloat16 call print nothing, load
    the installed module (no cache, no compiler) and the first window call takes under FIRST_CALL_S (the better of
    two fresh processes: on a shared 2-core machine one may wait for a core)."""
    why = _installed()
    if why is not None:
        pytest.skip(f"attnkit was not installed with its compiled kernel here: {why}")
    firsts = []
    for run in range(2):
        times = tmp_path / f"times{run}.json"
        res = subprocess.run([sys.executable, "-W", "error", "-c", QUIET_CALLS, str(times)], capture_output=True,
                             text=True, timeout=300, env=_env(tmp_path / "cache", ATTNKIT_BUILD="0"))
        assert res.returncode == 0, res.stderr[-2000:]
        assert (res.stdout, res.stderr) == ("", "")
        assert not (tmp_path / "cache").exists()  # the installed module, not the fallback's cache
        firsts.append(json.loads(times.read_text())["first"])
        if firsts[-1] < FIRST_CALL_S:
            break
    assert min(firsts) < FIRST_CALL_S, firsts
