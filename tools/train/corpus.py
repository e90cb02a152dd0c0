"""Corpus for the default model: Python source shipped by Debian, split by file.

The split is a pure function of each file's path relative to its root (CRC-32 of
the path, modulo 20 == 0 goes to the held-out set, about 5%), so it does not
depend on the order of the directory walk or on which other files exist.
Files that are not valid UTF-8 are skipped (the tokenizer works on text).
"""
import os
import zlib

DEFAULT_ROOTS = ["/usr/lib/python3.11"]
HELDOUT_MOD = 20


def list_files(roots=None):
    """[(root, relpath)] of every *.py under the roots, sorted."""
    out = []
    for root in roots or DEFAULT_ROOTS:
        if not os.path.isdir(root):
            raise SystemExit("corpus: %s is not a directory (install python3.11 or pass --root)" % root)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for f in sorted(filenames):
                if f.endswith(".py"):
                    p = os.path.join(dirpath, f)
                    if os.path.isfile(p) and not os.path.islink(p):
                        out.append((root, os.path.relpath(p, root)))
    return sorted(out)


def is_heldout(relpath):
    return zlib.crc32(relpath.encode("utf-8")) % HELDOUT_MOD == 0


def read_text(root, relpath):
    """File text, or None if it is not valid UTF-8 (or is empty)."""
    with open(os.path.join(root, relpath), "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def split(roots=None):
    """(train, heldout): lists of (relpath, text)."""
    train, held = [], []
    for root, rel in list_files(roots):
        text = read_text(root, rel)
        if text is None:
            continue
        (held if is_heldout(rel) else train).append((rel, text))
    return train, held


def write_heldout(dirpath, roots=None):
    """Copy the held-out files into dirpath (flattened names), for `moetax perplexity -f DIR`."""
    os.makedirs(dirpath, exist_ok=True)
    _, held = split(roots)
    for rel, text in held:
        name = rel.replace(os.sep, "__")
        with open(os.path.join(dirpath, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    return len(held)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="list the corpus split, or write the held-out files to a folder")
    ap.add_argument("--root", action="append", help="source root (default %s)" % DEFAULT_ROOTS[0])
    ap.add_argument("--write-heldout", metavar="DIR")
    a = ap.parse_args()
    if a.write_heldout:
        print("%d held-out files written to %s" % (write_heldout(a.write_heldout, a.root), a.write_heldout))
    else:
        tr, he = split(a.root)
        print("train: %d files, %d chars; held-out: %d files, %d chars" % (
            len(tr), sum(len(t) for _, t in tr), len(he), sum(len(t) for _, t in he)))
