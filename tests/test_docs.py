"""The documentation cannot rot: README.md and docs/ are checked on every run of README's test command.

* every ``python`` block of README.md and docs/**/*.md runs (one fresh interpreter per page, blocks in order in one
  namespace, as one rank of a one-rank torchrun job; ``tests/_snippets.py``), except blocks marked
  ``<!-- snippet: skip (reason) -->``; a broken snippet fails (shown below with one);
* every relative link and image resolves to a file of the checkout, and a ``#anchor`` into a markdown file to one
  of its headings;
* ``mkdocs build --strict`` passes (when mkdocs is installed: the ``test`` and ``docs`` extras bring it);
* README stays short, and its quick start and test command stay what CI runs.
"""

import importlib.util
import os
from html.parser import HTMLParser
import re
import subprocess
import sys

import pytest

from _deadline import scaled

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _snippets as S  # noqa: E402

ROOT = S.ROOT
README = os.path.join(ROOT, "README.md")
PAGES = [p for p in S.doc_files() if any(b.lang == "python" and b.skip is None for b in S.blocks(p))]

QUICK_START = ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[train]" '
               '&& powersgd-triton train')
TEST_COMMAND = ('python3 -m venv .venv-test && . .venv-test/bin/activate && pip install torch==2.13.0 && pip install -e '
                '".[test]" && python -m pytest tests bench --quick --benchmark-disable -m "not aot_matrix and not slow" '
                '-n auto --maxprocesses 4 --dist loadgroup -rs')


def _rel(path):
    return os.path.relpath(path, ROOT)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_python_snippets_run(page):
    proc = S.run_page(page)
    assert proc.returncode == 0, f"{_rel(page)}:\n{proc.stdout}\n{proc.stderr}"
    ran = [b for b in S.blocks(page) if b.lang == "python" and b.skip is None]
    assert proc.stdout.count("ran ") == len(ran), proc.stdout


def test_a_broken_snippet_fails_and_names_its_line(tmp_path):
    """The runner is not a test that cannot fail: a page whose second block raises fails with that block's line;
    blocks share a namespace; a skipped block does not run; a skip without its reason is refused."""
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nfrom powersgd_triton import PowerSGDState\nx = 1\n```\n\ntext\n\n"
                    "<!-- snippet: skip (needs a GPU) -->\n```python\nraise SystemExit('skipped block ran')\n```\n\n"
                    "```python\nassert x == 1\nPowerSGDState(None, matrix_approximation_rank=0)\n```\n")
    proc = S.run_page(str(page))
    assert proc.returncode == 1
    assert f"snippet failed: {page}:16" in proc.stderr and "ValueError" in proc.stderr, proc.stderr
    assert proc.stdout == f"ran {page}:4\n" and "skipped block ran" not in proc.stderr
    page.write_text(page.read_text().replace("matrix_approximation_rank=0", "matrix_approximation_rank=2"))
    proc = S.run_page(str(page))
    assert proc.returncode == 0 and proc.stdout.count("ran ") == 2, proc.stderr
    page.write_text("<!-- snippet: skip -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="needs its reason"):
        S.blocks(str(page))
    page.write_text("```python\npass\n")
    with pytest.raises(ValueError, match="unclosed"):
        S.blocks(str(page))


def test_every_skipped_snippet_says_why_and_every_page_parses():
    skipped = []
    for page in S.doc_files():
        for b in S.blocks(page):  # raises for a skip without a reason, an unclosed fence
            assert b.lang != "py", f"{_rel(page)}:{b.line}: write ```python so the block is run"
            if b.skip is not None:
                skipped.append((b.path, b.line, b.skip))
    assert all(len(reason) >= 8 for _, _, reason in skipped), skipped


LINK = re.compile(r"!?\[(?:[^\]]|\][^(])*?\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _slug(title: str) -> str:
    """The anchor of a heading as Python-Markdown's toc extension (mkdocs) and GitHub make it, for plain titles."""
    title = re.sub(r"`([^`]*)`", r"\1", title)
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
    s = re.sub(r"[^\w\s-]", "", title.lower()).strip()
    return re.sub(r"[\s]+", "-", s)


def _anchors(path: str):
    out, fenced = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            m = None if fenced else HEADING.match(line)
            if m:
                out.add(_slug(m.group(2)))
            out.update(re.findall(r'<a (?:name|id)="([^"]+)"', line))
    return out


def _links(path: str):
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"(?ms)^(\s*)(```|~~~).*?^\1\2", "", text)  # not inside code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # nor inline code
    return LINK.findall(text)


def test_every_relative_link_resolves():
    bad, checked = [], 0
    for page in S.doc_files() + [os.path.join(ROOT, "notebooks", "README.md")]:
        for target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
                continue  # http(s), mailto: not checked here
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
            checked += 1
            if not os.path.exists(dest):
                bad.append(f"{_rel(page)}: {target} (no {_rel(dest)})")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                bad.append(f"{_rel(page)}: {target} (no heading #{anchor} in {_rel(dest)})")
    assert checked > 30 and not bad, "\n".join(bad)


def test_the_link_check_catches_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Top part\n\nsee [a](missing.md), [b](p.md#top-part), `[c](not-a-link.md)`, "
                    "![i](img.png) and [d](https://example.org)\n```\n[e](in-code.md)\n```\n")
    assert _links(str(page)) == ["missing.md", "p.md#top-part", "img.png", "https://example.org"]
    assert _anchors(str(page)) == {"top-part"}


def test_readme_is_short_and_keeps_its_two_commands():
    text = open(README, encoding="utf-8").read()
    assert len(text.encode("utf-8")) <= 12_000, len(text.encode("utf-8"))
    assert QUICK_START in text and TEST_COMMAND in text


def test_ci_and_the_load_run_use_readmes_test_command():
    """.ci/run runs README's pytest command verbatim; .ci/loadrun (issue 34's load test) README's setup and pytest."""
    setup, tests = TEST_COMMAND.split(" && python -m pytest ")
    tests = "python -m pytest " + tests
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert f"\ntier main {tests}\n" in f.read()  # the whole line: nothing added or left out
    with open(os.path.join(ROOT, ".ci", "loadrun"), encoding="utf-8") as f:
        load = f.read()
    assert f"SETUP='{setup}'" in load and f"TESTS='{tests}'" in load


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs / mkdocstrings not installed (pip install -e '.[docs]')")
@pytest.mark.timeout(600)
def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").exists()
    for page in ("api", "state", "hooks", "fsdp", "checkpoints", "integrations", "tools"):  # the API reference
        assert (tmp_path / "site" / "reference" / page / "index.html").exists(), page
    site = tmp_path / "site"
    words = {os.path.relpath(path, site): article_words(path) for path in site.rglob("*.html")}
    assert words["reference/api/index.html"] > 100
    too_long = {page: n for page, n in words.items() if n > MAX_PAGE_WORDS}
    assert not too_long, f"pages over {MAX_PAGE_WORDS} words (rendered): {too_long}"


MAX_PAGE_WORDS = 2500  # a docs page a newcomer reads, as rendered (code blocks and API entries included)


class _Article(HTMLParser):
    """The text of a built page's ``<article>`` (mkdocs-material's page body: no navigation, no search index)."""

    def __init__(self):
        super().__init__()
        self.depth, self.skip, self.text = 0, 0, []

    def handle_starttag(self, tag, attrs):
        if self.depth:
            self.depth += tag not in ("br", "img", "hr", "input", "wbr", "meta", "link")
            self.skip += tag in ("script", "style")
        elif tag == "article":
            self.depth = 1

    def handle_endtag(self, tag):
        if self.depth:
            self.skip -= tag in ("script", "style")
            self.depth -= 1

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.text.append(data)


def article_words(path) -> int:
    parser = _Article()
    with open(path, encoding="utf-8") as f:
        parser.feed(f.read())
    return len(" ".join(parser.text).split())


def test_the_word_count_reads_the_article_only(tmp_path):
    page = tmp_path / "index.html"
    page.write_text("<html><nav>menu words here</nav><article class='md-content__inner'><h1>Two words</h1>"
                    "<p>and<br>three <code>more</code></p><script>var x = 1;</script></article>"
                    "<footer>not counted</footer></html>")
    assert article_words(page) == 5
