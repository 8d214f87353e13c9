"""YAML files and ``key=value`` overrides merged into a structured OmegaConf schema, with
OmegaConf's errors turned into ``ConfigError`` naming the dotted key and what it allows. Shared by
the training config (``launch/config.py``) and the KubeRay deployment options
(``cluster/kuberay/options.py``)."""
from __future__ import annotations

from enum import Enum

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from common.errors import ConfigError


def allowed_keys(schema, dotted: str) -> str:
    """The keys allowed next to an unknown ``dotted`` key, for the error message."""
    node = schema
    for part in dotted.split(".")[:-1]:
        if not OmegaConf.is_dict(node) or part not in node:
            break
        node = node[part]
    keys = list(node.keys()) if OmegaConf.is_dict(node) else []
    return "one of " + ", ".join(keys) if keys else "a known key"


def as_config_error(err: OmegaConfBaseException, schema, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    value = getattr(err, "value", None)
    if isinstance(err, ConfigKeyError):
        return ConfigError(key, f"unknown key (from {source})", allowed_keys(schema, key))
    current = OmegaConf.select(schema, key, default=None) if key != "?" else None
    if isinstance(current, Enum):  # list the values YAML takes (OmegaConf lists member names)
        choices = ", ".join(repr(m.value) for m in type(current))
        return ConfigError(key, value, f"one of {choices} (from {source})")
    # OmegaConf's own message says what the type allows; keep its first line.
    msg = str(err).splitlines()[0]
    return ConfigError(key, value, f"{msg} (from {source})")


def merge(schema, other, source: str, item: str | None = None):
    try:
        return OmegaConf.merge(schema, other)
    except OmegaConfBaseException as err:
        raise as_config_error(err, schema, source) from None
    except (TypeError, ValueError) as err:  # e.g. a mapping merged into a list: task.eval_sets.0.x
        key, _, value = (item or "?=").partition("=")
        raise ConfigError(key, value or None, f"a value of the key's type ({err}; from {source})") \
            from None


def parse_override(item: str):
    """One ``key=value`` as OmegaConf reads it (the value as YAML); a value YAML or OmegaConf
    cannot read (control characters, an unclosed bracket) names its key."""
    import yaml

    key, _, value = item.partition("=")
    try:
        return OmegaConf.from_dotlist([item])
    except IndexError:  # omegaconf 2.4's key-path parser reads past the end of a lone "[" key
        raise ConfigError(key, value, "a dotted key such as run.steps (command line: OmegaConf "
                                      "cannot parse this key)") from None
    except (yaml.YAMLError, OmegaConfBaseException, ValueError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(key, value, f"a YAML value (command line: {msg})") from None
