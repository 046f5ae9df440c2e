"""Reading the feed's config from YAML: a mapping of fields, refused when a key is given twice
(YAML alone would keep the last one silently); relative paths resolve against the file's
folder. ``parse_override`` reads one ``KEY=VALUE`` of the command line's ``--set``, the value
as YAML."""

from __future__ import annotations

import os
from typing import Any

from ingest.errors import ConfigError

__all__ = ["parse_override", "read_yaml_fields", "resolve_path", "resolve_tokenizer"]


def read_yaml_fields(path: str) -> dict[str, Any]:
    """The mapping of fields a YAML config file holds (empty for an empty file).

    Raises:
      ConfigError: invalid YAML, a key given twice in one mapping (naming both lines), or a
        file that is not a mapping of fields.
    """
    import yaml

    with open(path, encoding="utf-8") as f:
        loader = _strict_loader(yaml)(f)
        try:
            raw = loader.get_single_data()
        except yaml.YAMLError as e:
            raise ConfigError([f"{path} is not valid YAML: {e}"], where=path) from e
        finally:
            loader.dispose()
    if loader.duplicates:
        raise ConfigError([f"key {key!r} is given twice, at line {first} and line {second} (YAML "
                           f"would keep only the last); remove one"
                           for key, first, second in loader.duplicates], where=path)
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError([f"{path} must be a mapping of fields (seq_len: 1024, sources: [...], "
                           f"...), but it holds {_described(raw)}"], where=path)
    return dict(raw or {})


def parse_override(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--set`` as ``(KEY, VALUE read as YAML)``: ``seq_len=512`` gives
    ``("seq_len", 512)``, ``num_epochs=null`` None, ``sources=[{paths: [d]}]`` a list. The
    value is read as it would be in the config file (a mapping's key given twice is refused
    alike); relative paths in ``sources`` and ``tokenizer`` resolve against the current
    directory, where the command line was typed. Whether KEY is a field and VALUE fits it is
    checked with the rest of the config.

    Raises:
      ValueError: no ``=``, an empty KEY, or a VALUE that is not valid YAML, naming the item.
    """
    import yaml

    key, eq, text = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ValueError(f"--set {item!r} must be KEY=VALUE, e.g. --set seq_len=512")
    loader = _strict_loader(yaml)(text)
    try:
        value = loader.get_single_data()
    except yaml.YAMLError as e:
        detail = " ".join(str(e).split())
        raise ValueError(f"--set {item}: the value is not valid YAML ({detail}); quote it "
                         f"for the shell, e.g. --set '{key}=[a, b]'") from e
    finally:
        loader.dispose()
    if loader.duplicates:
        raise ValueError(f"--set {item}: key {loader.duplicates[0][0]!r} is given twice in the "
                         f"value; remove one")
    base = os.getcwd()
    if key == "tokenizer" and isinstance(value, str):
        value = resolve_tokenizer(value, base)
    elif key == "sources" and isinstance(value, list):
        value = [_absolute_paths(s, base) for s in value]
    return key, value


def _absolute_paths(source: Any, base: str) -> Any:
    """A source mapping of ``--set sources=...`` with its relative ``paths`` made absolute."""
    if not isinstance(source, dict):
        return source
    paths = source.get("paths")
    if isinstance(paths, str):
        paths = [paths]
    if isinstance(paths, list):
        source = {**source, "paths": [resolve_path(p, base) for p in paths]}
    return source


def resolve_path(path: str, base_dir: str | None) -> str:
    """A relative local ``path`` of a YAML file resolved against its folder ``base_dir``;
    URIs, absolute paths and non-strings stay as given."""
    if not isinstance(path, str) or base_dir is None or "://" in path or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base_dir, path))


def resolve_tokenizer(name: str, base_dir: str | None) -> str:
    """A ``tokenizer`` that names a file or folder resolved like ``resolve_path``; a
    built-in name (``gpt2``) stays as given."""
    if os.sep in name or name.endswith((".json", ".tiktoken")) or (
            base_dir is not None and os.path.isdir(os.path.join(base_dir, name))):
        return resolve_path(name, base_dir)
    return name


def _described(value: Any) -> str:
    """What a YAML document holds, for an error: ``a list of 3 items``, ``the string 'x'``."""
    if isinstance(value, list):
        return f"a list of {len(value)} item(s)" + (f", the first {value[0]!r:.60}" if value
                                                    else "")
    return f"the {type(value).__name__} {value!r:.60}"


def _strict_loader(yaml: Any) -> type:
    """A SafeLoader whose mappings record every key given twice as ``duplicates``:
    ``(key, first line, second line)``, 1-based."""

    class StrictLoader(yaml.SafeLoader):
        def __init__(self, stream: Any):
            super().__init__(stream)
            self.duplicates: list[tuple[Any, int, int]] = []

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # ``<<: *base`` then a key of base overrides it; that is no repeat
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        self.duplicates.append((key, seen[key], line))
                    else:
                        seen[key] = line
                except TypeError:
                    continue  # an unhashable key: SafeLoader's own error names it
            return super().construct_mapping(node, deep=deep)

    return StrictLoader
