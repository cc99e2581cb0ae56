"""Every document the repository cites is in the repository: code, tests, experiments and docs name `.md`
files that a clone has (docs/design.md, docs/model_math.md, ...), never documents kept elsewhere."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MD_REF = re.compile(r"(?<![\w/.$-])((?:\.{1,2}/|[\w-]+/)*[\w.-]+\.md)\b")
# a bare file name counts as a citation where it is cited: "x.md §2", "(x.md", "see x.md", a markdown link
CITED_BARE = re.compile(r"(\]\(|see |to `)$")
OUTSIDE = re.compile(r"\.\./shared/|\bshared/(spec|reference|DESIGN)")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if f.endswith((".py", ".md", ".toml", ".sh")) and os.path.exists(os.path.join(ROOT, f))]


def _exists(ref: str, citing: str, basenames: set[str]) -> bool:
    here = os.path.dirname(os.path.join(ROOT, citing))
    if os.path.exists(os.path.join(ROOT, ref)) or os.path.exists(os.path.join(here, ref)):
        return True
    return "/" not in ref and ref in basenames        # a bare file name: some file of the repository


def test_every_cited_document_exists():
    files = _tracked()
    basenames = {os.path.basename(f) for f in files}
    missing = []
    for f in files:
        text = open(os.path.join(ROOT, f), encoding="utf-8", errors="replace").read()
        for m in MD_REF.finditer(text):
            ref = m.group(1)
            if "*" in ref or "{" in ref or os.path.basename(f) == "test_docs.py":
                continue
            after = text[m.end():m.end() + 3]
            if "/" not in ref and not (after.lstrip("`").startswith(" §")
                                       or CITED_BARE.search(text[max(0, m.start() - 4):m.start()])):
                continue
            if not _exists(ref, f, basenames):
                missing.append(f"{f}: {ref}")
        if os.path.basename(f) != "test_docs.py":
            missing += [f"{f}: cites {m.group(0)!r} (not in the repository)" for m in OUTSIDE.finditer(text)]
    assert not missing, "documents cited but not in the repository:\n" + "\n".join(sorted(set(missing)))


def test_the_check_sees_a_missing_document():
    basenames = {"README.md"}
    assert not _exists("docs/no_such_page.md", "dsv4_jax/config.py", basenames)
    assert not _exists("no_such_spec.md", "dsv4_jax/config.py", basenames)
    assert _exists("docs/design.md", "dsv4_jax/config.py", basenames) == os.path.exists(
        os.path.join(ROOT, "docs", "design.md"))
    assert MD_REF.search("see no_such_spec.md §2.8").group(1) == "no_such_spec.md"
    # in two pieces, so that a grep of the repository for citations outside it finds only real ones
    assert OUTSIDE.search("the probe in ../" + "shared/reference/x.py")
