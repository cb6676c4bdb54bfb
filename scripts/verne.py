"""A public-domain long text for quality checks: Verne's "Around the World in Eighty Days",
the copy cargo already keeps in the esaxx-rs crate (no download of its own)."""
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def verne_path() -> Path:
    """Where cargo keeps the esaxx-rs crate's copy of the novel (it fetches the crate if needed)."""
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--locked"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )
    for pkg in json.loads(meta.stdout)["packages"]:
        if pkg["name"] == "esaxx-rs":
            return Path(pkg["manifest_path"]).parent / "data" / "eighty.txt"
    raise SystemExit("esaxx-rs is not in the cargo metadata: is the Cargo.lock the project's?")


def verne_text(path: Path) -> str:
    text = path.read_text(encoding="utf-8-sig")
    # Keep the novel, not Project Gutenberg's header and licence.
    start = text.index("*** START OF")
    start = text.index("\n", start) + 1
    end = text.index("*** END OF")
    return text[start:end]
