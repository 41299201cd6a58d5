"""configs.yaml and selection files as the build and the runtime read them: the parsed yaml,
and config entries expanded (list values as a cartesian product) into validated configs."""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Mapping

from .config import ConfigError, KernelConfig


def read_yaml(path, what: str):
    """The parsed yaml file at ``path``; an unreadable or malformed file is a ConfigError
    naming the path and ``what`` it should hold."""
    import yaml  # imported here: the rest of this module is stdlib-only

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid yaml: {e}") from None


def expand_config_entries(entries: Iterable[Mapping[str, Any]],
                          defaults: Mapping[str, Any] | None = None,
                          where: str = "configs", cls=KernelConfig) -> list:
    """Expand yaml config entries into validated configs.

    Each entry is merged over ``defaults``; any field given as a list expands into the
    cartesian product of its values (``dtype: [fp16, bf16]`` gives two configs).
    Duplicates are an error: two entries must not describe the same kernel.
    """
    configs: list[KernelConfig] = []
    seen: dict[KernelConfig, str] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}[{i}] must be a mapping of config fields, got {entry!r}")
        merged = {**(defaults or {}), **entry}
        keys = list(merged)
        choices = [v if isinstance(v, list) else [v] for v in merged.values()]
        for combo in itertools.product(*choices):
            label = f"{where}[{i}]"
            cfg = cls.from_dict(dict(zip(keys, combo)), where=label)
            if cfg in seen:
                raise ConfigError(f"{label}: {cfg.name} is already listed by {seen[cfg]}")
            seen[cfg] = label
            configs.append(cfg)
    return configs
