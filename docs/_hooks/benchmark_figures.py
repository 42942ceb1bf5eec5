"""MkDocs hook: publish the benchmark scripts' PNGs from `benchmarks/results*/`.

The benchmark scripts write their figures next to their tables, outside `docs/`. This
hook adds every such PNG to the site under its repository path (for example
`benchmarks/results/grad_time_memory_vs_d.png`), so `docs/benchmarks.md` embeds the
files the scripts wrote, and a figure that a page names but no script produced fails
the strict build as a broken link.
"""

from pathlib import Path

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    root = Path(config["config_file_path"]).resolve().parent
    for png in sorted(root.glob("benchmarks/results*/**/*.png")):
        src_uri = png.relative_to(root).as_posix()
        files.append(
            File(
                src_uri,
                src_dir=str(root),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
