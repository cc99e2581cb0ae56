"""Every document the repository cites is in the repository: code, tests, experiments and docs name `.md`
files that a clone has (docs/design.md, docs/model_math.md, ...), never documents kept elsewhere.

Every backticked name of the package resolves: the inline code spans of the module, class and function
docstrings of dsv4_jax/ (read with `ast`, nothing imported) and of docs/*.md and README.md (fenced code blocks
left out) that name a module, an attribute or a file name something the package has. The rules, in order:

1. A call is cut to its callee: `foo.bar(x)` -> foo.bar (`a(...).b()` -> a).
2. Not a name, not checked: a span with anything but letters, digits, `_`, `.`, `/`, `-` (code, shell
   commands, `x = y`, JSON paths such as `stats["key"]`); one with neither `.` nor `/` (a plain identifier);
   one without a letter or starting with a digit (`1.5`); one with an empty component (`.weight`, `mtp.0..2`).
3. Not this package, not checked: a first component in EXTERNAL (libraries, their classes); a component in
   PLACEHOLDERS or made of digits (`blk.N.attn_kv`, `mtp.0.e_proj`, `OUT/ckpt/`: checkpoint tensor names
   and output layouts, never Python names); a name in RECORD_KEYS (key paths of the JSON records and GGUF
   metadata the package writes or reads, `meta.cost_tables`).
4. A file (a `/` in it, or a last component in FILE_SUFFIXES): a `.py` file or a folder must be a path of
   the repository or its last components (`speculative/loop.py`, `moe_ep.py`, `aot/`), unless it is in
   OTHER_FILES (files of the repositories the docs compare with, the docs' example script, the items of a
   converted checkpoint). Other suffixes (data, outputs, C++; `.md` has the test above) and paths under
   experiments/results/ are not checked.
5. A dotted name resolves when
   a. its first components name a module or package of dsv4_jax, by full dotted name (`dsv4_jax.ops.moe`;
      ALIASES: `d.` for `import dsv4_jax as d`) or by its last components (`ops.moe`, `moe`, `moe_ep`), and
      the rest is an attribute chain in one such module: a top-level def, class, assignment or import (so
      re-exports count), then a class's method, field, class attribute, nested class or `self.x`; past an
      attribute that is not a class, each further component must be an attribute of some class of the package;
   b. or its first component is a class of the package (`Knobs.draft_n`) and the rest a chain as in a;
   c. or its first component is in VARIABLES, the names the docs give instances (`q.codes` for a QArray,
      `config.backends`), and the rest are attributes of classes of the package;
   d. or it is a checkpoint tensor name or metadata key the package spells: it occurs, bounded by non-word
      characters, in a string constant (not a docstring) of the package (`attn.wq_a`, `rope.freq_base`).
   Anything else fails: a module the package no longer has (`spec.loop`, `cache.py`), a name its module
   does not define (`moe.no_such_function`)."""
import ast
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


# ---- backticked names (module docstring, rules 1-5) ----
PKG = os.path.join(ROOT, "dsv4_jax")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*```.*?^\s*```", re.S | re.M)
CALL = re.compile(r"^([\w./]+?)\(.*\)")
NAME_CHARS = re.compile(r"[\w./-]+")
EXTERNAL = {
    # libraries (and their usual short names)
    "jax", "jnp", "lax", "pl", "pltpu", "np", "numpy", "ml_dtypes", "torch", "transformers", "optax", "orbax",
    "flax", "gguf", "safetensors", "triton", "math", "os", "json", "pytest", "multihost_utils", "tpu_info",
    # classes of those libraries
    "Compiled", "DeepseekV4ForCausalLM",
}
PLACEHOLDERS = {"N", "NN", "E", "OUT", "MODEL", "CKPT"}
VARIABLES = {"config", "q", "state", "plan", "table", "engine", "knobs", "drafter", "counting", "fn"}
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "gguf", "safetensors", "txt", "png", "pdf", "npy", "npz",
                 "cpp", "c", "h", "toml", "sh", "csv", "yaml", "log", "html"}
# files and folders of the repositories the docs compare with, the docs' example script (docs/sharding.md),
# the items of a converted checkpoint (dsv4_jax/io/convert/writer.py)
OTHER_FILES = {
    "inference/model.py", "convert_hf_to_gguf.py", "gguf-py/gguf/constants.py", "modular_deepseek_v4.py",
    "cache_utils.py", "conversion_mapping.py", "integrations/finegrained_fp8.py", "models/deepseek_v4/",
    "models/deepseek_v4/mtp.py", "models/deepseek_v41/dspark.py", "deepseek_v41/dspark.py",
    "vllm/model_executor/models/deepseek_v4_mtp.py", "deepseek_v4_mtp.py", "draft_deepseek_v4.py",
    "components/speculative/dspark/", "deepspec/eval/base_evaluator.py", "model.py", "train_compile.py",
    "my_run.py", "target/", "mtp/", "dspark/",
}
# key paths of the JSON records and GGUF metadata the package writes or reads (no Python object)
RECORD_KEYS = {"meta.cost_tables", "meta.context", "hlo.error", "hlo.text_source", "spec.calibration_metrics",
               "dflash.block_size", "dflash.target_layers"}
# import aliases the docs use: `import dsv4_jax as d`, `from dsv4_jax import parallel as S`
ALIASES = {"d": "dsv4_jax", "S": "dsv4_jax.parallel"}


def _doc_sources() -> list[tuple[str, str]]:
    """(where, text) for every docstring of the package and every docs page, fenced code blocks removed."""
    out = []
    for dirpath, _, names in os.walk(PKG):
        for n in sorted(names):
            if not n.endswith(".py"):
                continue
            path = os.path.join(dirpath, n)
            rel = os.path.relpath(path, ROOT)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        out.append((f"{rel}:{getattr(node, 'lineno', 1)}", doc))
    pages = [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    for p in pages:
        out.append((os.path.relpath(p, ROOT), FENCE.sub("", open(p, encoding="utf-8").read())))
    return out


class _Index:
    """What the package defines, read with `ast`: modules by dotted name, classes, string constants."""

    def __init__(self):
        self.modules: dict[str, dict] = {}           # "dsv4_jax.ops.moe" -> {name: ast node or None}
        self.classes: dict[str, list[dict]] = {}     # class name -> [{attr: node}] (one per definition)
        self.strings: list[str] = []
        self.files: list[str] = []                   # repository paths, "/"-separated
        self.dirs: set[str] = set()
        for f in subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split():
            if os.path.exists(os.path.join(ROOT, f)):
                self.files.append(f)
                parts = f.split("/")
                self.dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        for f in self.files:
            if f.startswith("dsv4_jax/") and f.endswith(".py"):
                mod = f[:-3].replace("/", ".").removesuffix(".__init__")
                tree = ast.parse(open(os.path.join(ROOT, f), encoding="utf-8").read())
                self.modules[mod] = self._scope(tree.body)
                self._collect(tree)
        for mod in list(self.modules):                # a package's submodules are its attributes
            parent, _, leaf = mod.rpartition(".")
            if parent in self.modules:
                self.modules[parent].setdefault(leaf, None)

    def _scope(self, body) -> dict:
        names = {}
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names[n.id] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names[(a.asname or a.name).split(".")[0]] = node
            elif isinstance(node, (ast.If, ast.Try)):
                names.update(self._scope(node.body + getattr(node, "orelse", [])
                                         + [n for h in getattr(node, "handlers", []) for n in h.body]))
        return names

    def _collect(self, tree):
        docs = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
                    docs.add(id(node.body[0].value))
            if isinstance(node, ast.ClassDef):
                attrs = self._scope(node.body)
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                            and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                        attrs.setdefault(sub.attr, sub)
                self.classes.setdefault(node.name, []).append(attrs)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                self.strings.append(node.value)

    def modules_named(self, dotted: str) -> list[str]:
        """Modules whose full dotted name is `dotted` or ends with it at a component boundary."""
        head, _, tail = dotted.partition(".")
        if head in ALIASES:
            dotted = ALIASES[head] + ("." + tail if tail else "")
        return [m for m in self.modules if m == dotted or m.endswith("." + dotted)]

    def chain(self, scope: dict, rest: list[str]) -> bool:
        """`rest` is an attribute chain from `scope` (a module's or a class's names)."""
        if not rest:
            return True
        if rest[0] not in scope:
            return False
        node = scope[rest[0]]
        if isinstance(node, ast.ClassDef):
            return any(self.chain(c, rest[1:]) for c in self.classes[node.name])
        if isinstance(node, ast.ImportFrom) and rest[1:]:
            name = next(a.name for a in node.names if (a.asname or a.name) == rest[0])
            if name in self.classes:
                return any(self.chain(c, rest[1:]) for c in self.classes[name])
        return self.any_class_chain(rest[1:])

    def any_class_chain(self, rest: list[str]) -> bool:
        return all(any(a in c for cs in self.classes.values() for c in cs) for a in rest)

    def in_strings(self, name: str) -> bool:
        pat = re.compile(r"(?<!\w)" + re.escape(name) + r"(?!\w)")
        return any(pat.search(s) for s in self.strings)


def _classify(span: str) -> str | None:
    """The name a code span checks, or None where it is not a reference to check (rules 1-3)."""
    m = CALL.match(span)
    name = m.group(1) if m else span
    if not NAME_CHARS.fullmatch(name) or ("." not in name and "/" not in name):
        return None
    if not re.search(r"[A-Za-z]", name) or name[0].isdigit():
        return None
    parts = re.split(r"[./]", name.rstrip("/"))
    if "" in parts or parts[0] in EXTERNAL:
        return None
    if any(p in PLACEHOLDERS or p.isdigit() for p in parts):
        return None
    return name


def _resolves(name: str, ix: _Index) -> bool:
    """Rules 3 (RECORD_KEYS), 4 and 5 for a name `_classify` kept."""
    last = name.rstrip("/").rsplit("/", 1)[-1]
    suffix = last.rsplit(".", 1)[-1] if "." in last else ""
    if "/" in name or suffix in FILE_SUFFIXES:
        if name in OTHER_FILES or name.startswith("experiments/results/"):
            return True
        if name.endswith("/"):
            d = name.rstrip("/")
            return any(x == d or x.endswith("/" + d) for x in ix.dirs)
        if suffix != "py":
            return True
        return any(f == name or f.endswith("/" + name) for f in ix.files)
    if name in RECORD_KEYS:
        return True
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        for mod in ix.modules_named(".".join(parts[:k])):
            if ix.chain(ix.modules[mod], parts[k:]):
                return True
    if parts[0] in ix.classes and any(ix.chain(c, parts[1:]) for c in ix.classes[parts[0]]):
        return True
    if parts[0] in VARIABLES and ix.any_class_chain(parts[1:]):
        return True
    return ix.in_strings(name)


def test_every_backticked_name_resolves():
    ix = _Index()
    bad, checked = set(), 0
    for where, text in _doc_sources():
        for m in CODE_SPAN.finditer(text):
            name = _classify(m.group(1))
            checked += name is not None
            if name and not _resolves(name, ix):
                bad.add(f"{where}: `{m.group(1)}`")
    assert checked > 500, f"only {checked} names checked: the extraction lost them"
    assert not bad, "backticked names that the package does not have:\n" + "\n".join(sorted(bad))


def test_the_resolver_sees_a_stale_name():
    ix = _Index()
    for good in ("moe_ep.reads_stack_in_place", "inplace.reads_expert_stack", "ops.branch.switch_in_place",
                 "moe.StackedExperts", "dsv4_jax.model.decode.process_block", "speculative/loop.py",
                 "program.Program.verify", "Knobs.draft_n", "attn.wq_a"):
        assert _resolves(_classify(good), ix), good
    for stale in ("moe.no_such_function", "spec.loop", "cache.py", "sharding.param_shardings",
                  "generate.prefill_chunked", "spec/loop.py", "NoSuchClass.x"):
        assert _classify(stale) == stale and not _resolves(stale, ix), stale
    for skipped in ("jnp.dot", "np.asarray(a)", "1.5", "blk.N.attn_kv", "x = a.b", 'stats["key"]', ".weight",
                    "dsv4-convert --out x"):
        assert _classify(skipped) is None, skipped
    assert _classify("foo.bar(x, y)") == "foo.bar"
