"""The README's examples run as written, and the documentation's links all resolve.

The README's ```python blocks each run on their own, as a reader would paste one, in a fresh
Python process (8 CPU devices), against a small real corpus described by a ``corpus.yaml`` in
the working directory. The checkpoint example saves at its last step too; it runs again as after
a crash (its last checkpoint removed): that run resumes from the latest checkpoint and must end
with the same result as an unbroken run; and once more, finished: it resumes at the end.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest
import yaml

from ingest import load_config
from tests.helpers import write_parquet_corpus

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# Every Markdown file of the documentation whose links must resolve.
PAGES = [README, *sorted(DOCS.glob("*.md")), ROOT / "benchmarks" / "RESULTS.md",
         ROOT / "cluster" / "README.md"]

# The examples' config: small rows, so that an epoch of the corpus below is a few hundred steps
# (the checkpoint example saves every 100 steps).
CORPUS_YAML = """\
sources:
  - paths: [data/train/]
tokenizer: gpt2
seq_len: 64
global_batch_size: 8
num_streams: 4
unit_rows: 32
num_epochs: 1
"""


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


# Runs the blocks given on stdin in one namespace; prints what the test checks as JSON.
RUNNER = """
import json, sys
namespace = {"__name__": "readme_example"}
for i, block in enumerate(json.load(sys.stdin)):
    exec(compile(block, f"README.md python block {i}", "exec"), namespace)
feed, state = namespace["feed"], namespace.get("state")
print(json.dumps({"tokens_seen": int(namespace["params"]["tokens_seen"]),
                  "steps": feed.stats()["steps"], "feed_step": feed.get_state()["step"],
                  "restored_step": state["step"] if state else None}))
"""


# XLA's CPU runtime can deadlock jitted steps whose collective spans several forced CPU devices
# when many of them are in flight, with no feed involved (docs/batches.md): the all-reduce's
# rendezvous waits for a device that never arrives, and XLA aborts the process after 40 s.
XLA_CPU_STUCK = "of them arrived on time"


def _run(blocks: list[str]) -> dict:
    """The blocks run as a reader's script: a new process (8 CPU devices), this directory.

    A run that XLA:CPU's deadlock aborted runs once more, from the checkpoints it began with.
    """
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        before = pathlib.Path(tmp) / "ckpt"
        if pathlib.Path("ckpt").exists():
            shutil.copytree("ckpt", before)
        for attempt in (1, 2):
            out = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks),
                                 env=env, capture_output=True, text=True, timeout=300)
            if out.returncode == 0 or attempt == 2 or XLA_CPU_STUCK not in out.stderr:
                break
            warnings.warn("XLA:CPU's collective deadlock aborted the README example; "
                          "running it once more", stacklevel=2)
            shutil.rmtree("ckpt", ignore_errors=True)
            if before.exists():
                shutil.copytree(before, "ckpt")
    assert out.returncode == 0, f"the README example failed:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture
def example_dir(tmp_path, monkeypatch):
    """A working directory holding ``corpus.yaml`` and its corpus, as the examples expect."""
    write_parquet_corpus(tmp_path / "data" / "train", n_files=4, docs_per_file=700,
                         row_group_size=128, seed=7, min_words=10, max_words=60)
    (tmp_path / "corpus.yaml").write_text(CORPUS_YAML)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _saved(example_dir: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in (example_dir / "ckpt").iterdir() if p.name.isdigit())


def test_readme_python_examples_run_and_resume(example_dir):
    blocks = _blocks(README.read_text(), "python")
    assert len(blocks) >= 2, "README.md should hold the feed example and the checkpoint example"
    feed_example, checkpoint_example = blocks[0], blocks[1]

    # The first example alone: one epoch through the stand-in train step.
    first = _run([feed_example])
    total = first["tokens_seen"]
    steps = first["steps"]
    assert total > 0
    assert steps > 100 and steps % 100, f"the corpus should give a few hundred steps, got {steps}"

    # The checkpoint example alone, fresh: it trains the whole epoch, saving every 100 steps
    # and at the last one.
    unbroken = _run([checkpoint_example])
    assert unbroken["tokens_seen"] == total and unbroken["restored_step"] is None
    assert _saved(example_dir)[-2:] == [steps - steps % 100, steps]

    # Finished, run again: it resumes at the end (model and feed) and trains nothing more.
    again = _run([checkpoint_example])
    assert again["restored_step"] == steps and again["steps"] == 0
    assert again["tokens_seen"] == total and again["feed_step"] == steps

    # As after a crash before the last save: it resumes at the latest checkpoint and ends
    # where the unbroken run ended, without repeating or losing a batch.
    shutil.rmtree(example_dir / "ckpt" / str(steps))
    latest = _saved(example_dir)[-1]
    assert latest == steps - steps % 100
    resumed = _run([checkpoint_example])
    assert resumed["restored_step"] == latest
    assert resumed["tokens_seen"] == total
    assert resumed["steps"] == steps - latest  # the batches of this run
    assert resumed["feed_step"] == steps
    assert _saved(example_dir)[-1] == steps


def test_readme_config_block_is_valid(tmp_path):
    blocks = _blocks(README.read_text(), "yaml")
    assert blocks, "README.md should show a config"
    raw = yaml.safe_load(blocks[0])
    for source in raw["sources"]:
        for path in source["paths"]:
            write_parquet_corpus(tmp_path / path, n_files=2, docs_per_file=10, row_group_size=8,
                                 seed=1)
    (tmp_path / "corpus.yaml").write_text(blocks[0])
    config = load_config(str(tmp_path / "corpus.yaml"))
    assert config.seq_len == raw["seq_len"] and config.runtime.workers == raw["workers"]


def test_every_docs_page_is_linked_from_readme():
    linked = {(README.parent / target).resolve()
              for target, _ in _links(README.read_text())}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def _links(text: str) -> list[tuple[str, str]]:
    """(path, anchor) of every relative Markdown link outside code blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for path, anchor in _links(page.read_text()):
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{path} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{path}#{anchor} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


HISTORY = re.compile(r"\bsessions?\b|before this|an earlier run|this version|\b(first|second|"
                     r"third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth) "
                     r"session", re.IGNORECASE)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_documentation_speaks_of_the_product(page):
    found = [m.group(0) for m in HISTORY.finditer(page.read_text())]
    assert not found, f"{page.relative_to(ROOT)} speaks of development history: {found}"
