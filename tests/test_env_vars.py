"""docs/user-guide.md's table of environment variables lists exactly the FUSION_* variables the library reads
(fusion/, kernels/, codegen/): a switch added without a row, or a row left behind by a removed switch, fails here."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READ = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](FUSION_[A-Z0-9_]+)["']""")
NAMED = re.compile(r"""["'](FUSION_[A-Z0-9_]+)["']""")   # a name kept in a constant, read elsewhere (DISABLE_ENV)


def _read_by_the_library() -> set[str]:
    names = set()
    for folder in ("fusion", "kernels", "codegen"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            names |= set(READ.findall(text))
            names |= {n for n in NAMED.findall(text) if re.search(r"\w+ = [\"']" + n + r"[\"']", text)}
    return names


def _documented() -> set[str]:
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    section = guide.split("### Environment variables", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(FUSION_[A-Z0-9_]+)` \|", section, flags=re.M))


def test_the_user_guide_lists_every_variable_the_library_reads():
    read, documented = _read_by_the_library(), _documented()
    assert "FUSION_CACHE_DIR" in read and "FUSION_DISABLE_TEMPLATES" in read   # the scan finds both kinds of read
    assert read - documented == set(), f"read but not in docs/user-guide.md's table: {sorted(read - documented)}"
    assert documented - read == set(), f"in the table but read nowhere: {sorted(documented - read)}"
