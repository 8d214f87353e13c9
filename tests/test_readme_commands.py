"""Every command the README shows exists: a `make <target>` is a Makefile target, a script or module
that `python` runs is a file of this repository, a `--config` preset exists, and every dotted config
key (`key.sub=value` overrides, bare keys in code spans) is a key of the config schema
(`launch.config.TrainConfig`). The docs the README's measurements and details moved to
(docs/RESULTS.md, OPERATIONS.md, SCHEDULE.md, DISTILL.md) get the same check on their script paths,
presets and keys, and every relative link in them and in the README points at an existing file and
heading. Placeholders (`DIR`, `RUN_DIR`, `<run>`, `$PWD`, `...`) are skipped."""
from __future__ import annotations

import dataclasses
import fnmatch
import re
import typing
from functools import lru_cache
from pathlib import Path

import pytest

from launch.config import TrainConfig

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = [REPO / "docs" / n for n in ("RESULTS.md", "OPERATIONS.md", "SCHEDULE.md", "DISTILL.md")]
SECTIONS = {f.name for f in dataclasses.fields(TrainConfig)}


# ---------------------------------------------------------------------------------------- parsing

def code_texts(md: str) -> list[str]:
    """Each logical line of the fenced code blocks (backslash continuations joined, `#` comments
    dropped) and each inline code span outside them."""
    out = []
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", md, flags=re.S | re.M)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                out.append(line)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", md, flags=re.S | re.M)
    # a span may wrap over a line break; it never crosses a blank line
    out += [s.replace("\n", " ").strip() for s in re.findall(r"`([^`]+?)`", prose)]
    return out


def is_placeholder(tok: str) -> bool:
    return bool(re.search(r"[<>$*]|\.\.\.|\bDIR\b|RUN_DIR|\bN{1,6}\b|\{", tok))


def tokens(text: str) -> list[str]:
    """Words, quotes split off (`make train ARGS="run.steps=5 ..."` gives `run.steps=5`)."""
    return [t.strip("(),;") for t in re.split(r"[\s'\"]+", text) if t.strip("(),;")]


def make_targets_in(text: str) -> list[str]:
    return re.findall(r"(?:^|[\s(])make\s+([a-z][\w-]*)", text)


def py_paths_in(text: str) -> list[str]:
    """Repo-relative .py paths (with a folder) and `python -m` modules, as paths."""
    out = [t for t in tokens(text) if re.fullmatch(r"[\w.-]+(/[\w.-]+)+\.py", t)]
    for mod in re.findall(r"python\s+-m\s+([\w.]+)", text):
        if mod.split(".")[0] in {p.name for p in REPO.iterdir() if p.is_dir()}:
            out.append("-m " + mod)
    return [p for p in out if not is_placeholder(p)]


# YAML files the docs name that are not in the repository
NOT_OURS = {"config.yaml": "a run folder's config", "mis.yaml": "slime's (the paper's code)"}


def yaml_paths_in(text: str) -> list[str]:
    return [t for t in tokens(text) if t.endswith(".yaml") and not is_placeholder(t)
            and t not in NOT_OURS]


def keys_in(text: str) -> list[str]:
    """Dotted config keys: `a.b=value` overrides anywhere in the text, and a span that is a bare
    dotted key (or a wildcard over keys like `correction.staleness.*`)."""
    out = []
    for tok in tokens(text):
        key = tok.split("=", 1)[0]
        if key.split(".")[0] in SECTIONS and "." in key and re.fullmatch(r"[\w.*]+", key) \
                and not re.search(r"\.(py|ya?ml|md|jsonl?|txt|lock)$", key):  # a file, not a key
            if "=" in tok or tok == text.strip():
                out.append(key)
    return out


# ----------------------------------------------------------------------------------- the schema

def _leaves(cls=TrainConfig, prefix: str = "") -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        t, key = hints[f.name], f"{prefix}{f.name}"
        args = typing.get_args(t)
        if dataclasses.is_dataclass(t):
            out.update(_leaves(t, key + "."))
        elif typing.get_origin(t) is list and args and dataclasses.is_dataclass(args[0]):
            out.update(_leaves(args[0], key + ".*."))
            out[key] = list
        else:
            out[key] = typing.get_origin(t) or t
    return out


@lru_cache(maxsize=None)
def schema_keys() -> tuple[dict[str, object], set[str]]:
    leaves = _leaves()
    sections = {k.rsplit(".", i)[0] for k in leaves for i in range(1, k.count(".") + 1)}
    return leaves, sections


def key_exists(key: str) -> bool:
    leaves, sections = schema_keys()
    if "*" in key:  # a wildcard names keys: it must match at least one
        return any(fnmatch.fnmatchcase(k, key) for k in [*leaves, *sections])
    generic = re.sub(r"\.\d+(?=\.|$)", ".*", key)  # task.eval_sets.0.name -> task.eval_sets.*.name
    if generic in leaves or generic in sections:
        return True
    # an entry of a mapping- or list-valued key (cluster.learner_resources.gpu_node=1)
    return any(generic.startswith(k + ".") and t in (dict, list) for k, t in leaves.items())


@lru_cache(maxsize=None)
def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, flags=re.M))


# ------------------------------------------------------------------------------------- checking

def _exists(path: str) -> bool:
    if path.startswith("-m "):
        mod = path[3:].replace(".", "/")
        return (REPO / f"{mod}.py").is_file() or (REPO / mod / "__init__.py").is_file()
    return (REPO / path).is_file()


def _yaml_exists(name: str) -> bool:
    if "/" in name:
        return (REPO / name).is_file()
    return any(p for p in REPO.rglob(name) if ".venv" not in p.parts and ".git" not in p.parts)


def problems(md_path: Path, *, make: bool = True) -> list[str]:
    md = md_path.read_text()
    out = []
    for text in code_texts(md):
        if make:
            out += [f"make {t}: no such Makefile target" for t in make_targets_in(text)
                    if t not in makefile_targets()]
        out += [f"{p}: no such file" for p in py_paths_in(text) if not _exists(p)]
        out += [f"{y}: no such preset/file" for y in yaml_paths_in(text) if not _yaml_exists(y)]
        out += [f"{k}: not a config key" for k in keys_in(text) if not key_exists(k)]
    return sorted(set(out))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def link_problems(md_path: Path) -> list[str]:
    md = md_path.read_text()
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", md, flags=re.S | re.M)
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (md_path.parent / path).resolve() if path else md_path
        if not dest.exists():
            out.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md":
            heads = re.findall(r"^#{1,6} (.+)$", re.sub(r"^```[^\n]*\n.*?^```", "", dest.read_text(),
                                                        flags=re.S | re.M), flags=re.M)
            if anchor not in {slug(h) for h in heads}:
                out.append(f"{target}: no heading with that anchor")
    return out


def layout_problems() -> list[str]:
    """Each `name.py` (or `name/`) the README's layout table names in a folder's row is in that
    folder (or below it)."""
    out = []
    for row in re.findall(r"^\| `([\w/]+)/` \|(.*)\|$", README.read_text(), flags=re.M):
        folder, what = REPO / row[0], row[1]
        for name in re.findall(r"`([\w.-]+\.py)`", what):
            if "/" not in name and not any(folder.rglob(name)):
                out.append(f"{row[0]}/: no {name}")
    return out


# ---------------------------------------------------------------------------------------- tests

def test_the_parser_finds_the_readme_commands():
    texts = code_texts(README.read_text())
    joined = "\n".join(texts)
    assert {"train", "test"} <= {t for x in texts for t in make_targets_in(x)}
    assert "launch/train.py" in {p for x in texts for p in py_paths_in(x)}
    assert "launch/configs/qwen2.5-1.5b-math.yaml" in {y for x in texts for y in yaml_paths_in(x)}
    assert "rollout.kv.policy" in {k for x in texts for k in keys_in(x)}
    assert "run.steps=5" in joined
    assert "run.steps" in keys_in('make train ARGS="run.steps=5 rollout.kv.policy=dense"')


def test_the_checks_catch_what_does_not_exist(tmp_path):
    md = tmp_path / "X.md"
    md.write_text("`make no-such-target` and\n```bash\npython bench/no_such.py rollout.kv.nope=1 \\\n"
                  "    --config launch/configs/nope.yaml  # a comment: make nothing\n```\n"
                  "[a](README.md#nowhere) `python -m launch.nope` `run.stepz`\n")
    found = problems(md)
    assert "make no-such-target: no such Makefile target" in found
    assert "bench/no_such.py: no such file" in found
    assert "rollout.kv.nope: not a config key" in found
    assert "launch/configs/nope.yaml: no such preset/file" in found
    assert "-m launch.nope: no such file" in found
    assert "run.stepz: not a config key" in found
    assert not any("nothing" in p for p in found)
    assert link_problems(md) == ["README.md#nowhere: no such file"]  # relative to tmp_path
    assert key_exists("task.eval_sets.0.name") and key_exists("cluster.learner_resources.node")
    assert key_exists("correction.staleness.*") and key_exists("cluster.*_gpus")
    assert not key_exists("run.steps.x")


def test_readme_commands_exist():
    assert problems(README) == []


def test_layout_names_existing_modules():
    assert layout_problems() == []


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 300


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_commands_exist(doc):
    assert problems(doc) == []


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_links_resolve(doc):
    assert link_problems(doc) == []


def test_results_tables_say_where_they_come_from():
    """Every table in docs/RESULTS.md sits under a heading whose block names its command, date,
    machine and commit."""
    md = (REPO / "docs" / "RESULTS.md").read_text()
    for section in re.split(r"^#{2,3} ", md, flags=re.M)[1:]:
        if re.search(r"^\|---", section, flags=re.M):
            head = section[:1500]
            for word in ("Command:", "Date: 20", "machine:", "commit: `"):
                assert word in head, f"{section.splitlines()[0]}: no {word!r}"
