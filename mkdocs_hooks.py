"""mkdocs hooks: the site's home page is the README, its links into docs/ made relative to the site."""

from pathlib import Path

from mkdocs.structure.files import File

README = Path(__file__).resolve().parent / "README.md"


def on_files(files, config):
    home = README.read_text().replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=home))
    return files
