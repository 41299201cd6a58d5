"""Selection rules: which kernel config serves a call.

A rule is a mapping of optional conditions plus a ``config`` name template::

    {d_head: 128, arch: [86, 89], config: "fwd_{dtype}_d128_br128_bc32_..."}

Conditions: ``arch`` (list of compute capabilities, 80/86/89/90...), ``dtype`` ("fp16" or
"bf16"), ``d_head``, ``causal`` (bool), ``dropout`` (bool: whether the call drops scores,
dropout_p > 0), ``max_seqlen_q`` and ``max_seqlen_k`` (the call's length must be <= the
bound). ``config`` is a canonical config name (``KernelConfig.name``);
"{dtype}" in it is replaced by the call's dtype. The first rule whose conditions hold and
whose config is available on the GPU wins.

The same rules come from ``configs.yaml`` (validated by the build, stored in the manifest)
or from a user file named by ``CUDAFLASH_CONFIG``. This module is stdlib-only (PyYAML is
imported only to read a user file) because build_cubins.py loads it in pip's isolated build
environment, where neither torch nor cudaflash is installed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from .config import DTYPES, ConfigError, KernelConfig
from .config_file import read_yaml

CONDITION_KEYS = ("arch", "dtype", "d_head", "causal", "dropout", "max_seqlen_q",
                  "max_seqlen_k")
RULE_KEYS = CONDITION_KEYS + ("config",)
DTYPE_PLACEHOLDER = "{dtype}"
MIN_ARCH = 80  # the kernels use sm_80 features (cp.async, ldmatrix, bf16 mma)


@dataclass(frozen=True)
class Rule:
    """One validated selection rule; ``None`` means "no condition on this key"."""

    index: int
    where: str
    config: str  # canonical name, possibly with "{dtype}"
    arch: Optional[Tuple[int, ...]] = None
    dtype: Optional[str] = None
    d_head: Optional[int] = None
    causal: Optional[bool] = None
    dropout: Optional[bool] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None

    def config_name(self, dtype: str) -> str:
        return self.config.replace(DTYPE_PLACEHOLDER, dtype)

    def dtypes(self) -> Tuple[str, ...]:
        """The dtypes this rule can serve: its dtype condition, or every dtype the template
        can expand to (a literal name serves only its own dtype)."""
        if self.dtype is not None:
            return (self.dtype,)
        if DTYPE_PLACEHOLDER in self.config:
            return DTYPES
        return (_name_key(self.config)[0],)

    def matches(self, *, arch: int, dtype: str, d_head: int, causal: bool, seqlen_q: int,
                seqlen_k: int, dropout: bool = False) -> bool:
        if dtype not in self.dtypes():
            return False
        # The config's own d_head must match too, so that a rule without a d_head condition
        # can never hand a d64 kernel to a d128 call.
        return (_name_key(self.config_name(dtype))[1] == d_head
                and (self.arch is None or arch in self.arch)
                and (self.d_head is None or d_head == self.d_head)
                and (self.causal is None or causal == self.causal)
                and (self.dropout is None or dropout == self.dropout)
                and (self.max_seqlen_q is None or seqlen_q <= self.max_seqlen_q)
                and (self.max_seqlen_k is None or seqlen_k <= self.max_seqlen_k))

    def to_dict(self) -> dict:
        """The rule as yaml/json data (only the keys that were given); parse_rules reads it back."""
        out: dict = {}
        for key in CONDITION_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if key == "arch" else value
        out["config"] = self.config
        return out


@functools.lru_cache(maxsize=None)
def _name_key(name: str) -> Tuple[str, int]:
    """(dtype, d_head) of a canonical config name; raises ConfigError for a bad name."""
    cfg = KernelConfig.from_name(name)
    return cfg.dtype, cfg.d_head


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _parse_rule(raw: Any, index: int, where: str) -> Rule:
    label = f"{where}: rule {index}"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{label} must be a mapping of conditions and 'config', got {raw!r}")
    unknown = sorted(set(raw) - set(RULE_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{label}: unknown key(s) {unknown}; allowed: {list(RULE_KEYS)}")
    if "config" not in raw:
        raise ConfigError(f"{label}: missing key 'config' (the canonical config name to use)")

    def bad(key: str, allowed: str) -> ConfigError:
        return ConfigError(f"{label}: {key}={raw[key]!r} is invalid; allowed: {allowed}")

    values: dict = {}
    if "arch" in raw:
        arch = raw["arch"]
        if (not isinstance(arch, list) or not arch
                or not all(_positive_int(a) and a >= MIN_ARCH for a in arch)):
            raise bad("arch", f"a non-empty list of compute capabilities >= {MIN_ARCH} "
                              "written as integers, e.g. [86, 89]")
        values["arch"] = tuple(arch)
    if "dtype" in raw:
        if raw["dtype"] not in DTYPES:
            raise bad("dtype", f"one of {list(DTYPES)}")
        values["dtype"] = raw["dtype"]
    if "d_head" in raw:
        if not _positive_int(raw["d_head"]):
            raise bad("d_head", "a positive integer")
        values["d_head"] = raw["d_head"]
    for key in ("causal", "dropout"):
        if key in raw:
            if not isinstance(raw[key], bool):
                raise bad(key, "true or false")
            values[key] = raw[key]
    for key in ("max_seqlen_q", "max_seqlen_k"):
        if key in raw:
            if not _positive_int(raw[key]):
                raise bad(key, "a positive integer (the rule holds for lengths <= it)")
            values[key] = raw[key]

    template = raw["config"]
    if not isinstance(template, str):
        raise bad("config", 'a canonical config name (string), "{dtype}" allowed')
    rule = Rule(index=index, where=where, config=template, **values)
    try:
        keys = {dtype: _name_key(rule.config_name(dtype)) for dtype in rule.dtypes()}
    except ConfigError as e:
        raise ConfigError(f"{label}: config={template!r}: {e}") from None
    for dtype, (cfg_dtype, cfg_d_head) in keys.items():
        if cfg_dtype != dtype:
            raise ConfigError(f"{label}: config={template!r} is a {cfg_dtype} kernel but the "
                              f"rule has dtype={dtype!r}")
        if rule.d_head is not None and cfg_d_head != rule.d_head:
            raise ConfigError(f"{label}: config={template!r} has d_head={cfg_d_head} but the "
                              f"rule has d_head={rule.d_head}")
    return rule


def parse_rules(raw: list, where: str) -> tuple[Rule, ...]:
    """Validate a list of rule mappings; ``where`` (a file or "manifest") prefixes errors."""
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: selection must be a list of rules, got {raw!r}")
    return tuple(_parse_rule(r, i, where) for i, r in enumerate(raw))


def select(rules, available: Mapping[str, Any], *, arch: int, dtype: str, d_head: int,
           causal: bool, seqlen_q: int, seqlen_k: int,
           dropout: bool = False) -> tuple[str, str]:
    """Pick a config name for a call (``dropout``: whether it drops scores); returns
    (name, reason).

    ``available`` holds the config names usable on this GPU (a dict keyed by name or any
    ordered collection of names). The first matching rule whose config is available wins;
    otherwise the first available config with the call's dtype and d_head.
    """
    for rule in rules:
        if rule.matches(arch=arch, dtype=dtype, d_head=d_head, causal=causal,
                        seqlen_q=seqlen_q, seqlen_k=seqlen_k, dropout=dropout):
            name = rule.config_name(dtype)
            if name in available:
                return name, f"rule {rule.index} of {rule.where}"
    for name in available:
        if _name_key(name) == (dtype, d_head):
            return name, "fallback: no selection rule matched"
    combos = sorted({_name_key(n) for n in available})
    have = ", ".join(f"{dt} d_head={d}" for dt, d in combos) or "none"
    raise LookupError(f"no cudaflash kernel for dtype={dtype} d_head={d_head} on sm_{arch}; "
                      f"available (dtype, d_head): {have}")


def load_user_rules(path) -> tuple[Rule, ...]:
    """Read a user's rule file: yaml with a top-level ``selection:`` list."""
    data = read_yaml(path, "selection file")
    if not isinstance(data, Mapping) or "selection" not in data:
        raise ConfigError(f"{path}: expected a mapping with a top-level 'selection:' list of "
                          f"rules, got {type(data).__name__}"
                          + (f" with keys {sorted(data, key=str)}" if isinstance(data, Mapping)
                             else ""))
    extra = sorted(set(data) - {"selection"}, key=str)
    if extra:
        raise ConfigError(f"{path}: unknown top-level key(s) {extra}; allowed: ['selection']")
    return parse_rules(data["selection"], where=str(path))
