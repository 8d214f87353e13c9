"""Secrets stay in the environment, out of the config.

The whole config is written to the run folder (``config.yaml``, every checkpoint's copy) and may go
to wandb, so no config value may hold a secret. Rather than blank values on the way out (which would
make a saved config silently differ from the run's), a config that holds one is refused at load,
naming the key and the environment variable whose value it holds, never the value itself:

- a value that contains the value of a secret-named environment variable (``WANDB_API_KEY``,
  ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ...: a name ending in one of ``SECRET_WORDS``) of at
  least ``MIN_LEN`` characters (shorter ones would match by chance);
- a key named like a secret (``cluster.rollout_resources: {api_token: ...}``): no key of the
  schema is, so such a key can only carry a secret into the config.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping

from common.errors import ConfigError

SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "APIKEY", "ACCESS_KEY",
                "PRIVATE_KEY", "SECRET_KEY")
SECRET_NAME = re.compile(rf"(?:^|_)(?:{'|'.join(SECRET_WORDS)})$", re.IGNORECASE)
MIN_LEN = 8


def secret_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{name: value} of the environment variables whose name says they hold a secret."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= MIN_LEN}


def check_config(tree: Mapping, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError for the first key of ``tree`` (the config as nested dicts) that is named like a
    secret or whose value contains a secret of the environment."""
    secrets = secret_env(environ)
    for key, value in _leaves(tree):
        if SECRET_NAME.search(key.rsplit(".", 1)[-1]):
            raise ConfigError(key, "<not shown>", "no key named like a secret: secrets are read "
                              "from the environment (e.g. WANDB_API_KEY), never the config, "
                              "which is saved in the run folder")
        text = str(value)
        for name, secret in secrets.items():
            if secret in text:
                raise ConfigError(key, f"<the value of ${name}>", "no secret in the config (it is "
                                  f"saved in the run folder): leave it in ${name} only")


def _leaves(tree: Mapping, prefix: str = "") -> Iterator[tuple[str, object]]:
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from _leaves(v, key + ".")
        elif isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                if isinstance(item, Mapping):
                    yield from _leaves(item, f"{key}.{i}.")
                else:
                    yield f"{key}.{i}", item
        else:
            yield key, v
