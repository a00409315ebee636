"""Figures written as the commands write every output: at exactly the path given, atomically, with the texts a
user gave drawn as written."""

from __future__ import annotations

import os
from pathlib import Path

from ds_tree.atomic import remove


def save_figure(figure, path: Path, dpi: int) -> Path:
    """Save a matplotlib figure at exactly ``path``, creating its folder, and return ``path``.

    matplotlib appends ``.png`` to a name without an extension it knows (``plot`` becomes
    ``plot.png``), so the format is given: the suffix's when matplotlib has it (pdf, svg, ...),
    PNG otherwise. The figure is laid out here (``tight_layout``). Every title, label and legend is drawn as
    written: text the user gave with two ``$`` is not mathtext, which fails to parse ``$\\frac{$`` (the
    layout renders it, so this comes first). The figure is written to a new temporary sibling and renamed
    over ``path``: a symbolic link there is replaced, never followed to overwrite its target."""
    for text in _written_texts(figure):
        text.set_parse_math(False)
    figure.tight_layout()  # lays out the texts: after they are plain
    suffix = path.suffix.removeprefix(".").lower()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    remove(temporary)  # a leftover, or a link planted under its name
    try:
        with open(temporary, "xb") as handle:
            figure.savefig(
                handle, dpi=dpi, format=suffix if suffix in figure.canvas.get_supported_filetypes() else "png"
            )
        os.replace(temporary, path)
    finally:
        remove(temporary)
    return path


def _written_texts(figure) -> list:
    """The figure's titles, axis labels, texts and legend entries: what a command writes from its input or
    options (tick labels are matplotlib's own)."""
    texts = list(figure.texts)
    for axes in figure.axes:
        texts += [axes.title, axes.xaxis.label, axes.yaxis.label, *axes.texts]
        if axes.get_legend() is not None:
            texts += axes.get_legend().get_texts()
    return texts
