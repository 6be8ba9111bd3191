"""The training corpus: every host has it offline (docs/TRAINING.md, "Corpus").

By default the Python standard library's own source files of the interpreter that runs the
command (`sysconfig.get_paths()["stdlib"]`, every `*.py` below it, recursively), test folders
included (they are real Python too, and they more than double the text: 31 MB instead of 12 MB
on CPython 3.11, which a 27M-parameter model needs more than it needs tidier files). Left out:
`site-packages` / `dist-packages` (installed packages, not the standard library; pyenv keeps
them below the stdlib folder), `__pycache__`, and files that are not UTF-8 (a few deliberately
broken test inputs; counted in the record).

The split is by file: a file is held out when the first 8 hex digits of sha256(relative path)
modulo 1000 fall below `HELDOUT_PER_MILLE` (50: about 5%), the same on every host and Python
version. The corpus digest is a sha256 over the sorted relative paths and their contents'
sha256; the held-out list has its own digest, and the record keeps every held-out file's
sha256 so that prompts cut later (`heldout_prompts`) come from exactly the files held out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np

HELDOUT_PER_MILLE = 50
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
RECORD_FILE = "train.json"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 1000 < HELDOUT_PER_MILLE


def _digest_lines(lines: list[str]) -> str:
    return hashlib.sha256("".join(lines).encode()).hexdigest()


@dataclasses.dataclass
class Corpus:
    root: Path
    train: dict[str, str]  # relative path -> text, sorted by path
    heldout: dict[str, str]
    file_sha256: dict[str, str]  # every kept file
    skipped_not_utf8: list[str]
    digest: str  # sha256 over "path\0sha256(content)\n" of every kept file, sorted

    @property
    def heldout_digest(self) -> str:
        return _digest_lines([f"{p}\n" for p in self.heldout])

    def record(self) -> dict:
        """What train.json keeps about the corpus and the split."""
        return {"root": str(self.root), "digest": self.digest,
                "files": len(self.train) + len(self.heldout),
                "bytes": sum(len(t.encode()) for t in [*self.train.values(), *self.heldout.values()]),
                "skipped_not_utf8": self.skipped_not_utf8,
                "split": {"rule": f"sha256(relative path)[:8] % 1000 < {HELDOUT_PER_MILLE}",
                          "train_files": len(self.train), "heldout_files": len(self.heldout),
                          "heldout_list_sha256": self.heldout_digest,
                          "heldout_sha256": {p: self.file_sha256[p] for p in self.heldout}}}


def sample(files: dict[str, str], max_bytes: int | None) -> list[str]:
    """The paths of `files` (relative path -> text) to train on: all of them, in path order, or
    with max_bytes a fixed sample spread over the whole tree: taken in sha256(path) order, each
    file whose text still fits in max_bytes with those taken before (the first one always), and
    returned in path order. The same on every run and host for the same corpus."""
    if max_bytes is None:
        return list(files)
    picked, total = [], 0
    for rel in sorted(files, key=lambda r: hashlib.sha256(r.encode()).hexdigest()):
        n = len(files[rel].encode())
        if picked and total + n > max_bytes:
            continue
        picked.append(rel)
        total += n
    return sorted(picked)


def load_corpus(root: str | Path | None = None) -> Corpus:
    """Every *.py below root (default: this interpreter's stdlib), split by file."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus {root}: not a folder")
    paths = sorted((p for p in root.rglob("*.py")
                    if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    train, heldout, sha, skipped, lines = {}, {}, {}, [], []
    for p in paths:
        rel = p.relative_to(root).as_posix()
        data = p.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        sha[rel] = hashlib.sha256(data).hexdigest()
        lines.append(f"{rel}\0{sha[rel]}\n")
        (heldout if is_heldout(rel) else train)[rel] = text
    if not train or not heldout:
        raise ValueError(f"corpus {root}: {len(train)} training and {len(heldout)} held-out "
                         "*.py files; need at least one of each (a larger folder)")
    return Corpus(root, train, heldout, sha, skipped, _digest_lines(lines))


def cut_prompts(texts: list[str], tok, n: int, prompt_tokens, seed: int) -> list[list[int]]:
    """n prompts, each the first `prompt_tokens` ids of a file's text from a random line on.

    prompt_tokens: an int, or (lo, hi) for a length drawn in [lo, hi] per prompt. A file is
    drawn uniformly, then a line start in it; a draw that leaves too few tokens is dropped and
    drawn again (an error after 50 n draws: the files are too short). Draws are encoded in
    batches (the tokenizer's threads). Deterministic in seed."""
    rng = np.random.default_rng(seed)
    lo, hi = (prompt_tokens, prompt_tokens) if isinstance(prompt_tokens, int) else prompt_tokens
    if not 1 <= lo <= hi:
        raise ValueError(f"cut_prompts: prompt_tokens {prompt_tokens!r}: need 1 <= lo <= hi")
    data = [t.encode() for t in texts]
    starts = [np.flatnonzero(np.frombuffer(d, np.uint8) == 10) for d in data]
    out, draws = [], 0
    while len(out) < n:
        if draws > 50 * max(n, 1):
            raise ValueError(f"cut_prompts: could not cut {n} prompts of {prompt_tokens} tokens "
                             f"from {len(texts)} files")
        wants, chunks = [], []
        for _ in range(n - len(out)):
            draws += 1
            i = int(rng.integers(len(texts)))
            want = int(rng.integers(lo, hi + 1))
            nl = starts[i]
            at = 0 if len(nl) == 0 else int(nl[int(rng.integers(len(nl)))]) + 1
            # bytes enough for `want` tokens of code (about 3.4 bytes each) and one more
            wants.append(want)
            chunks.append(data[i][at:at + 8 * want + 64].decode("utf-8", errors="ignore"))
        for want, ids in zip(wants, tok.encode_batch(chunks)):
            if len(ids) > want:  # one more than needed: the last token is whole, not cut short
                out.append(ids[:want])
    return out


def heldout_prompts(folder, n: int, prompt_tokens, seed: int) -> list[list[int]]:
    """n prompts of prompt_tokens ids (an int, or (lo, hi) for a length per prompt) cut from the
    held-out files of the target in `folder` (its train.json names them and their sha256; its
    tokenizer.json encodes them), as cut_prompts cuts them; deterministic in seed.

    The files are read from the corpus root the record names (the host's stdlib by default); a
    missing or changed file is an error naming it (prompts would not be held out any more)."""
    from engine.text import load_tokenizer

    folder = Path(folder)
    rec = json.loads((folder / RECORD_FILE).read_text())
    corpus = rec["corpus"]
    root = Path(corpus["root"])
    texts = []
    for rel, want in sorted(corpus["split"]["heldout_sha256"].items()):
        p = root / rel
        try:
            data = p.read_bytes()
        except OSError as e:
            raise FileNotFoundError(f"{folder / RECORD_FILE}: held-out file {p} is unreadable "
                                    f"({e}); was the target trained on another host's corpus?") from e
        if hashlib.sha256(data).hexdigest() != want:
            raise ValueError(f"{folder / RECORD_FILE}: held-out file {p} changed since training "
                             f"(sha256 {want[:16]}... recorded)")
        texts.append(data.decode("utf-8"))
    return cut_prompts(texts, load_tokenizer(folder), n, prompt_tokens, seed)
