"""The command that renders and checks the KubeRay manifests (cluster/kuberay/render.py says what
it writes, cluster/kuberay/validate.py what it checks):

    python -m launch.kuberay [--deploy cluster/kuberay/deploy.yaml] [--out DIR] [key=value ...]
    python -m launch.kuberay --check      # the committed files are what it renders, valid

It lives in launch/ because it hands cluster/kuberay the training-config loader
(``launch.config.load_config``) and cluster/ imports nothing from launch/ (CONTRIBUTING.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from cluster.kuberay import render
from cluster.kuberay.options import load_deploy
from cluster.kuberay.validate import problems
from common.errors import ConfigError
from launch.config import load_config


def main(argv: list[str]) -> int:
    """Render (or with --check, compare) and validate; 0 valid, 1 problems found, 2 a bad deployment
    (the ConfigError naming its key, on stderr)."""
    ap = argparse.ArgumentParser(prog="python -m launch.kuberay", description=render.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deploy", type=Path, default=render.HERE / "deploy.yaml")
    ap.add_argument("--out", type=Path, default=render.HERE)
    ap.add_argument("--check", action="store_true",
                    help="compare with the files in --out instead of writing them")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    ns = ap.parse_args(argv)
    try:
        dc = load_deploy(ns.deploy, ns.overrides)
        texts = render.render(dc, load_config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    found = []
    for name, text in texts.items():
        path = ns.out / name
        if not ns.check:
            path.write_text(text)
        elif not path.is_file() or path.read_text() != text:
            found.append(f"{path}: differs from what {ns.deploy} renders (re-render it)")
    found += problems({n: list(yaml.safe_load_all(t)) for n, t in texts.items()}, dc, load_config)
    print("\n".join(found) if found else
          f"{'checked' if ns.check else 'wrote'} {', '.join(texts)} in {ns.out}: valid")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
