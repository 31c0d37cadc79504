"""Every reference the documentation and the sources make resolves: markdown links to files and
to headings, citations of a README or ARCHITECTURE.md section by its quoted heading, and no
citation of a document the repository does not hold."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import REPO

LINK = re.compile(r"(?<!!)\[[^\]]+\]\(([^)\s]+)\)")
CITATION = re.compile(r'\b(README|ARCHITECTURE\.md|deploy/README\.md)(?: \(|: |\s)"([^"]+)"')


def tracked(*suffixes: str) -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return [REPO / n for n in names if n.endswith(suffixes) and (REPO / n).exists()]


def headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", ""))
    return text.replace(" ", "-")


def test_markdown_links_resolve():
    broken = []
    for doc in tracked(".md"):
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in {slug(h)
                                                                    for h in headings(dest)}:
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken


def test_section_citations_name_real_sections():
    docs = {"README": REPO / "README.md", "ARCHITECTURE.md": REPO / "ARCHITECTURE.md",
            "deploy/README.md": REPO / "deploy" / "README.md"}
    known = {name: set(headings(path)) for name, path in docs.items()}
    broken = []
    for source in tracked(".py", ".md", ".yml", ".yaml", ".ts", ".json", "Makefile",
                          "Dockerfile", ".sql", ".proto"):
        text = source.read_text(errors="replace")
        for doc, section in CITATION.findall(text):
            section = " ".join(section.split())  # a citation may wrap a line
            if section not in known[doc]:
                broken.append(f"{source.relative_to(REPO)}: {doc} \"{section}\"")
    assert not broken, broken


def test_no_citation_of_documents_outside_the_repository():
    outside = re.compile("|".join(("DESIGN §", r"DESIGN\.md", r"STYLE\.md", r"PROVIDERS\.md")))
    found = [str(p.relative_to(REPO)) for p in tracked(".py", ".md", ".yml", ".yaml", ".ts")
             if p != Path(__file__) and outside.search(p.read_text(errors="replace"))]
    assert not found, found


def test_the_slug_rule_matches_githubs_on_known_cases():
    assert slug("Running against an external PostgreSQL") == \
        "running-against-an-external-postgresql"
    assert slug("Byte stability and `prefix_sha256`") == "byte-stability-and-prefix_sha256"
    assert slug("Epochs: when the prefix may change") == "epochs-when-the-prefix-may-change"
